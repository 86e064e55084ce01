"""Run a digests function in a subprocess whose numba kernels are compiled for a generic x86-64 CPU (no AVX, no
FMA, no F16C; in a cache folder of its own): a test compares its result with the same function's here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def digests_on_generic_cpu(module: str, function: str = "_digests"):
    """`module.function()` (JSON-able) as computed with numba's code for a generic x86-64 CPU, on one thread."""
    env = {**os.environ, "NUMBA_CPU_NAME": "generic",
           "NUMBA_CACHE_DIR": str(Path(tempfile.gettempdir()) / f"minidl-numba-generic-{os.getuid()}")}
    env.pop("NUMBA_CPU_FEATURES", None)
    code = (f"import json; from minidl.backend.cpu import lanes; from {module} import {function}\n"
            f"with lanes.using(1):\n    print(json.dumps({function}()))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])

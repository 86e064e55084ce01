"""Host-side tests of the CUDA kernel sources and their Python description.

No GPU is needed:
  (a) every text of every ``kernels/*.cu`` (float32, and with a half's entry
      points: ``kernel_specs.module_source``) compiles with nvcc for sm_70
      (sm_75 where nvcc no longer builds sm_70) and sm_90 with all
      warnings as errors (skipped, with the reason, when nvcc is absent), and
      with NVRTC, the compiler cupy.RawModule runs on the GPU, for compute_70
      and compute_90 (the ``nvidia-cuda-nvrtc-cu12`` wheel, no GPU needed;
      skipped, with the reason, where it is absent);
  (b) every kernel of ``minidl.backend.cuda.kernel_specs.KERNELS`` is an
      ``extern "C" __global__`` function of its file with exactly the
      registered parameters, both in the source text and in the PTX nvcc and
      NVRTC emit (unmangled ``.entry`` with matching parameter widths), and
      each text exports exactly the entry points of its half;
  (c) ``launch_config`` (pure host arithmetic);
  (d) the numpy reference of the dropout RNG (splitmix64) against pure-Python
      64-bit integer arithmetic, plus mask statistics and determinism.
The kernels' numerics are exercised on a GPU by the CUDA backend's tests.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
KERNEL_SRC_DIR = REPO / "kernels"
CU_FILES = sorted(p.name for p in KERNEL_SRC_DIR.glob("*.cu"))
MASK64 = (1 << 64) - 1


from minidl.backend import common  # noqa: E402 - after the paths above, as the module reads
from minidl.backend.cuda import kernel_specs as ks  # noqa: E402

# ---------------------------------------------------------------------------
# Source parsing helpers
# ---------------------------------------------------------------------------


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(HALF\(\w+\)|\w+)\s*\(([^)]*)\)', re.S)
#: (file, half) of every text the kernels are compiled as (None: float32).
TEXTS = [(f, h) for f in CU_FILES for h in ks.file_halves(f)]
TEXT_IDS = [f"{f}-{h or 'fp32'}" for f, h in TEXTS]


def each_text_once(archs: tuple[str, str]) -> list[tuple[str, str | None, str]]:
    """(file, half, arch) of the compiles of a compile test, `archs` (oldest, newest): each text once, for the oldest
    GPU of its mode (bf16 tensor cores start with Ampere: the newest, the H100's; float32 and fp16 the oldest), a
    file's only text for both. Every file and every float32 kernel compiles for both archs, for about the CPU time
    of one all-forms text per arch."""
    return [(f, h, arch) for f, h in TEXTS for arch in archs
            if ks.file_halves(f) == (None,) or arch == archs[-1 if h == "bf16" else 0]]


def _job_ids(jobs) -> list[str]:
    return [f"{f}-{h or 'fp32'}-{a}" for f, h, a in jobs]


def _normalize_param(param: str) -> tuple[str, str]:
    """``"const float* __restrict__ x"`` -> ``("x", "const float*")``."""
    p = " ".join(param.replace("__restrict__", " ").split())
    m = re.fullmatch(r"(.*?)\s*(\w+)", p)
    assert m, f"cannot parse parameter {param!r}"
    ctype = re.sub(r"\s*\*", "*", m.group(1).strip())
    return m.group(2), ctype


def _source_kernels(file: str, half: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """name -> [(param name, C type), ...] for every extern "C" kernel of `file`'s text for `half`: the file's
    ``#ifdef HALF`` block left out (None: float32), or read with HALF(name) and half_t as module_source defines
    them for that half."""
    src, _, block = _strip_comments((KERNEL_SRC_DIR / file).read_text()).partition("#ifdef HALF")
    if half is not None:
        suffix, ctype = re.search(r"#define HALF\(name\) name##(\w+)\ntypedef (\w+) half_t;",
                                  ks.module_source(file, half)).groups()
        src += re.sub(r"\bhalf_t\b", ctype, re.sub(r"\bHALF\((\w+)\)", rf"\g<1>{suffix}", block))
    out = {}
    for name, params in _KERNEL_RE.findall(src):
        assert name not in out, f"{file}: kernel {name} defined twice"
        params = params.strip()
        out[name] = [] if params in ("", "void") else [
            _normalize_param(p) for p in params.split(",")]
    return out


def _top_level_function_heads(src: str) -> list[str]:
    """Declaration text in front of every top-level ``{`` that opens a
    function body (preprocessor lines and comments removed)."""
    lines, directive = [], False
    for line in _strip_comments(src).splitlines():  # drop preprocessor lines and their continuations
        directive = directive or line.lstrip().startswith("#")
        if not directive:
            lines.append(line)
        directive = directive and line.rstrip().endswith("\\")
    src = "\n".join(lines)
    heads, depth, start = [], 0, 0
    for i, ch in enumerate(src):
        if ch == "{":
            if depth == 0:
                head = " ".join(src[start:i].split())
                if "(" in head:  # a function, not a struct
                    heads.append(head)
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                start = i + 1
        elif ch == ";" and depth == 0:
            start = i + 1
    return heads


# PTX width of each C parameter type of the registry.
_PTX_PARAM_TYPE = {
    "float": "f32", "double": "f64",
    "int": "u32", "unsigned int": "u32",
    "long long": "u64", "unsigned long long": "u64",
}


def _ptx_param_type(ctype: str) -> str:
    return "u64" if ctype.endswith("*") else _PTX_PARAM_TYPE[ctype]


def _ptx_entries(ptx: str) -> dict[str, list[str]]:
    """entry name -> list of PTX parameter types, from ``.visible .entry``."""
    out = {}
    for name, params in re.findall(r"\.visible\s+\.entry\s+(\w+)\s*\(([^)]*)\)", ptx):
        out[name] = re.findall(r"\.param\s+\.(\w+)", params)
    return out


# ---------------------------------------------------------------------------
# (a) nvcc compilation, once per session
# ---------------------------------------------------------------------------


def _find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.environ.get("CUDA_HOME") and
                 os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


NVCC_WARNING_FLAGS = ["-Werror", "all-warnings", "-Xcompiler", "-Wall"]


def _oldest_arch() -> str:
    """sm_70 (Volta, the oldest GPU the issue targets) where this nvcc can still build it; CUDA 13 dropped it,
    and there sm_75 is the oldest target."""
    nvcc = _find_nvcc()
    if nvcc is None:
        return "sm_70"
    try:
        codes = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "sm_70"
    return "sm_70" if "sm_70" in codes.split() else "sm_75"


ARCHS = (_oldest_arch(), "sm_90")
NVCC_JOBS = each_text_once(ARCHS)


@pytest.fixture(scope="module")
def nvcc_results():
    """Compile the NVCC_JOBS to cubins in parallel, keeping each one's PTX (-keep: no second front-end run).
    -> {(file, half, arch): CompletedProcess with .ptx}."""
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): "
                    "cannot compile the CUDA kernels on this machine")
    tmp = tempfile.mkdtemp(prefix="minidl_kernels_")
    jobs, ptx_paths = {}, {}
    for f, half, arch in NVCC_JOBS:
        stem = f"{f[:-3]}.{half or 'fp32'}"
        src = Path(tmp, f"{stem}.cu")
        src.write_text(ks.module_source(f, half))   # the text cupy compiles
        keep = Path(tmp, arch)
        keep.mkdir(exist_ok=True)
        ptx_paths[(f, half, arch)] = keep / f"{stem}.ptx"
        jobs[(f, half, arch)] = [nvcc, f"-arch={arch}", "-cubin", *NVCC_WARNING_FLAGS, "-keep", "-keep-dir",
                                 str(keep), "-o", str(keep / f"{stem}.cubin"), str(src)]

    def run(cmd):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {k: pool.submit(run, cmd) for k, cmd in jobs.items()}
        results = {k: fut.result() for k, fut in futures.items()}
    for k, path in ptx_paths.items():
        results[k].ptx = path.read_text() if path.exists() else ""
    yield results
    shutil.rmtree(tmp, ignore_errors=True)


def test_kernel_sources_exist():
    assert CU_FILES, f"no .cu files in {KERNEL_SRC_DIR}"
    assert set(ks.kernel_files()) <= set(CU_FILES)
    assert ks.KERNEL_DIR.resolve() == KERNEL_SRC_DIR.resolve()


@pytest.mark.parametrize("file, half, arch", NVCC_JOBS, ids=_job_ids(NVCC_JOBS))
def test_compiles_without_warnings(nvcc_results, file, half, arch):
    r = nvcc_results[(file, half, arch)]
    log = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, f"nvcc -arch={arch} {file} ({half or 'fp32'}) failed:\n{log}"
    assert "warning" not in log.lower(), f"nvcc -arch={arch} {file} ({half or 'fp32'}) warned:\n{log}"


# NVRTC: what cupy.RawModule compiles the files with, driven through ctypes.
NVRTC_ARCHS = ("compute_70", "compute_90")
#: NVRTC 12.9's notice for compute_70 (Volta, the oldest GPU the issue targets), which it still compiles.
NVRTC_ARCH_NOTICE = "Architectures prior to '<compute/sm>_75' are deprecated"


def _nvrtc_library() -> ctypes.CDLL | None:
    """libnvrtc.so.12 of the nvidia-cuda-nvrtc-cu12 wheel, or None where it is not installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    except ImportError:
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder, "lib", "libnvrtc.so.12")
        if path.exists():
            return ctypes.CDLL(str(path))
    return None


def nvrtc_compile(lib: ctypes.CDLL, source: str, name: str, arch: str) -> tuple[int, str, str]:
    """(nvrtcResult, log, PTX) of compiling `source` for `arch` with -default-device, as cupy does."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram({name}) returned {rc}"
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = b""
        if rc == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx = buf.value
        return rc, log.value.decode(errors="replace").strip(), ptx.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


NVRTC_JOBS = each_text_once(NVRTC_ARCHS)


@pytest.fixture(scope="module")
def nvrtc_results():
    """{(file, half, arch): (rc, log, ptx)} for the NVRTC_JOBS, compiled in parallel (one program per thread;
    ctypes releases the GIL)."""
    lib = _nvrtc_library()
    if lib is None:
        pytest.skip("NVRTC not found (pip install nvidia-cuda-nvrtc-cu12, the test extra on Linux x86-64): "
                    "cannot compile the CUDA kernels as cupy does")
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        compiled = pool.map(lambda k: nvrtc_compile(lib, ks.module_source(k[0], k[1]), k[0], k[2]), NVRTC_JOBS)
        return dict(zip(NVRTC_JOBS, compiled))


@pytest.mark.parametrize("file, half, arch", NVRTC_JOBS, ids=_job_ids(NVRTC_JOBS))
def test_compiles_with_nvrtc(nvrtc_results, file, half, arch):
    rc, log, _ = nvrtc_results[(file, half, arch)]
    what = f"NVRTC --gpu-architecture={arch} {file} ({half or 'fp32'})"
    assert rc == 0, f"{what} failed (nvrtcResult {rc}):\n{log}"
    warnings = [line for line in log.splitlines() if "warning" in line.lower() and NVRTC_ARCH_NOTICE not in line]
    assert not warnings, f"{what} warned:\n{log}"


def test_the_cupy_kernels_bf16_rounding_compiles_with_nvrtc_as_the_files_store():
    """`BF16_ROUND`, the preamble of the cupy kernels that store bf16, compiles and rounds as kernels/*.cu's store."""
    from minidl.backend.cuda.backend import BF16_ROUND

    lib = _nvrtc_library()
    if lib is None:
        pytest.skip("NVRTC not found (pip install nvidia-cuda-nvrtc-cu12)")
    src = BF16_ROUND + ('extern "C" __global__ void k(unsigned short* o, const float* v) '
                        '{ o[0] = minidl_bf16_bits(v[0]); }')
    for arch in NVRTC_ARCHS:
        rc, log, _ = nvrtc_compile(lib, src, "bf16_round.cu", arch)
        assert rc == 0, log
    stored = _strip_comments((KERNEL_SRC_DIR / ks.HALF_STORAGE).read_text())
    body = lambda text: re.sub(r"\s+", " ", text[text.index("const unsigned int u"):text.index(">> 16);") + 7])  # noqa: E731
    assert body(BF16_ROUND).replace("return ", "p[i].bits = ") == body(stored)


#: cupy's `float16` (cupy/_core/include/cupy/float16.cuh, a `__half` inside) as the fallback kernels use it:
#: made from a float rounded to nearest, read as a float; NVRTC here has no cuda_fp16.h, so through PTX.
CUPY_FLOAT16 = """
class float16 {
    unsigned short bits_;
public:
    __device__ float16() {}
    __device__ float16(float v) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits_) : "f"(v)); }
    __device__ operator float() const { float v; asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(bits_)); return v; }
};
"""


def test_the_cupy_fallback_kernels_compile_with_nvrtc():
    """`NORM_KERNELS` (batch norm's fallback, float32 and half forms), each as cupy generates it, compile with
    NVRTC without a warning; each kernel batch norm's fallback launches has both half forms."""
    from minidl.backend.cuda import halves
    from minidl.backend.cuda.backend import NORM_KERNELS
    from tests.backend.test_cuda_host import _CTYPES, _cupy_like_source

    launched = ("sum", "sqdev", "affine", "dot", "dx", "scale")
    assert {halves.variant(k, h) for k in launched for h in ("bf16", "fp16")} <= set(NORM_KERNELS)
    lib = _nvrtc_library()
    if lib is None:
        pytest.skip("NVRTC not found (pip install nvidia-cuda-nvrtc-cu12)")
    ctypes_ = {**_CTYPES, "float16": "float16"}
    src = CUPY_FLOAT16 + "".join(dict.fromkeys(getattr(k, "preamble", "") for k in NORM_KERNELS.values())) + \
        "".join(_cupy_like_source(name, k, ctypes_) for name, k in NORM_KERNELS.items())
    for arch in NVRTC_ARCHS:
        rc, log, ptx = nvrtc_compile(lib, src, "norm_kernels.cu", arch)
        assert rc == 0, f"NVRTC {arch} (nvrtcResult {rc}):\n{log}\n{src}"
        warnings = [line for line in log.splitlines() if "warning" in line.lower() and NVRTC_ARCH_NOTICE not in line]
        assert not warnings, log
        assert set(_ptx_entries(ptx)) == {f"minidl_{name}" for name in NORM_KERNELS}


# ---------------------------------------------------------------------------
# (b) symbols and signatures
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ks.KERNELS))
def test_spec_matches_source(name):
    spec = ks.KERNELS[name]
    found = _source_kernels(spec.file, spec.half or None)
    assert name in found, f'{spec.file} has no extern "C" __global__ void {name}(...)'
    src_params = found[name]
    assert len(src_params) == spec.nargs, (
        f"{name}: {len(src_params)} parameters in {spec.file}, {spec.nargs} in kernel_specs")
    assert src_params == [(a.name, a.ctype) for a in spec.args]


@pytest.mark.parametrize("file, half", TEXTS, ids=TEXT_IDS)
def test_each_text_defines_the_registered_kernels_of_its_half(file, half):
    """A float32 text defines the file's float32 kernels only; a half's text those and the half's forms."""
    registered = {s.name for s in ks.kernels_in_file(file) if s.half in ("", half or "")}
    assert set(_source_kernels(file, half)) == registered


@pytest.mark.parametrize("file", CU_FILES)
def test_every_global_is_extern_c(file):
    src = _strip_comments((KERNEL_SRC_DIR / file).read_text())
    n_global = len(re.findall(r"\b__global__\b", src))
    assert n_global == len(_KERNEL_RE.findall(src)), (
        f'{file}: every __global__ must be written `extern "C" __global__ void name(...)`')


@pytest.mark.parametrize("file", CU_FILES)
def test_half_entry_points_are_written_once_in_one_block_at_the_end(file):
    """Each half form is one HALF(name) stub of the file's single `#ifdef HALF` block, which closes the file: no
    stub spells out a half's name or storage, and the block's stubs are the file's kernels with half forms."""
    src = _strip_comments((KERNEL_SRC_DIR / file).read_text())
    names = [name for name, _ in _KERNEL_RE.findall(src)]
    assert not [n for n in names if n.endswith(tuple(ks.HALF_SUFFIX.values()))], file
    assert not re.search(r"\b(bf16|f16)\b", src), f"{file} names a half storage type: half_t is the text's"
    head, sep, block = src.partition("#ifdef HALF")
    with_halves = {s.base for s in ks.kernels_in_file(file) if s.half}
    assert bool(sep) == bool(with_halves) and "#ifdef HALF" not in block and "HALF(" not in head, file
    assert block.strip().endswith("#endif") or not sep, f"{file}: the HALF block must close the file"
    assert sorted(n[5:-1] for n in names if n.startswith("HALF(")) == sorted(with_halves)


@pytest.mark.parametrize("file, half", TEXTS, ids=TEXT_IDS)
def test_source_is_device_only_and_nvrtc_friendly(file, half):
    """cupy.RawModule compiles with NVRTC: no standard headers, so no
    #include and no header-only macros/typedefs; and no host code (the half storage put before it included)."""
    src = _strip_comments(ks.module_source(file, half))
    assert not re.search(r"^\s*#\s*include", src, re.M), f"{file}: #include"
    banned = re.findall(r"\b(INFINITY|NAN|FLT_MAX|FLT_MIN|HUGE_VALF|u?int(?:8|16|32|64)_t"
                        r"|std::\w+|printf|__host__|main)\b", src)
    assert not banned, f"{file}: not available under NVRTC / host code: {sorted(set(banned))}"
    for head in _top_level_function_heads(src):
        assert "__global__" in head or "__device__" in head, (
            f"{file}: host function (neither __global__ nor __device__): {head}")


def _check_ptx_entries(file: str, half: str | None, ptx: str) -> None:
    """The module compiled from `file`'s text for `half` exports every registered kernel of that half (float32's
    and, with a half, its forms) under its plain (unmangled) name with parameters of the registered widths, and
    nothing else."""
    entries = _ptx_entries(ptx)
    specs = [s for s in ks.kernels_in_file(file) if s.half in ("", half or "")]
    assert set(entries) == {s.name for s in specs}, f"{file} ({half or 'fp32'}): PTX entries {sorted(entries)}"
    for s in specs:
        assert len(entries[s.name]) == s.nargs, f"{s.name}: PTX has {len(entries[s.name])} params"
        assert entries[s.name] == [_ptx_param_type(a.ctype) for a in s.args], s.name


def test_ptx_entries_match_specs(nvcc_results):
    for (file, half, arch), r in nvcc_results.items():
        assert r.returncode == 0, f"nvcc -arch={arch} {file} ({half or 'fp32'}) failed:\n{r.stderr}"
        _check_ptx_entries(file, half, r.ptx)


@pytest.mark.parametrize("file, half", TEXTS, ids=TEXT_IDS)
def test_nvrtc_ptx_entries_match_specs(nvrtc_results, file, half):
    rc, log, ptx = next(r for (f, h, _), r in nvrtc_results.items() if (f, h) == (file, half))
    assert rc == 0, log
    _check_ptx_entries(file, half, ptx)


def test_every_kernel_is_in_the_texts_of_its_half_only():
    """Over all the texts, every registered kernel is defined once per text of its half (a half form in its
    half's text alone, a float32 kernel in each text of its file) and nothing else is: the registry lists each
    entry point once."""
    for name, spec in ks.KERNELS.items():
        texts = {h for h in ks.file_halves(spec.file) if name in _source_kernels(spec.file, h)}
        assert texts == ({spec.half} if spec.half else set(ks.file_halves(spec.file))), name
    defined = {n for f, h in TEXTS for n in _source_kernels(f, h)}
    assert defined == set(ks.KERNELS) and len(ks.KERNELS) == len({(s.file, s.name) for s in ks.KERNELS.values()})


def test_a_file_without_half_forms_has_only_its_float32_text():
    assert ks.file_halves("optim.cu") == (None,) and ks.file_halves("pool.cu") == (None, "bf16", "fp16")
    with pytest.raises(ValueError, match="optim.cu has no bf16 text"):
        ks.module_source("optim.cu", "bf16")


def test_registry_shape():
    assert len(ks.KERNELS) >= 20
    for name, s in ks.KERNELS.items():
        assert s.name == name and s.file in CU_FILES and s.launch in ks.LAUNCH_KINDS
        assert len(set(s.arg_names)) == s.nargs, f"{name}: duplicate argument names"
        for a in s.args:
            if not a.is_pointer:
                ks.scalar_type(a.ctype)  # every scalar type has a numpy twin
        assert s.args[0].is_pointer and not s.args[0].ctype.startswith("const"), (
            f"{name}: the output comes first")
    expected = {
        "loss.cu": {"softmax_xent_forward", "softmax_xent_mean", "softmax_xent_backward",
                    "softmax_xent_ignore_forward", "softmax_xent_ignore_mean", "softmax_xent_ignore_scale",
                    "softmax_xent_ignore_backward"},
        "seq.cu": {"layernorm_forward", "layernorm_forward_apply", "layernorm_backward_dx",
                   "layernorm_backward_partials", "layernorm_backward_params", "gelu_forward", "gelu_backward",
                   "softmax_forward", "softmax_backward", "embedding_forward", "embedding_backward",
                   "position_embedding_forward", "position_embedding_backward"},
        "optim.cu": {"sgd_update", "adam_update", "sgd_update_dev", "adam_update_dev"},
        "compress.cu": {"sz_quantize", "sz_encode_blocks", "sz_gather_planes", "sz_decode_blocks",
                        "sz_scatter_outliers"},
        "pool.cu": {"maxpool2d_forward", "maxpool2d_backward", "avgpool2d_forward",
                    "avgpool2d_backward", "global_avgpool_forward", "global_avgpool_backward"},
        "elementwise.cu": {"add_forward", "add_many", "accumulate", "scale_copy", "relu_forward",
                           "relu_backward", "dropout_forward", "dropout_backward",
                           "dropout_forward_dev", "dropout_backward_dev", "nonfinite_flag", "concat_copy_forward",
                           "concat_copy_backward", "lrn_forward",
                           "lrn_backward"},
    }
    for file, names in expected.items():
        assert {s.name for s in ks.kernels_in_file(file) if not s.half} == names
    assert ks.source_path("sgd_update") == ks.KERNEL_DIR / "optim.cu"


def test_the_half_storage_is_one_text_put_before_each_file_with_halves():
    """The conversions live in kernels/half_storage.cuh alone (NVRTC takes no #include): `module_source` puts it
    before exactly the files with half forms, once; no .cu file defines the storage types itself."""
    storage = (KERNEL_SRC_DIR / ks.HALF_STORAGE).read_text()
    with_halves = {s.file for s in ks.KERNELS.values() if s.half}
    assert with_halves == {"elementwise.cu", "loss.cu", "pool.cu", "seq.cu"}
    for f, half in TEXTS:
        text = ks.module_source(f, half)
        assert text.count(storage) == (f in with_halves), (f, half)
        assert "struct bf16" not in (KERNEL_SRC_DIR / f).read_text(), f


def test_half_forms_mirror_their_float32_kernel():
    """<name>_bf16 / <name>_f16 take <name>'s arguments with float storage replaced by bf16 / f16 (and
    softmax_xent_backward's dloss appended); every half type appears in its own forms only."""
    halves = [s for s in ks.KERNELS.values() if s.half]
    assert len(halves) == 74
    for s in halves:
        suffix = ks.HALF_SUFFIX[s.half]
        assert s.name.endswith(suffix)
        other = "f16" if s.half == "bf16" else "bf16"
        assert not any(other in a.ctype.split("*")[0].split() for a in s.args), s.name
        base = ks.KERNELS.get(s.name[: -len(suffix)])
        if base is None:
            assert s.base in ("round_copy", "widen_copy"), s.name   # conversions: no float32 form
            continue
        assert (base.file, base.launch) == (s.file, s.launch)
        extra = s.args[base.nargs:]
        assert [a.name for a in extra] == (["dloss"] if base.name == "softmax_xent_backward" else [])
        for a, b in zip(s.args, base.args):
            assert a.name == b.name and a.ctype in (b.ctype, b.ctype.replace("float", suffix[1:])), (s.name, a)
        assert any(a.ctype != b.ctype for a, b in zip(s.args, base.args)), s.name


def test_coerce_scalars():
    args = ks.coerce_scalars("dropout_forward", ["out", "x", 10, -1, 5, 2.0])
    assert args[:2] == ("out", "x")
    assert type(args[2]) is np.int64 and args[2] == 10
    assert type(args[3]) is np.uint64 and int(args[3]) == MASK64  # key wraps mod 2**64
    assert type(args[4]) is np.uint32 and type(args[5]) is np.float32
    args = ks.coerce_scalars("adam_update", [None] * 4 + [7, 1e-3, 0.9, 0.999, 1e-8, 0.0, 3])
    assert [type(a) for a in args[4:]] == [np.int64] + [np.float64] * 5 + [np.int32]
    with pytest.raises(TypeError, match="takes 4 arguments"):
        ks.coerce_scalars("add_forward", [1, 2, 3])


# ---------------------------------------------------------------------------
# (c) launch_config
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 17, 255, 256])
def test_launch_small_n_is_one_block(n):
    assert ks.launch_config("add_forward", n) == ((1, 1, 1), (256, 1, 1))


def test_launch_grid_stride_sizes():
    assert ks.launch_config("add_forward", 257) == ((2, 1, 1), (256, 1, 1))
    assert ks.launch_config("relu_forward", 256 * 1000) == ((1000, 1, 1), (256, 1, 1))
    # a shape is flattened
    assert ks.launch_config("relu_forward", (8, 64, 32, 32)) == ((2048, 1, 1), (256, 1, 1))


def test_launch_huge_n_is_capped():
    cap = 132 * 32
    assert ks.launch_config("add_forward", 10**12) == ((cap, 1, 1), (256, 1, 1))
    assert ks.launch_config("add_forward", 2**40, sm_count=80) == ((80 * 32, 1, 1), (256, 1, 1))
    assert ks.launch_config("add_forward", 256 * cap) == ((cap, 1, 1), (256, 1, 1))
    assert ks.launch_config("add_forward", 256 * cap + 1) == ((cap, 1, 1), (256, 1, 1))


def test_launch_respects_device_max_threads():
    grid, block = ks.launch_config("scale_copy", 1000, device_max_threads=128)
    assert block == (128, 1, 1) and grid == (8, 1, 1)


@pytest.mark.parametrize("k, threads", [(1, 1), (2, 2), (10, 16), (100, 128), (1000, 1024),
                                        (1024, 1024), (1025, 1024), (50000, 1024)])
def test_launch_loss_one_block_per_row(k, threads):
    for name in ("softmax_xent_forward", "softmax_xent_backward"):
        assert ks.launch_config(name, (64, k)) == ((64, 1, 1), (threads, 1, 1))


def test_launch_loss_edge_cases():
    # many rows: still one block per row (not capped at sm_count * 32)
    assert ks.launch_config("softmax_xent_forward", (100000, 10)) == ((100000, 1, 1), (16, 1, 1))
    # grid.x limit: the kernel grid-strides over the remaining rows
    assert ks.launch_config("softmax_xent_forward", (2**40, 10))[0] == (2**31 - 1, 1, 1)
    assert ks.launch_config("softmax_xent_forward", (0, 10))[0] == (1, 1, 1)
    assert ks.launch_config("softmax_xent_forward", (8, 1000), device_max_threads=512)[1] == (512, 1, 1)
    with pytest.raises(TypeError):
        ks.launch_config("softmax_xent_forward", 64)  # needs (N, K)
    assert ks.launch_config("softmax_xent_mean", 1000) == ((1, 1, 1), (256, 1, 1))
    assert ks.launch_config("softmax_xent_mean", 5) == ((1, 1, 1), (8, 1, 1))


def test_launch_warp_per_row():
    # 8 warps (rows) per 256-thread block
    assert ks.launch_config("global_avgpool_forward", (64 * 512, 49)) == ((4096, 1, 1), (256, 1, 1))
    assert ks.launch_config("global_avgpool_forward", (3, 49)) == ((1, 1, 1), (256, 1, 1))
    assert ks.launch_config("global_avgpool_forward", 10**9)[0] == (132 * 32, 1, 1)
    grid, block = ks.launch_config("global_avgpool_forward", 100, device_max_threads=100)
    assert block[0] % 32 == 0 and block[0] <= 100


@pytest.mark.parametrize("name", sorted(ks.KERNELS))
def test_launch_config_valid_for_every_kernel(name):
    shape = (37, 1000) if ks.KERNELS[name].launch in ("row", "warp_row") else 123457
    grid, block = ks.launch_config(name, shape)
    assert len(grid) == 3 and len(block) == 3
    assert 1 <= grid[0] <= 2**31 - 1 and grid[1:] == (1, 1)
    assert 1 <= block[0] <= 1024 and block[1:] == (1, 1)


# ---------------------------------------------------------------------------
# (d) counter-based dropout RNG reference
# ---------------------------------------------------------------------------


def _py_splitmix64(x: int) -> int:
    """SplitMix64 finaliser with Python ints, reduced mod 2**64 by hand."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


SPLITMIX_INPUTS = [0, 1, 2, 3, 42, 0xDEADBEEF, 0x9E3779B97F4A7C15, 1 << 63,
                   (1 << 64) - 0x9E3779B97F4A7C15, MASK64 - 1, MASK64,
                   12345678901234567890]


def test_splitmix64_published_value():
    # First output of the reference SplitMix64 generator seeded with 0.
    assert _py_splitmix64(0) == 0xE220A8397B1DCDAF
    assert int(common.splitmix64(np.uint64(0))) == 0xE220A8397B1DCDAF


def test_splitmix64_matches_python_ints():
    x = np.array(SPLITMIX_INPUTS, dtype=np.uint64)
    x_before = x.copy()
    z = common.splitmix64(x)
    assert z.dtype == np.uint64 and z.shape == x.shape
    assert [int(v) for v in z] == [_py_splitmix64(v) for v in SPLITMIX_INPUTS]
    assert np.array_equal(x, x_before), "input must not be modified"
    # any shape, and 0-d
    z2 = common.splitmix64(x[:10].reshape(2, 5))
    assert z2.shape == (2, 5) and np.array_equal(z2.ravel(), z[:10])
    assert common.splitmix64(np.uint64(42)).shape == ()
    assert int(common.splitmix64(np.uint64(42))) == _py_splitmix64(42)


def test_splitmix64_constants_match_cuda_source():
    src = (KERNEL_SRC_DIR / "elementwise.cu").read_text()
    for const in ("0x9E3779B97F4A7C15ULL", "0xBF58476D1CE4E5B9ULL", "0x94D049BB133111EBULL",
                  "z >> 30", "z >> 27", "z >> 31", "z >> 40"):
        assert const in src, const


def test_dropout_threshold24():
    assert common.dropout_threshold24(0.0) == 0
    assert common.dropout_threshold24(1.0) == 1 << 24
    assert common.dropout_threshold24(0.5) == 1 << 23
    assert common.dropout_threshold24(0.1) == round(0.1 * 2**24) == 1677722
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            common.dropout_threshold24(bad)
    assert common.dropout_scale(0.5) == 2.0 and common.dropout_scale(0.0) == 1.0


@pytest.mark.parametrize("key, p", [(0, 0.5), (123456789, 0.1), (MASK64 - 3, 0.5),
                                    ((1 << 63) + 5, 0.9)])
def test_dropout_mask_matches_python_ints(key, p):
    n = 16  # key near 2**64 checks that key + i wraps
    thr = common.dropout_threshold24(p)
    expected = [(_py_splitmix64((key + i) & MASK64) >> 40) >= thr for i in range(n)]
    mask = common.dropout_keep_mask(key, n, p)
    assert mask.dtype == np.bool_ and mask.shape == (n,)
    assert mask.tolist() == expected


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.8])
def test_dropout_mask_statistics(p):
    n = 100_000
    mask = common.dropout_keep_mask(2024 + int(p * 100), n, p)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(mask.mean() - (1 - p)) < 6 * sigma
    # no obvious structure: halves and even/odd positions agree too
    for part in (mask[: n // 2], mask[n // 2:], mask[0::2], mask[1::2]):
        assert abs(part.mean() - (1 - p)) < 6 * sigma * math.sqrt(2)


def test_dropout_mask_extremes():
    assert common.dropout_keep_mask(7, 1000, 0.0).all()
    assert not common.dropout_keep_mask(7, 1000, 1.0).any()
    assert common.dropout_keep_mask(7, 0, 0.5).shape == (0,)
    with pytest.raises(ValueError):
        common.dropout_keep_mask(7, -1, 0.5)


def test_dropout_mask_determinism():
    a = common.dropout_keep_mask(99, 5000, 0.5)
    b = common.dropout_keep_mask(99, 5000, 0.5)
    assert np.array_equal(a, b)
    # a prefix does not depend on n, and key + offset shifts the stream
    assert np.array_equal(common.dropout_keep_mask(99, 1234, 0.5), a[:1234])
    assert np.array_equal(common.dropout_keep_mask(99 + 1000, 4000, 0.5), a[1000:])
    # a different key gives a different mask (~half the positions differ)
    c = common.dropout_keep_mask(100_000, 5000, 0.5)
    assert 0.4 < (a != c).mean() < 0.6


def test_dropout_mask_across_chunks():
    n = (1 << 20) + 37  # crosses the internal chunk boundary
    key = MASK64 - (1 << 20)  # and wraps past 2**64 in the second chunk
    mask = common.dropout_keep_mask(key, n, 0.3)
    thr = common.dropout_threshold24(0.3)
    for i in list(range(0, 5)) + list(range((1 << 20) - 3, n)):
        assert mask[i] == ((_py_splitmix64((key + i) & MASK64) >> 40) >= thr), i

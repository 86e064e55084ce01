"""Which OpenBLAS kernel numpy runs, and a second one for the bit-identity tests (tests/test_second_blas_kernel.py)."""
from __future__ import annotations


def openblas_kernel() -> str | None:
    """threadpoolctl's `architecture` of numpy's OpenBLAS (e.g. 'Haswell', 'SkylakeX'); None for another BLAS."""
    import numpy  # noqa: F401 - threadpoolctl finds only the libraries already loaded
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("user_api") == "blas" and lib.get("internal_api") == "openblas":
            return lib.get("architecture")
    return None


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def second_kernel(current: str) -> str:
    """Another kernel this CPU can run: SandyBridge (AVX) where Haswell (AVX2) runs, else Haswell where the CPU
    has AVX2, else Prescott (SSE3, any x86-64)."""
    if current.lower() == "haswell":
        return "SandyBridge"
    return "Haswell" if _has_avx2() else "Prescott"

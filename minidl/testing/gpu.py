"""Whether the GPU benchmarks can run here: a CUDA GPU that both PyTorch and minidl's CUDA backend reach."""
from __future__ import annotations


def why_no_gpu() -> str | None:
    """None if a CUDA GPU, cupy, the cuDNN frontend and CUDA torch are here; else what is missing."""
    try:
        import torch
    except ImportError as e:
        return f"PyTorch is not importable ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    try:
        from ..backend.cuda.backend import load_cuda_modules

        load_cuda_modules()
    except Exception as e:  # noqa: BLE001 - CUDAUnavailable says what is missing
        return str(e)
    return None

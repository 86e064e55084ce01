"""Device profiles: the speeds and memory of the devices plans are made for (the simulator's roofline reads them).

Names only need this module (the command line lists them without loading the simulator); `NAME:SIZE` is a profile
with its memory set (`get_profile`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.errors import OptionError


@dataclass(slots=True, frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    flops: float          # peak float32 FLOP/s
    mem_bw: float         # device memory bandwidth, bytes/s
    link_bw: float        # host <-> device bandwidth, bytes/s (one direction)
    efficiency: float = 0.5  # share of peak FLOP/s dense layers reach in practice
    note: str = ""
    # device <-> device bandwidth, bytes/s, one direction (`--devices`); default 8.2 GiB/s: Harmony's simulator's
    # GPU-to-GPU figure (PCIe 3 peer to peer), kept for every PCIe profile; the h100 gets NVLink 4's 450 GB/s
    peer_bw: float = 8.2 * (1 << 30)
    # A measured profile (memory/calibrate.py) sets these: each copy's fixed cost (launch + DMA setup), and whether
    # offloads and prefetches run on separate streams (the CUDA backend: one per direction; `link_bw` is then what
    # each direction reaches while the other is busy). The defaults are the datasheet profiles' one FIFO stream.
    link_latency_s: float = 0.0
    duplex: bool = False
    # Device memory the process holds before the first tensor: the CUDA context and the cuBLAS/cuDNN handles
    # (their kernels' code and static buffers). Reserved from the memory a plan may use (`usable_bytes`); 0 for the
    # CPU, and for a profile whose memory is set by `NAME:SIZE` (SIZE is then what the plan may use).
    context_bytes: int = 0
    # A GPU: plans made here for it size convolution workspaces with the cuDNN model (`cudnn_model`), not the
    # CPU's menu.
    gpu: bool = False
    # Peak FLOP/s of products on half operands with float32 accumulation (--math bf16|fp16: tensor cores since
    # Volta); None: the float32 peak (no faster half arithmetic: Kepler, Maxwell, consumer Pascal, the CPU, whose
    # half kernels compute in float32)
    half_flops: float | None = None

    @property
    def flops_half(self) -> float:
        """The FLOP/s the layers of a half-precision plan compute at (`half_flops`, else `flops`)."""
        return self.half_flops if self.half_flops is not None else self.flops

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.context_bytes

    def model_label(self) -> str:
        """What an estimated step time on this profile is: a roofline model, not a measurement."""
        return (f"a roofline model of profile {self.name} ({self.flops / 1e9:g} GFLOP/s x {self.efficiency:g}, "
                f"{self.mem_bw / 1e9:g} GB/s; {self.note}), not a measurement"
                + ("" if self.gpu else " of this machine; it counts no per-layer overhead: `minidl train` times "
                   "the steps"))


GiB = 1 << 30
MiB = 1 << 20

# CUDA context + cuBLAS + cuDNN handles: estimates (typical nvidia-smi figures), unchecked
CONTEXT_KEPLER = 320 * MiB   # CUDA 8-9 / cuDNN 5-7: ~250-400 MiB with the libraries
CONTEXT_MAXWELL = 320 * MiB
CONTEXT_VOLTA = 480 * MiB    # CUDA 10-11 / cuDNN 7-8: larger kernel images
CONTEXT_HOPPER = 512 * MiB   # CUDA 12 with lazy module loading (without it cuDNN alone can pass 1 GiB)

PROFILES: dict[str, DeviceProfile] = {
    # 2-core EPYC VM: sgemm 2048^3 ~65 GFLOP/s; np.copyto ~22 GB/s read+write, so ~11 GB/s a one-way "transfer"
    "cpu": DeviceProfile("cpu", 24 * GiB, 65e9, 22e9, 11e9, 0.6, "measured on a 2-core AMD EPYC VM, 2026-11-22"),
    # datasheets below: fp32 peak, memory bandwidth, PCIe effective
    "k40c": DeviceProfile("k40c", 12 * 10**9, 4.29e12, 288e9, 10e9, 0.5, "datasheet",
                          context_bytes=CONTEXT_KEPLER, gpu=True),
    "titanx": DeviceProfile("titanx", 12 * 10**9, 6.6e12, 336e9, 10e9, 0.5, "datasheet",
                            context_bytes=CONTEXT_MAXWELL, gpu=True),
    # Tesla V100 16 GB (PCIe): 14 TFLOP/s fp32, 900 GB/s, PCIe 3 ~12 GB/s; 112 TFLOP/s fp16 on tensor cores (PCIe
    # datasheet; Volta has no bf16 arithmetic: a bf16 plan is timed at the fp16 rate, as an fp16 run would go).
    "v100": DeviceProfile("v100", 16 * 10**9, 14e12, 900e9, 12e9, 0.5, "datasheet",
                          context_bytes=CONTEXT_VOLTA, gpu=True, half_flops=112e12),
    # H100 80 GB SXM: 67 TFLOP/s fp32 (non-tensor), 3.35 TB/s HBM3, PCIe 5 x16 ~50 GB/s; 989 TFLOP/s dense bf16 and
    # fp16 on tensor cores.
    "h100": DeviceProfile("h100", 80 * 10**9, 67e12, 3.35e12, 50e9, 0.5, "datasheet", peer_bw=450e9,
                          context_bytes=CONTEXT_HOPPER, gpu=True, half_flops=989e12),
    # Harmony's simulator (Li et al., VLDB 2022; shared/PAPERS.md): 11.5 GiB/s host swap and 8.2 GiB/s GPU-to-GPU
    # (PCIe 3 peer to peer), here on a K40c's compute and 12 GB, for `--devices` tables in the paper's terms.
    "harmony": DeviceProfile("harmony", 12 * 10**9, 4.29e12, 288e9, 11.5 * GiB, 0.5,
                             "k40c datasheet; host and peer links as Harmony's simulator assumes", 8.2 * GiB,
                             context_bytes=CONTEXT_KEPLER, gpu=True),
    # Harmony's machine: 1080 Ti at boost clock; its scheduler's links per direction and --memory_cap 10 GiB
    "gtx1080ti": DeviceProfile("gtx1080ti", 11 * GiB, 11.3e12, 484e9, 11.5 * GiB, 0.5,
                               "datasheet; host and peer links (per direction) and the 10 GiB usable per GPU as "
                               "Harmony's scheduler assumes", 8.2 * GiB, duplex=True, context_bytes=GiB, gpu=True),
}


def get_profile(name: str) -> DeviceProfile:
    """A profile by name; `NAME:SIZE` (e.g. `k40c:64GB`) sets its memory, all of it the plan's (no context)."""
    base, sep, mem = name.partition(":")
    try:
        prof = PROFILES[base]
    except KeyError:
        raise OptionError(f"unknown device profile {name!r}: expected one of {', '.join(PROFILES)}, optionally "
                          f"with ':SIZE' (e.g. k40c:64GB)") from None
    if not sep:
        return prof
    from .pool import parse_size  # imports numpy: not for a name

    try:
        size = parse_size(mem)
    except ValueError as e:
        raise OptionError(f"device profile {name!r}: {e}") from None
    return replace(prof, memory_bytes=size, context_bytes=0,
                   note=f"{prof.note}; memory set to {mem}, all of it the plan's (no context reserved)")

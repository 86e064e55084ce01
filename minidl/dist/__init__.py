"""Data-parallel processes: communicators (`comm`: MPI on CPUs, `nccl` on GPUs), the `reducer` of a plan's
ALLREDUCE/REDUCED events, the ranks' `agree`ment check and `launch`. On the backend's floor: arrays and MPI, never
networks or plans."""

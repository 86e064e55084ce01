"""Several processes: the communicator layer of data-parallel training (MPI on CPUs, NCCL on GPUs).

`comm` says what training needs of a group of ranks (an in-place all-gather that can be started and waited for,
a scalar mean, a barrier, and a way to fail that every rank hears of); `reducer` runs a plan's ALLREDUCE /
REDUCED events on it; `agree` checks, before the first step, that every rank runs the same training; `launch`
finds the group a process was started in (`mpiexec`). This package sits on the backend's floor: it knows arrays
and MPI, never networks or plans.
"""

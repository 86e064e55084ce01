"""The CPU backend, the reference: numpy + BLAS kernels, and the numba-compiled ones beside them (`*_jit`)."""

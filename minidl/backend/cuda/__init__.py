"""The CUDA backend: cupy arena views, cuDNN frontend graphs, RawModule kernels (kernels/*.cu), the driver's virtual
memory."""

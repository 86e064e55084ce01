"""CUDA C sources of the cuda backend, shipped as package data and loaded with cupy.RawModule."""

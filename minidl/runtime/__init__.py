"""What runs a plan: the executor (the interpreter, debug mode), the compiled step and its CUDA-graph capture, and
the training session on top."""

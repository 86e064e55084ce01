"""The errors minidl raises on purpose: before any array exists, naming the layer, option or file and the values."""


class MinidlError(Exception):
    """Base class of every error minidl raises deliberately."""


class GraphError(MinidlError, ValueError):
    """The layer graph is malformed: a shape mismatch, a cycle, a dangling input, a duplicate name..."""


class BudgetError(MinidlError, MemoryError):
    """A memory budget is too small for the plan; the message states the smallest budget that works."""

    def __init__(self, message: str, min_budget_bytes: int | None = None, binding: str | None = None):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.binding = binding


class ResidencyError(MinidlError, RuntimeError):
    """A layer tried to read a tensor that is not resident on the device (executor debug mode)."""


class OptionError(MinidlError, ValueError):
    """An option's value is invalid; raised where it is given, naming the option, the value and what fits."""


class DistError(MinidlError, RuntimeError):
    """Data-parallel training: a bad configuration, or another rank failed or stopped answering."""


class DataError(MinidlError, ValueError):
    """A data set or a batch is unusable: NaN/Inf images, labels outside [0, classes), mismatched arrays."""


class HostMemoryError(MinidlError, MemoryError):
    """The plan's arena or a host buffer exceeds the machine's available memory; raised before allocating."""


class CheckpointError(MinidlError, ValueError):
    """A checkpoint file is damaged, is not a checkpoint, or does not match the run that loads it."""


class DivergenceError(MinidlError, FloatingPointError):
    """A non-finite loss, gradient or running statistic, raised before the update (the parameters are the last
    good step's); `layer`: the first in backward order that is not finite, None for the loss alone."""

    def __init__(self, message: str, iteration: int, layer: str | None = None):
        super().__init__(message)
        self.iteration = iteration
        self.layer = layer


# exit statuses of `minidl` (argparse's usage errors are 2 too; a bug is 1)
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


def exit_status(e: BaseException) -> int:
    """The status an error ends `minidl` with, in one process or a rank under mpiexec."""
    if isinstance(e, DivergenceError):
        return EXIT_DIVERGED
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(e, (MinidlError, ValueError, OSError)):
        return EXIT_USER_ERROR
    return 1

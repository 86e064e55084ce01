"""The errors minidl raises on purpose.

Every error a user can trigger by describing a bad network or a bad budget is raised *before* any array
exists, and its message names the layer (name and type) and the shapes involved, so the fix is obvious
without a debugger.
"""


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
    """A value given for an option (a memory size, a learning-rate schedule, a layer's or an optimizer's
    hyper-parameter, ...) is invalid; the message names the option and the value, and says what would be
    accepted. Raised where the value is given: at construction, or when the command line is parsed."""


class DistError(MinidlError, RuntimeError):
    """Data-parallel training: a bad configuration (bucket size, ranks vs batch), or another rank failed or stopped
    answering; the message names the rank, the bucket or option, and the values."""


class DataError(MinidlError, ValueError):
    """A data set or a batch is unusable: NaN/Inf images, labels outside [0, classes), mismatched arrays."""


class HostMemoryError(MinidlError, MemoryError):
    """The plan's arena (or a host buffer) is larger than the memory this machine has available; raised
    before anything is allocated."""


class CheckpointError(MinidlError, ValueError):
    """A checkpoint file is damaged, is not a checkpoint, or does not match the run that loads it."""


class DivergenceError(MinidlError, FloatingPointError):
    """Training produced a non-finite loss, gradient or running statistic (BN). Raised after backward and before
    the update, so the parameters are those of the last good step; `iteration` is the step that failed, `layer`
    the first layer (in backward order) whose gradient is not finite (None when only the loss is), or the layer
    whose running statistic is not."""

    def __init__(self, message: str, iteration: int, layer: str | None = None):
        super().__init__(message)
        self.iteration = iteration
        self.layer = layer


# Exit statuses of the `minidl` command: argparse's usage errors are 2 as well; a bug (any other exception) is 1.
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130  # the shell's convention for a run stopped by SIGINT (128 + 2)


def exit_status(e: BaseException) -> int:
    """The exit status an error ends the `minidl` command with: the same for one process and for a rank under
    mpiexec (where it is the status the failing rank aborts the job with, `dist.launch.guarded`)."""
    if isinstance(e, DivergenceError):
        return EXIT_DIVERGED
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(e, (MinidlError, ValueError, OSError)):
        return EXIT_USER_ERROR
    return 1

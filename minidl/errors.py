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
    """A value given for an option (a memory size, a learning-rate schedule, ...) is invalid; the message
    names the option and the value, and says what would be accepted."""


class DistError(MinidlError, RuntimeError):
    """Data-parallel training: a bad configuration (bucket size, ranks vs batch), or another rank failed or stopped
    answering; the message names the rank, the bucket or option, and the values."""

"""The lab's one error base: every error that bad input (a setting, a file, a request) raises derives from
``LabError``, so the app and the CLIs catch the lab's errors, show the message and let genuine bugs through."""
from kernels import KernelArgumentError


class LabError(ValueError):
    """Bad input to the lab; the message names what is wrong and nothing was changed."""


class InputError(LabError):
    """A field or argument has a wrong type or is out of range (``lab.checks``)."""


# What the app and the CLIs show as a message instead of a traceback: the lab's errors, the kernels' argument errors
# (``kernels`` depends on nothing of ours, so it has its own base) and files that cannot be read. Anything else,
# a plain ``ValueError`` included, is a bug.
USER_ERRORS = (LabError, KernelArgumentError, OSError)

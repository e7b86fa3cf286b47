"""The lab's one error base: every error that bad input (a setting, a file, a request) raises derives from
``LabError``, so the app and the CLIs catch the lab's errors, show the message and let genuine bugs through."""
import sys


class LabError(ValueError):
    """Bad input to the lab; the message names what is wrong and nothing was changed."""


class InputError(LabError):
    """A field or argument has a wrong type or is out of range (``lab.checks``)."""


class ArgumentError(InputError):
    """A call to a public entry point (``lab.checks.entry_point``) with an argument of the wrong type, an unknown
    keyword, too many positional arguments or a required one missing; the message names the function and the
    argument."""


def user_errors() -> tuple[type[Exception], ...]:
    """What the app and the CLIs show as a message instead of a traceback (``except user_errors() as exc``): the
    lab's errors, the kernels' argument errors (``paged_kernels`` depends on nothing of ours, so it has its own base)
    and files that cannot be read. Anything else, a plain ``ValueError`` included, is a bug. The kernels' errors join
    once ``paged_kernels`` is loaded (it brings torch, which the simulator's pages and commands never import;
    nothing can raise them before)."""
    kernels = sys.modules.get("paged_kernels")
    return (LabError, OSError) if kernels is None else (LabError, kernels.KernelArgumentError, OSError)

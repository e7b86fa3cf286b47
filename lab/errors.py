"""The lab's one error base: every error that bad input (a setting, a file, a request) raises derives from
``LabError``, so the app and the CLIs catch the lab's errors, show the message and let genuine bugs through."""


class LabError(ValueError):
    """Bad input to the lab; the message names what is wrong and nothing was changed."""


class InputError(LabError):
    """A field or argument has a wrong type or is out of range (``lab.checks``)."""

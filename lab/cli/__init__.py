"""The command line: ``python -m lab`` (``main``) and the argument types every CLI of the project shares (``args``).

May import: every room of ``lab``. Kept light: ``args`` loads no torch."""

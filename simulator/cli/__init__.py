"""The command line: ``python -m simulator`` (``main``), its ``sweep``, ``plan`` and ``paper`` subcommands (``sweep``)
and ``twin`` / ``twin-bench`` (``twin``).

May import: every room of ``simulator`` and ``lab``."""

"""The engine's step-time profile: timed steps on a grid of shapes, fitted to a model the simulator runs as its clock
(the digital twin's), saved and loaded as JSON.

May import: ``lab`` (errors, checks), ``lab.kv_cache``, ``lab.sched``, ``lab.engine`` (to time it)."""

"""Scheduling: the one ``Scheduler`` the engine and the simulator share (its step plans, preemption, policies)
and ``PagedPolicy``, its view of the block pool (``lab.kv_cache``) and of a host pool for swapping.

May import: ``lab`` (errors, checks), ``lab.kv_cache``."""

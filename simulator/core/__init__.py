"""The simulator proper: the engine's scheduler (``lab.sched``) with a clock instead of a model (``engine``), the
allocators it compares, the cost model and presets of models and GPUs (``models``), metrics, workloads and traces,
clusters of replicas, runs in worker processes, closed-form checks and ``runs`` (``simulate``, ``compare``).

May import: ``lab`` (errors, checks), ``lab.kv_cache``, ``lab.sched``, ``lab.profiling`` (a profile as the clock)."""

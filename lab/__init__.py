"""MiniPaged Lab: a paged KV cache and a Qwen3 runtime over it, with the measurements around them.

Rooms, each a package answering one question (docs/architecture.md draws the arrows; tests/test_import_direction.py
checks them):

- the package itself: ``errors`` (the one error root), ``checks`` (field and argument checks), ``files`` (atomic
  writes, a file's identity by content), ``hardware`` (this machine), ``latency`` (the per-request latency metrics,
  defined once);
- ``kv_cache/``: the block pool: block manager, prefix cache, host offload tier, snapshots of the pool;
- ``sched/``: the one scheduler and the paged policy it allocates through;
- ``models/``: Qwen3 presets and checkpoints; ``worker/``: the model runner, its device block tables, CUDA graphs;
- ``engine/``: ``LLMEngine`` (scheduler + runner + sampler), sampling, beam search, live runs;
- ``profiling/``: the engine's step-time profile, the simulator's clock;
- ``peer/``: vLLM beside the lab (its own environment, driven as a process; its server);
- ``bench/``: benchmarks; ``report/``: results, labels and charts; ``cli/``: ``python -m lab``.
"""

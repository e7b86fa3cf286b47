"""Twins: the simulator beside a real engine on the same workload: ours (``twin``, on its measured profile) and a real
vLLM server (``vllm_twin``; ``vllm_live`` runs it live for the app).

May import: ``simulator.core``, and in ``lab``: the engine, worker, models, profiling and peer rooms."""

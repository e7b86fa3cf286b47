"""The worker: ``ModelRunner`` runs a model's forward over the paged KV cache it owns (varlen prefill, paged
decode, swaps and copies), its block tables kept on the device, and decode steps replayed as CUDA graphs;
``ThreadPolicy`` picks torch's thread count for CPU steps by measuring what other processes take.
It sees the pool only through the block ids and slots a plan names, never the block manager.

May import: ``lab`` (errors, checks, hardware), ``lab.models``, ``paged_kernels``."""

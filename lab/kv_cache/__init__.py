"""The KV cache's block pool: ``KVBlockManager`` (free queue, block tables, ref counts, copy-on-write,
reservations), the prefix cache (content keys, lookup, eviction), the host offload tier below it, and snapshots of the
pool for people. What a block is and who holds it, nothing about when: the scheduler (``lab.sched``) decides that.

May import: ``lab`` (errors, checks). Nothing else of ours."""

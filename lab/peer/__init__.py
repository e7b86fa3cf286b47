"""vLLM beside the lab: its CPU build in an environment of its own (``scripts/vllm_peer.sh``), driven as a separate
process (``client``: the lab's side; ``driver``: run by vLLM's own Python, never imported here), its engine profiled
(``profiling``) and its OpenAI server started or found (``server``); every wait on it has an overall deadline
(``waits``). vLLM is never imported by the lab.

May import: ``lab`` (errors, checks), ``lab.engine`` (to serve ours as vLLM is served), ``lab.profiling``."""

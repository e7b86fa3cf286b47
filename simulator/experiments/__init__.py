"""Many simulations at once: the vLLM paper's figures (``paper``), sweeps over a grid and capacity plans on Ray
(``sweep``, ``plan``), and both in a child process for a long-lived host (``isolated``).

May import: ``simulator.core``, ``simulator.twins`` (the paper's runtime figures), ``lab``."""

"""What a person reads of a simulation: the headline answer, labels with units and a glossary (``report``), Plotly
charts (``charts``), and frames of the block pool over a run, from the simulator or the engine (``pool_frames``).

May import: ``simulator.core``, ``lab`` (report, engine, kv_cache)."""

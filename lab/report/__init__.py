"""What the lab reports to people: results kept in a session and on disk (labels, human numbers, the headline table)
and the Plotly charts of the pool, kernels and runtime runs.

May import: ``lab`` (errors, checks)."""

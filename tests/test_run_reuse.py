"""``compare(reuse=RunCache)`` keys a run by the content of the files its configuration reads, not their paths: a
rewritten kernel CSV is run again, an unchanged one is reused (issue 70, item 3)."""
import pandas as pd

from simulator import SimConfig
from simulator.core.runs import RunCache, compare
from simulator.core.workloads import SyntheticSpec, synthetic_workload

WORKLOAD = synthetic_workload(SyntheticSpec(num_requests=20, rate=10.0, seed=2))


def write_kernels(path, gb_per_s: float) -> None:
    pd.DataFrame({"kernel": ["cupy-v1"], "batch": [64], "context": [4096], "kv_gb_per_s": [gb_per_s]}).to_csv(path)


def test_a_rewritten_kernel_csv_is_run_again(tmp_path):
    path = tmp_path / "kernels.csv"
    config = SimConfig(capacity_tokens=8_000, kernel_csv=str(path))
    cache = RunCache(8)
    write_kernels(path, 2000.0)
    _, first = compare(WORKLOAD, [config], reuse=cache)
    _, again = compare(WORKLOAD, [config], reuse=cache)
    assert again[config.label] is first[config.label]  # the same content: reused
    write_kernels(path, 50.0)  # a much slower attention kernel, same path
    _, rewritten = compare(WORKLOAD, [config], reuse=cache)
    assert rewritten[config.label] is not first[config.label]
    assert rewritten[config.label].summary["simulated_time_s"] > first[config.label].summary["simulated_time_s"]

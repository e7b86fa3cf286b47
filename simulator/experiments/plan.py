"""Capacity planning: for each configuration (model x GPU x tp x replicas x allocator), the highest request rate
that meets every SLO (a geometric binary search over the rate, the workload's arrivals scaled), its cost per hour,
and the cheapest configuration that sustains a target rate. One Ray task per configuration, as in sweeps."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from lab.checks import check_int, check_real
from lab.cli.args import key_values
from lab.errors import InputError, LabError
from simulator.core.models import get_gpu
from simulator.core.workloads import MIN_RATE
from .sweep import OFFLOAD_GIB, WORKLOAD_DEFAULTS, check_spec, progress_bar, run_one, start_ray

# What a GiB of host memory costs an hour beside a GPU: about the on-demand price difference between a cloud's
# memory-optimised and compute-optimised instances of the same CPUs (e.g. AWS r7i vs c7i, 2026: ~$0.0036 per GiB-hour).
HOST_PRICE_PER_GIB_HOUR = 0.004

SLO_METRICS = tuple(f"{kind}_p{q}" for kind in ("ttft", "tpot", "e2e") for q in (50, 90, 99))


MIN_TOLERANCE = 1e-6  # relative; the bisection's end (float precision is 2e-16)
MAX_BISECTIONS = 64


class PlanError(LabError):
    """A plan's SLOs, lists or search settings are malformed."""


@dataclass(slots=True)
class RateSearch:
    """Start at ``start`` req/s, double (or halve) until the SLO flips, then bisect geometrically until the last
    passing and first failing rates are within ``tolerance`` of each other."""

    start: float = 1.0
    tolerance: float = 0.02
    max_steps: int = 24  # doublings or halvings before giving up (a rate 2^24 away from the start)

    def check(self) -> None:
        """Raise ``PlanError`` naming a field out of range (a tolerance below float precision never ends)."""
        check_real("RateSearch", "start", self.start, 1e-6, 1e9, error=PlanError)
        check_real("RateSearch", "tolerance", self.tolerance, MIN_TOLERANCE, 10.0, error=PlanError)
        check_int("RateSearch", "max_steps", self.max_steps, 0, 60, error=PlanError)


@dataclass(slots=True)
class PlanResult:
    table: pd.DataFrame  # one row per configuration; ``chosen`` marks the cheapest meeting the target rate
    ray_init_s: float = 0.0
    prices: dict = field(default_factory=dict)
    host_price_per_gib_hour: float = HOST_PRICE_PER_GIB_HOUR


def parse_slos(text: str) -> dict[str, float]:
    """``ttft_p90=2,tpot_p90=0.2`` -> {"ttft_p90_s": 2.0, "tpot_p90_s": 0.2}; a metric given twice is refused."""
    slos = {}
    try:
        pairs = key_values(text, "--slo")
    except InputError as exc:
        raise PlanError(str(exc)) from None
    for name, value in pairs.items():
        part = f"{name}={value}"
        if name not in SLO_METRICS:
            raise PlanError(f"SLO {name!r}: expected one of {', '.join(SLO_METRICS)}")
        try:
            limit = float(value)
        except ValueError:
            raise PlanError(f"SLO {part!r}: expected {name}=<seconds>") from None
        if not math.isfinite(limit) or limit <= 0:
            raise PlanError(f"SLO {part!r}: the limit must be a finite number of seconds > 0")
        slos[f"{name}_s"] = limit
    if not slos:
        raise PlanError("give at least one SLO, e.g. ttft_p90=2,tpot_p90=0.2")
    return slos


def meets(row: dict, slos: dict[str, float]) -> bool:
    """Every request completed (none rejected, the run did not fail) and every SLO metric within its limit."""
    if row.get("error") or row.get("num_requests_completed", 0) < row.get("num_requests", 1):
        return False
    return all(row[name] <= limit for name, limit in slos.items())


def search_max_rate(spec: dict, slos: dict[str, float], search: RateSearch) -> dict:
    """The highest rate (req/s) at which ``spec`` meets ``slos``: the row of the run at that rate, plus
    ``max_rate_req_s``, ``first_failing_rate_req_s``, ``simulations`` and ``search_bound``, which says where the
    search stopped without bracketing the answer (empty when it did): ``"no rate meets the SLOs"`` (even the lowest
    rate simulated, down to the workload's minimum ``MIN_RATE`` or ``start / 2**max_steps``, fails: then
    ``max_rate_req_s`` is 0 and ``first_failing_rate_req_s`` that lowest rate) or ``"every rate tried meets the
    SLOs"`` (``first_failing_rate_req_s`` is inf). Only rates that were simulated are reported."""
    runs = {}

    def passes(rate: float) -> bool:
        runs[rate] = run_one({**spec, "rate": rate})
        return meets(runs[rate], slos)

    low = high = None
    rate = search.start
    for _ in range(search.max_steps + 1):
        if passes(rate):
            low = rate
            if high is not None:
                break
            rate *= 2
        else:
            high = rate
            if low is not None or rate / 2 < MIN_RATE:  # a lower rate is no workload the simulator can run
                break
            rate /= 2
    if low is not None and high is not None:
        # each halving of log(high / low) is one run: at most log2(log(2^max_steps) / log(1 + tolerance)) of them
        for _ in range(MAX_BISECTIONS):
            if high / low <= 1 + search.tolerance:
                break
            middle = math.sqrt(low * high)
            low, high = (middle, high) if passes(middle) else (low, middle)
    bound = "no rate meets the SLOs" if low is None else "every rate tried meets the SLOs" if high is None else ""
    best = runs[low] if low is not None else runs[min(runs)]
    return {**best, "max_rate_req_s": low or 0.0, "first_failing_rate_req_s": high if high is not None else math.inf,
            "simulations": len(runs), "search_bound": bound}


def plan_specs(workload: dict, models: list, gpus: list, tps: list[int], replicas: list[int], allocators: list[str],
               offload_gib: list[float] = (0.0,), kv_cache_dtypes: list[str] = ("auto",), **common) -> list[dict]:
    """One spec per configuration (checked before any run). ``offload_gib``: host offload tier sizes per replica
    (GiB; paged allocators only, a contiguous one has no prefix cache to offload); ``kv_cache_dtypes``: the KV
    cache's element types to try (``auto``, ``fp8``...: ``lab.kv_cache.precision``)."""
    for gib in offload_gib:
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 <= gib < math.inf:
            raise PlanError(f"an offload tier in a plan must be a finite size >= 0 GiB (it has a price), got {gib!r}")
    for name, values in (("model", models), ("GPU", gpus), ("tp", tps), ("replicas", replicas),
                         ("allocator", allocators), ("offload tier", offload_gib), ("KV cache dtype", kv_cache_dtypes)):
        values = list(values)
        repeated = [value for index, value in enumerate(values) if value in values[:index]]
        if repeated:
            raise PlanError(f"{name} {repeated[0]!r} is given twice: the plan would run it twice, as identical rows")
    if "paged" not in allocators:
        ignored = [f"{name}={value!r}" for name, value, default in (
            ("kv_offload_gib", list(offload_gib), [0.0]), ("block_size", common.get("block_size", 16), 16))
            if value != default]
        if ignored:
            raise PlanError(f"{ignored[0]} would be ignored: it applies to the paged allocator, and the plan has "
                            f"none ({', '.join(allocators)})")
    specs = []
    for model, gpu, tp, count, allocator, kv_dtype in itertools.product(models, gpus, tps, replicas, allocators,
                                                                        kv_cache_dtypes):
        for gib in (offload_gib if allocator == "paged" else (0.0,)):
            specs.append(_plan_spec(workload, model, gpu, tp, count, allocator, float(gib),
                                    {**common, "kv_cache_dtype": kv_dtype}))
    if not specs:
        raise PlanError("the plan has no configuration (an empty list of models, GPUs, tp, replicas, allocators or "
                        "KV cache dtypes)")
    return specs


def _plan_spec(workload, model, gpu, tp, count, allocator, gib, common) -> dict:
    spec = {**WORKLOAD_DEFAULTS, **workload, "model": model, "gpu": gpu, "tp": tp, "replicas": count,
            "allocator": allocator, OFFLOAD_GIB: gib, **common}
    try:
        check_spec({**spec, "rate": 1.0})
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return spec


def run_plan(specs: list[dict], slos: dict[str, float], search: RateSearch | None = None,
             target_rate: float | None = None, prices: dict[str, float] | None = None, parallel: bool = True,
             address: str | None = None, num_cpus: int | None = None, progress: bool = True,
             on_progress: Callable[[int, int], bool | None] | None = None,
             host_price_per_gib_hour: float = HOST_PRICE_PER_GIB_HOUR) -> PlanResult:
    """Search every configuration's highest SLO-meeting rate (Ray tasks, or serially), price it (its GPUs, and its
    offload tiers' host memory) and mark the cheapest configuration that sustains ``target_rate`` (``chosen``).
    ``on_progress(done, total)`` after each; when it returns True the plan stops there (pending tasks are cancelled)
    with the configurations searched."""
    search = search or RateSearch()
    search.check()
    check_real("plan", "host_price_per_gib_hour", host_price_per_gib_hour, 0.0, 1e6, error=PlanError)
    prices = {**{str(s["gpu"]): get_gpu(s["gpu"]).price_per_hour for s in specs}, **(prices or {})}
    bar = progress_bar(len(specs), progress)
    ray_init_s = 0.0
    if parallel:
        import ray

        ray_init_s = start_ray(address, num_cpus)
        remote = ray.remote(max_retries=3)(search_max_rate)
        refs = [remote.remote(spec, slos, search) for spec in specs]
        rows = []
        for index, ref in enumerate(refs):
            rows.append(ray.get(ref))
            if _advance(bar, on_progress, len(rows), len(specs)):
                for pending in refs[index + 1:]:
                    ray.cancel(pending, force=True)
                break
    else:
        rows = []
        for spec in specs:
            rows.append(search_max_rate(spec, slos, search))
            if _advance(bar, on_progress, len(rows), len(specs)):
                break
    bar.close()
    return PlanResult(price_table(rows, slos, prices, target_rate, host_price_per_gib_hour), ray_init_s, prices,
                      host_price_per_gib_hour)


def _advance(bar, on_progress, done: int, total: int) -> bool:
    """Count one configuration; True when ``on_progress`` asks to stop."""
    bar.update(1)
    return on_progress is not None and bool(on_progress(done, total))


def price_table(rows: list[dict], slos: dict[str, float], prices: dict[str, float], target_rate: float | None,
                host_price_per_gib_hour: float = HOST_PRICE_PER_GIB_HOUR) -> pd.DataFrame:
    """The plan's table: configuration, max rate, cost per hour (GPUs, plus each replica's offload tier of host
    memory) and per million requests, the SLO metrics at the max rate, and ``chosen``."""
    table = pd.DataFrame(rows)
    for name in slos:  # a configuration whose every run failed has no metrics
        if name not in table:
            table[name] = math.nan
    table["gpus"] = table["tp"] * table["replicas"]
    if OFFLOAD_GIB not in table:
        table[OFFLOAD_GIB] = 0.0
    table["host_cost_per_hour"] = table["replicas"] * table[OFFLOAD_GIB].fillna(0.0) * host_price_per_gib_hour
    table["cost_per_hour"] = table["gpus"] * table["gpu"].astype(str).map(prices) + table["host_cost_per_hour"]
    table["cost_per_million_requests"] = table["cost_per_hour"] / (table["max_rate_req_s"] * 3600) * 1e6
    table["meets_target"] = table["max_rate_req_s"] >= (target_rate or 0.0)
    if target_rate is None:
        table["meets_target"] &= table["max_rate_req_s"] > 0
    table["chosen"] = False
    feasible = table[table["meets_target"]]
    if not feasible.empty:
        table.loc[feasible.sort_values(["cost_per_hour", "max_rate_req_s"], ascending=[True, False]).index[0],
                  "chosen"] = True
    columns = ["model", "gpu", "tp", "replicas", "allocator", "kv_cache_dtype", OFFLOAD_GIB, "gpus", "max_rate_req_s",
               "first_failing_rate_req_s", "search_bound", "cost_per_hour", "host_cost_per_hour",
               "cost_per_million_requests", "meets_target", "chosen", *slos, "throughput_tok_s",
               "simulations", "error"]
    return table[[c for c in columns if c in table] + [c for c in table if c not in columns]]


def plan_capacity(workload: dict, slos: str, models: list, gpus: list, tps: list[int], replicas: list[int],
                  allocators: list[str], target_rate: float | None = None, prices: dict[str, float] | None = None,
                  search: RateSearch | None = None, parallel: bool = True, address: str | None = None,
                  num_cpus: int | None = None, progress: bool = True,
                  on_progress: Callable[[int, int], None] | None = None, offload_gib: list[float] = (0.0,),
                  host_price_per_gib_hour: float = HOST_PRICE_PER_GIB_HOUR, kv_cache_dtypes: list[str] = ("auto",),
                  **common) -> PlanResult:
    """Parse the SLOs (``ttft_p90=2,tpot_p90=0.2``), check every configuration (``offload_gib``: host offload
    tier sizes per replica to try, GiB), then ``run_plan`` them."""
    specs = plan_specs(workload, models, gpus, tps, replicas, allocators, offload_gib, kv_cache_dtypes, **common)
    if host_price_per_gib_hour != HOST_PRICE_PER_GIB_HOUR and not any(spec[OFFLOAD_GIB] for spec in specs):
        raise PlanError(f"a host price of {host_price_per_gib_hour:g} USD per GiB-hour would be ignored: it prices "
                        f"the offload tier, and no configuration has one (--kv-offload-gib)")
    return run_plan(specs, parse_slos(slos), search, target_rate, prices, parallel, address, num_cpus, progress,
                    on_progress, host_price_per_gib_hour)

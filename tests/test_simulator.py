"""The KV memory simulator: accounting identities, conservation, closed forms, the block manager trajectory,
determinism, real traces and the CLI."""
import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis import example, given

from lab.kv_cache.block_manager import KVBlockManager
import simulator
from simulator import (ALLOCATORS, CATEGORIES, SimConfig, Simulator, SyntheticSpec, compare, simulate,
                       synthetic_workload)
from simulator.cli.main import SUMMARY_COLUMNS, main
from simulator.core.checks import closed_form_checks
from simulator.core.cluster import run_simulation
from simulator.core.metrics import rejection_warning
from simulator.core.presets import figure2_experiment


def run(workload, **config):
    return run_simulation(workload, SimConfig(**config))


def small_workload(**spec):
    defaults = dict(preset="sharegpt", num_requests=150, rate=40.0, seed=3, max_model_len=2048)
    return synthetic_workload(SyntheticSpec(**{**defaults, **spec}))


def expected_tokens(workload, completed_mask):
    outputs = workload.sample_output_tokens if workload.sample_output_tokens is not None else \
        workload.output_tokens[:, None]
    return int(outputs[completed_mask].sum())


CASES = [dict(allocator=a) for a in ALLOCATORS] + [
    dict(allocator="paged", block_size=1), dict(allocator="paged", block_size=7),
    dict(allocator="paged", block_size=256), dict(allocator="contiguous-oracle", address_space="buddy"),
    dict(allocator="paged", scheduling="chunked", max_num_batched_tokens=300),
    dict(allocator="contiguous-grow", scheduling="chunked", max_num_batched_tokens=300)]


@pytest.mark.parametrize("config", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("sharing", [{}, {"n": 3}, {"shared_prefix_tokens": 40}], ids=["plain", "n3", "prefix"])
def test_categories_sum_to_capacity_and_requests_are_conserved(config, sharing):
    workload = small_workload(**sharing)
    result = run(workload, capacity_tokens=12_000, max_points=1_000_000, **config)
    ts = result.timeseries
    assert ts["step"].diff().dropna().eq(1).mean() > 0.99  # (practically) every iteration is a sample
    assert (ts[list(CATEGORIES)].sum(axis=1) == result.summary["capacity_tokens"]).all()
    assert (ts[list(CATEGORIES)] >= 0).all().all()
    fractions = [result.summary[k] for k in ("token_states_frac", "reserved_frac", "internal_fragmentation_frac",
                                             "external_fragmentation_frac", "free_frac")]
    assert math.isclose(sum(fractions), 1.0, rel_tol=1e-9)
    completed = result.requests["finish_s"].notna().to_numpy()
    assert completed.sum() + result.requests["rejected"].sum() == len(workload)
    assert result.summary["num_requests_completed"] == len(workload)  # 12k slots fit every request
    assert result.summary["generated_tokens"] == expected_tokens(workload, completed)
    if config["allocator"] != "paged":
        assert (ts["external_fragmentation"] >= 0).all()
    else:
        assert (ts["external_fragmentation"] == 0).all()


def test_unconstrained_memory_closed_forms():
    workload = small_workload(num_requests=120)
    big = dict(capacity_tokens=10_000_000, max_model_len=2048, max_points=10_000)
    oracle = run(workload, allocator="contiguous-oracle", **big).timeseries
    assert (oracle["internal_fragmentation"] == 0).all()
    maximum = run(workload, allocator="contiguous-max", **big).timeseries
    held = maximum[["token_states", "reserved", "internal_fragmentation"]].sum(axis=1)
    assert (held == maximum["num_running"] * 2048).all()
    for block_size in (1, 16, 100):
        paged = run(workload, allocator="paged", block_size=block_size, **big)
        ts = paged.timeseries
        slack = ts["reserved"] + ts["internal_fragmentation"]
        assert (slack <= (block_size - 1) * ts["num_running"]).all()
        assert paged.summary["preemptions"] == 0
    pow2 = run(workload, allocator="contiguous-pow2", **big).summary
    oracle_summary = run(workload, allocator="contiguous-oracle", **big).summary
    assert pow2["internal_fragmentation_frac"] > 0 and oracle_summary["internal_fragmentation_frac"] == 0


@pytest.mark.parametrize("scheduling", ["prefill-first", "chunked"])
def test_contiguous_max_holds_max_model_len_per_batched_sequence_on_time_average(scheduling):
    """Every sequence in the batch holds a max_model_len region: the time-weighted held slots equal the time-weighted
    batch size x max_model_len. Under chunked prefill a sequence whose prompt is partly computed is in the batch
    (it holds its region): counted out, the mean batch came out 0.1-0.3 % low."""
    workload = small_workload(num_requests=150, shared_prefix_tokens=64)
    summary = run(workload, allocator="contiguous-max", capacity_tokens=60_000, max_model_len=2048,
                  scheduling=scheduling, max_num_batched_tokens=300).summary
    held = summary["token_states_frac"] + summary["reserved_frac"] + summary["internal_fragmentation_frac"]
    assert held * summary["capacity_tokens"] == pytest.approx(summary["mean_batch_size"] * 2048, rel=1e-12)


def test_a_one_token_request_holds_its_prompt_during_its_prefill():
    """A request that wants one token finishes in the step that prefills it, and its prompt's KV is held during that
    step: one step, every slot the prompts fill, for every allocator (oracle and paged B=1 waste none)."""
    workload = synthetic_workload(SyntheticSpec(preset="fixed", num_requests=6, input_len=30, output_len=1,
                                                max_model_len=64))
    for allocator, extra in (("contiguous-oracle", {}), ("paged", dict(block_size=1))):
        result = run(workload, allocator=allocator, capacity_tokens=1000, max_model_len=64, **extra)
        assert result.summary["iterations"] == 1 and result.summary["num_requests_completed"] == 6
        assert result.summary["token_states_frac"] == pytest.approx(6 * 30 / result.summary["capacity_tokens"])
        assert result.summary["peak_allocated_frac"] == pytest.approx(6 * 30 / result.summary["capacity_tokens"])
        assert result.summary["peak_batch_size"] == 6


class RecordingManager(KVBlockManager):
    """A block manager that logs the policy's calls into it (not the calls it makes into itself)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops, self.depth = [], 0


def _recorded(name):
    def call(self, *args):
        if self.depth == 0:
            self.ops.append((name, *args))
        self.depth += 1
        try:
            return getattr(KVBlockManager, name)(self, *args)
        finally:
            self.depth -= 1
    return call


for _name in ("create_sequence", "fork_sequence", "append_tokens", "release_sequence",
              "try_reserve_counted_blocks", "register_blocks", "extend_stream"):
    setattr(RecordingManager, _name, _recorded(_name))


@pytest.mark.parametrize("sharing", [dict(n=2), dict(beam_width=3)], ids=["samples", "beams"])
def test_paged_trajectory_equals_driving_the_block_manager_directly(sharing, monkeypatch):
    monkeypatch.setattr("lab.sched.kv_policy.KVBlockManager", RecordingManager)
    workload = small_workload(num_requests=80, shared_prefix_tokens=24, **sharing)
    sim = Simulator(workload, SimConfig(allocator="paged", block_size=8, capacity_tokens=3000))
    result = sim.run()
    assert result.summary["preemptions"] > 0  # the small pool forces preemption paths too
    mine = sim.policy.manager
    bulk = KVBlockManager(mine.num_physical_blocks, 8, enable_prefix_caching=True)
    per_token = KVBlockManager(mine.num_physical_blocks, 8, enable_prefix_caching=True)
    for name, *args in mine.ops:
        getattr(bulk, name)(*args)
        if name == "append_tokens":  # (seq, count, token ids, from_reserved): one token at a time
            for _ in range(args[1]):
                per_token.append_tokens(args[0], 1, None, args[3])
        else:
            getattr(per_token, name)(*args)
        seq_id = args[1] if name == "fork_sequence" else args[0]
        if name not in ("release_sequence", "try_reserve_counted_blocks"):
            assert bulk.get_block_table(seq_id) == per_token.get_block_table(seq_id)
        assert bulk.ref_counts == per_token.ref_counts
    assert bulk.ref_counts == mine.ref_counts and bulk.num_free_blocks == mine.num_physical_blocks
    # beams grow by events each step (they re-fork), samples by periodic reservations
    assert any(name == "try_reserve_counted_blocks" for name, *_ in mine.ops) != ("beam_width" in sharing)
    assert not mine.reserved_blocks
    mine.check_invariants()


def test_prefix_sharing_and_parallel_sampling_save_blocks():
    shared = small_workload(num_requests=60, rate=math.inf, shared_prefix_tokens=256)
    with_cache = run(shared, allocator="paged", capacity_tokens=60_000)
    without = run(shared, allocator="paged", capacity_tokens=60_000, enable_prefix_caching=False)
    assert with_cache.summary["prefix_cache_hit_rate"] > 0.3
    assert with_cache.timeseries["blocks_in_use"].max() < without.timeseries["blocks_in_use"].max()
    sampled = small_workload(num_requests=60, rate=math.inf, n=4)
    paged = run(sampled, allocator="paged", capacity_tokens=10_000_000)
    contiguous = run(sampled, allocator="contiguous-oracle", capacity_tokens=10_000_000)
    assert paged.summary["peak_allocated_frac"] < contiguous.summary["peak_allocated_frac"]


def test_deterministic_under_a_seed():
    a = run(small_workload(seed=11), allocator="paged", capacity_tokens=8000)
    b = run(small_workload(seed=11), allocator="paged", capacity_tokens=8000)
    c = run(small_workload(seed=12), allocator="paged", capacity_tokens=8000)
    strip = lambda s: {k: v for k, v in s.items() if k != "wall_time_s"}  # noqa: E731
    assert strip(a.summary) == strip(b.summary)
    pd.testing.assert_frame_equal(a.timeseries, b.timeseries)
    assert strip(a.summary) != strip(c.summary)


def test_timeseries_is_bounded_and_snapshots_can_stop_a_run():
    workload = small_workload(num_requests=300)
    result = run(workload, allocator="paged", capacity_tokens=8000, max_points=50)
    assert len(result.timeseries) < 100 and result.timeseries["step"].is_monotonic_increasing
    seen = []

    def on_snapshot(snapshot):
        seen.append(snapshot)
        return len(seen) < 3

    stopped = simulate(workload, SimConfig(allocator="paged", capacity_tokens=8000), on_snapshot=on_snapshot,
                       snapshot_every=10)
    assert stopped.summary["stopped_early"] and len(seen) == 3
    pool = seen[-1].pool
    assert len(pool.ref_counts) == len(pool.owners) == 8000 // 16
    assert all(len(owners) == count for owners, count in zip(pool.owners, pool.ref_counts))
    assert all(pool.ref_counts[b] >= 1 for table in pool.block_tables.values() for b in table)
    assert pool.num_free_blocks == pool.ref_counts.count(0)
    assert set(seen[-1].metrics) >= set(CATEGORIES)


def test_requests_that_can_never_fit_are_rejected_not_hung():
    workload = synthetic_workload(SyntheticSpec(preset="fixed", num_requests=5, input_len=900, output_len=200))
    result = run(workload, allocator="paged", capacity_tokens=1000, max_model_len=4096)
    assert result.summary["num_requests_rejected"] == 5 and result.summary["num_requests_completed"] == 0
    result = run(workload, allocator="contiguous-max", capacity_tokens=100_000, max_model_len=1000)
    assert result.summary["num_requests_rejected"] == 5


def test_sharegpt_and_alpaca_length_statistics():
    share = synthetic_workload(SyntheticSpec(preset="sharegpt", num_requests=50_000))
    assert 145 < share.prompt_tokens.mean() < 177 and 305 < share.output_tokens.mean() < 372
    assert share.prompt_tokens.max() <= 1024 and (share.prompt_tokens + share.output_tokens).max() <= 2048
    alpaca = synthetic_workload(SyntheticSpec(preset="alpaca", num_requests=50_000))
    assert 16 < alpaca.prompt_tokens.mean() < 22 and 50 < alpaca.output_tokens.mean() < 66
    rnd = synthetic_workload(SyntheticSpec(preset="random", num_requests=1000, input_len=100, range_ratio=0.5))
    assert rnd.prompt_tokens.min() >= 50 and rnd.prompt_tokens.max() <= 150
    timed = synthetic_workload(SyntheticSpec(num_requests=20_000, rate=10.0, burstiness=0.5))
    assert 9 < 1 / np.diff(timed.arrival_s).mean() < 11


def test_figure2_preset_orders_allocators_like_the_paper():
    spec, configs = figure2_experiment(num_requests=300)
    workload = synthetic_workload(spec)
    share = {c.allocator: Simulator(workload, c).run().summary["token_states_frac"] for c in configs}
    assert share["paged"] > 0.85 > share["contiguous-oracle"] >= share["contiguous-max"]


def test_cli_writes_summary_and_timeseries(tmp_path, capsys):
    out, ts = tmp_path / "summary.csv", tmp_path / "ts.csv"
    code = main(["--workload", "alpaca", "--num-requests", "200", "--allocators", "paged,contiguous-max",
                 "--block-size", "8,16", "--capacity-tokens", "20000", "--rate", "50", "--out", str(out),
                 "--timeseries", str(ts), "--checks", str(tmp_path / "checks.csv"), "--no-progress"])
    assert code == 0
    summary = pd.read_csv(out)
    assert set(SUMMARY_COLUMNS) <= set(summary.columns) and len(summary) == 3
    assert set(pd.read_csv(ts)["allocator"]) == {"paged", "contiguous-max"}
    checks = pd.read_csv(tmp_path / "checks.csv")
    assert set(checks["label"]) == {"paged-B8", "paged-B16", "contiguous-max"} and checks["holds"].all()
    printed = capsys.readouterr()
    assert "token_states_frac" in printed.out and f"closed-form checks: {len(checks)} of {len(checks)} hold" in printed.err
    assert main(["--allocators", "bogus", "--no-progress"]) == 2
    assert main(["--workload", "nope.csv", "--no-progress"]) == 2
    assert main(["--workload", str(tmp_path), "--no-progress"]) == 2
    assert "is a folder, not a trace file" in capsys.readouterr().err
    capsys.readouterr()
    # every request larger than the KV pool: rejected, counted, and the run fails loudly
    assert main(["--workload", "fixed", "--num-requests", "5", "--capacity-tokens", "100", "--allocators", "paged",
                 "--no-progress"]) == 1
    printed = capsys.readouterr()
    assert "5 of 5 requests were rejected (5 larger than the whole KV pool)" in printed.err and "no request completed" in printed.err


def test_rejection_warnings_say_why_in_words():
    row = pd.Series(dict(allocator="paged", num_requests=300, num_requests_rejected=170,
                         rejection_reasons="capacity=3;max_model_len=167"))
    assert rejection_warning(row) == ("paged: 170 of 300 requests were rejected (3 larger than the whole KV pool, 167 "
                                      "longer than max_model_len (prompt + output)): they can never run in this "
                                      "configuration; to run them, give the KV pool more memory or raise "
                                      "max_model_len")
    row["rejection_reasons"] = "n=4"
    assert rejection_warning(row).endswith("(4 more samples than max_num_seqs): they can never run in this "
                                           "configuration; to run them, raise max_num_seqs")


@settings(max_examples=30, deadline=None)
@given(allocator=st.sampled_from(ALLOCATORS), block_size=st.integers(1, 64), capacity=st.integers(300, 6000),
       n=st.integers(1, 3), shared=st.sampled_from([0, 32]), chunked=st.booleans(), buddy=st.booleans(),
       seed=st.integers(0, 1000), beams=st.booleans(), swap=st.booleans(), replicas=st.integers(1, 3),
       max_num_seqs=st.sampled_from([4, 256]))
# forks sharing a partly filled last block count its tail as reserved, not once per fork as never filled
@example(allocator="paged", block_size=57, capacity=300, n=3, shared=32, chunked=False, buddy=False, seed=549,
         beams=False, swap=False, replicas=1, max_num_seqs=256)
def test_fuzzed_runs_keep_the_accounting_identities(allocator, block_size, capacity, n, shared, chunked, buddy, seed,
                                                    beams, swap, replicas, max_num_seqs):
    sharing = dict(beam_width=n) if beams and n > 1 else dict(n=n)
    workload = small_workload(num_requests=40, shared_prefix_tokens=shared, seed=seed, max_model_len=512, **sharing)
    result = run(workload, allocator=allocator, block_size=block_size, capacity_tokens=capacity, max_model_len=512,
                 scheduling="chunked" if chunked else "prefill-first", max_num_batched_tokens=256,
                 address_space="buddy" if buddy else "first-fit", max_points=100_000, replicas=replicas,
                 preemption_mode="swap" if swap and allocator == "paged" else "recompute", max_num_seqs=max_num_seqs)
    ts = result.timeseries
    assert (ts[list(CATEGORIES)].sum(axis=1) == result.summary["capacity_tokens"] / replicas).all()
    assert (ts[list(CATEGORIES)] >= 0).all().all()
    completed = result.requests["finish_s"].notna().to_numpy()
    assert completed.sum() + result.requests["rejected"].sum() == len(workload)
    if not beams:
        assert result.summary["generated_tokens"] == expected_tokens(workload, completed)
    checks = closed_form_checks(workload, {"run": result})  # and every closed form the app shows beside a run
    assert checks["holds"].all(), checks[~checks["holds"]].to_string()


def test_paper_pow2_rounds_the_output_only_and_buddy_places_it():
    """Orca (Pow2) in the vLLM paper over-reserves outputs by at most 2x: prompt 100 + true output 25 reserves
    100 + 32 slots; rounding the total (``contiguous-pow2-total``) reserves 128; a buddy space then rounds the
    region itself up to a power of two."""
    from simulator.core.allocators import ContiguousPolicy

    final_len = 100 + 25 - 1  # KV holds prompt + output - 1 tokens
    paper = ContiguousPolicy("contiguous-pow2", 4096, 2048)
    total = ContiguousPolicy("contiguous-pow2-total", 4096, 2048)
    assert paper.initial_size(100, final_len) == 132 and total.initial_size(100, final_len) == 128
    assert paper.initial_size(100, 100 + 32 - 1) == 132 and paper.initial_size(7, 7) == 8
    buddy = ContiguousPolicy("contiguous-pow2", 4096, 2048, address_space="buddy")
    assert buddy.space.rounded(buddy.initial_size(100, final_len)) == 256
    oracle = run(small_workload(num_requests=60), allocator="contiguous-oracle", capacity_tokens=10**6).summary
    pow2 = run(small_workload(num_requests=60), allocator="contiguous-pow2", capacity_tokens=10**6).summary
    assert pow2["internal_fragmentation_frac"] > 0 == oracle["internal_fragmentation_frac"]


def _same_summary(first: dict, second: dict, ignore=("wall_time_s",)) -> list[str]:
    return [k for k in first if k not in ignore and not (first[k] == second[k] or (
        isinstance(first[k], float) and math.isnan(first[k]) and math.isnan(second[k])))]


@settings(max_examples=25, deadline=None)
@given(allocator=st.sampled_from(ALLOCATORS), block_size=st.sampled_from([1, 3, 16]),
       capacity=st.integers(300, 6000), chunked=st.booleans(), max_num_seqs=st.sampled_from([4, 256]),
       seed=st.integers(0, 10_000), n=st.sampled_from([1, 2]), swap=st.booleans())
@example(allocator="paged", block_size=16, capacity=3000, chunked=False, max_num_seqs=256, seed=1, n=2, swap=True)
def test_watching_a_run_does_not_change_it(allocator, block_size, capacity, chunked, max_num_seqs, seed, n, swap):
    """Metamorphic: the timeseries' size, the step log, snapshots and a router in front of one replica leave every
    number of the summary as it was; and prefix caching changes nothing when nothing is shared and nothing is
    preempted (with recompute preemption a re-prefill may hit the blocks it just freed). The example: parallel
    samples swapped out and back in with their last block shared, then one finishing; a snapshot's sync told the
    other it had that block to itself, and without snapshots its last block's never-filled tail counted as reserved."""
    workload = small_workload(num_requests=30, seed=seed, max_model_len=512, n=n)
    config = SimConfig(allocator=allocator, block_size=block_size, capacity_tokens=capacity, max_model_len=512,
                       scheduling="chunked" if chunked else "prefill-first", max_num_batched_tokens=256,
                       max_num_seqs=max_num_seqs, preemption_mode="swap" if swap and allocator == "paged" else
                       "recompute", num_cpu_blocks=64 if swap and allocator == "paged" else 0)
    base = Simulator(workload, config).run().summary
    for changed in (dict(max_points=7), dict(record_steps=True), dict(router="least-loaded")):
        assert not _same_summary(base, Simulator(workload, dataclasses.replace(config, **changed)).run().summary)
    watched = Simulator(workload, config, on_snapshot=lambda snapshot: None, snapshot_every=3).run().summary
    assert not _same_summary(base, watched)
    uncached = Simulator(workload, dataclasses.replace(config, enable_prefix_caching=False)).run().summary
    if base["preemptions"] == 0 and uncached["preemptions"] == 0:
        assert not _same_summary(base, uncached, ignore=("wall_time_s", "prefix_cache_hit_rate",
                                                         "prefix_cache_hit_blocks"))


def test_compare_keeps_every_config_when_two_share_a_label():
    workload = small_workload(num_requests=20)
    config = SimConfig(allocator="paged", capacity_tokens=20_000)
    table, results = compare(workload, [config, dataclasses.replace(config, max_num_seqs=2)])
    assert list(results) == list(table["label"]) == ["paged-B16", "paged-B16 #2"]


def test_compare_reuses_runs_of_the_same_workload_and_config(monkeypatch):
    """With ``reuse``, a configuration already run on this workload is not run again (a page adding a block size
    runs one configuration); the table is the same as a fresh comparison's; another workload runs everything; a
    stopped run is not kept; ``RunCache`` keeps the most recently used."""
    import simulator.core.cluster
    import simulator.core.runs

    ran = []
    original = simulator.core.cluster.run_simulation
    monkeypatch.setattr(simulator.core.runs, "run_simulation", lambda w, c, **kw: ran.append(c.label) or original(w, c, **kw))
    workload = small_workload(num_requests=40)
    first = [SimConfig(allocator="contiguous-max", capacity_tokens=9_000), SimConfig(capacity_tokens=9_000)]
    more = first + [SimConfig(block_size=4, capacity_tokens=9_000)]
    reuse = simulator.RunCache(3)
    compare(workload, first, reuse=reuse)
    table, results = compare(workload, more, reuse=reuse)
    assert ran == ["contiguous-max", "paged-B16", "paged-B4"] and len(reuse) == 3
    assert table.drop(columns="wall_time_s").equals(compare(workload, more)[0].drop(columns="wall_time_s"))
    compare(dataclasses.replace(workload, arrival_s=workload.arrival_s * 2), first[:1], reuse=reuse)
    assert ran[-1] == "contiguous-max" and len(reuse) == 3 and (workload.fingerprint(), repr(first[0])) not in reuse
    ran.clear()
    compare(workload, [SimConfig(block_size=8, capacity_tokens=9_000)], reuse=reuse, progress=lambda f: False)
    assert ran == ["paged-B8"] and len(reuse) == 3 and not any("block_size=8," in key[1] for key in reuse)
    for key, run in reuse.items():  # with workers, the slowest configuration last time goes first
        run.summary["wall_time_s"] = {"contiguous-max": 9.0, "paged-B4": 5.0}.get(run.config.label, 1.0)
    handed = []
    monkeypatch.setattr(simulator.core.runs, "_run_all",
                        lambda w, cs, workers, progress, on_result: handed.extend(c.label for c in cs)
                        or [original(w, c) for c in cs])
    compare(dataclasses.replace(workload, arrival_s=workload.arrival_s * 3), more, workers=2, reuse=reuse)
    assert handed == ["contiguous-max", "paged-B4", "paged-B16"]
    monkeypatch.undo()
    small = simulator.RunCache(1)  # the new run evicts the kept one this comparison also shows
    compare(workload, first[:1], reuse=small)
    assert list(compare(workload, first, reuse=small)[1]) == ["contiguous-max", "paged-B16"] and len(small) == 1


def test_a_block_size_sweep_trades_fragmentation_for_kernel_speed():
    workloads = simulator.block_size_sweep_workloads(
        simulator.make_workload("sharegpt", num_requests=300, rate=5.0, max_model_len=2048), 2048, 300)
    table = simulator.block_size_sweep(workloads, simulator.SimConfig(model="opt-13b", gpu="a100-40gb"))
    assert set(table["workload"]) == {"sharegpt", "alpaca"} and len(table) == 2 * len(simulator.BLOCK_SIZES)
    sharegpt = table[table["workload"] == "sharegpt"].set_index("block_size")
    assert sharegpt["internal_fragmentation_pct"].is_monotonic_increasing
    best = sharegpt["throughput_tok_s"].idxmax()
    assert 8 <= best <= 64 and sharegpt.loc[1, "throughput_tok_s"] < sharegpt.loc[best, "throughput_tok_s"]
    assert sharegpt.loc[256, "throughput_tok_s"] < sharegpt.loc[best, "throughput_tok_s"]


def test_a_comparison_in_two_processes_is_the_serial_one():
    """``compare(..., workers=2)`` runs the configs side by side in worker processes: the same summaries and
    timeseries, in the same order."""
    import simulator

    workload = simulator.make_workload("sharegpt", num_requests=120, rate=20.0, max_model_len=2048)
    configs = simulator.make_configs(["contiguous-oracle", "paged", "contiguous-max"], [16, 3], model="opt-13b",
                                     gpu="a100-40gb", max_model_len=2048)
    serial, serial_runs = simulator.compare(workload, configs)
    parallel, parallel_runs = simulator.compare(workload, configs, workers=2)
    same = [c for c in serial.columns if c != "wall_time_s"]
    pd.testing.assert_frame_equal(serial[same], parallel[same])
    assert list(serial_runs) == list(parallel_runs)
    for label, run in serial_runs.items():
        pd.testing.assert_frame_equal(run.timeseries, parallel_runs[label].timeseries)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(allocator=st.sampled_from(ALLOCATORS), block_size=st.sampled_from([1, 7, 16]),
       capacity=st.integers(300, 4000), scheduling=st.sampled_from(["prefill-first", "chunked", "vllm"]),
       caching=st.booleans(), seed=st.integers(0, 10_000), n=st.sampled_from([1, 2]))
def test_skipping_a_blocked_head_s_admission_changes_nothing(allocator, block_size, capacity, scheduling, caching,
                                                             seed, n, monkeypatch):
    """The scheduler skips offering a queue head that failed to fit while no memory has come free since: every
    number of the summary is what offering it every step gives."""
    workload = small_workload(num_requests=30, seed=seed, max_model_len=512, n=n, shared_prefix_tokens=32)
    config = SimConfig(allocator=allocator, block_size=block_size, capacity_tokens=capacity, max_model_len=512,
                       scheduling=scheduling, max_num_batched_tokens=256, enable_prefix_caching=caching)
    skipping = Simulator(workload, config).run().summary
    with monkeypatch.context() as patch:  # the same patch on every example
        patch.setattr("lab.sched.scheduler.Scheduler._admission_fails", lambda self, group, chunk: False)
        offering = Simulator(workload, config).run().summary
    assert not _same_summary(skipping, offering)


def test_a_waiting_caller_hears_of_progress_when_runs_finish_not_every_poll():
    """``run_in_processes`` tells ``progress`` of each finished run and otherwise at most every
    ``PROGRESS_EVERY_S`` (each call on a page is a message to the browser); a False answer still stops the rest."""
    import time

    import simulator
    from simulator.core import parallel

    workload = simulator.make_workload("sharegpt", num_requests=400, rate=20.0, max_model_len=2048)
    configs = simulator.make_configs(["contiguous-max", "paged", "contiguous-oracle"], [16], model="opt-13b",
                                     gpu="a100-40gb", max_model_len=2048)
    calls = []
    simulator.compare(workload, configs, workers=2, progress=lambda f: calls.append((time.monotonic(), f)))
    assert calls[-1][1] == 1.0
    for (before, fraction), (after, next_fraction) in zip(calls, calls[1:]):
        assert next_fraction > fraction or after - before >= parallel.PROGRESS_EVERY_S * 0.9
    stopped = parallel.run_in_processes(workload, configs * 3, 2, progress=lambda f: False)
    assert stopped.count(None) >= len(configs * 3) - 2  # the two in flight may finish; nothing else starts

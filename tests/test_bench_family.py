"""The workloads `lab bench vllm --workload random` draws, and the contention bench's background load."""
import os
import sys

import pandas as pd
import pytest

from lab.bench.contention import BackgroundLoad, ContentionConfig, summarize
from lab.bench.vllm_family import BLOCK_SIZES, POOL_TOKENS, random_family
from lab.cli.main import main
from lab.worker.threads import allowed_cores


def test_a_family_is_the_same_for_the_same_seed_and_spans_what_it_promises():
    family = random_family(3, 24, vocab_size=1000)
    again = random_family(3, 24, vocab_size=1000)
    assert [w.prompts for w in family] == [w.prompts for w in again]
    assert random_family(4, 1, 1000)[0].prompts != family[0].prompts
    for w in family:
        assert 8 <= w.num_requests <= 64 and len(w.prompts) == len(w.max_tokens) == w.num_requests
        assert all(16 <= n <= 256 for n in w.max_tokens)
        assert all(1 <= len(p) <= 1000 for p in w.prompts)
        assert w.block_size in BLOCK_SIZES and w.num_blocks * w.block_size == POOL_TOKENS
        if w.enable_prefix_caching:  # a shared system prompt, so that caching has something to hit
            assert len({tuple(p[:w.shared_prefix_tokens]) for p in w.prompts}) == 1
        if w.staggered:
            assert w.arrival_steps == sorted(w.arrival_steps)
    # the family varies what the fixed bench holds still
    assert {w.staggered for w in family} == {True, False}
    assert {w.enable_prefix_caching for w in family} == {True, False}
    assert len({w.block_size for w in family}) == len(BLOCK_SIZES)


@pytest.mark.parametrize("argv, message", [
    (["--seed", "3"], "go with --workload random"),
    (["--workload", "random", "--num-blocks", "64"], "a random family draws its own"),
    (["--profile", "--workload", "random"], "do not apply"),
    (["--profile", "--background-load"], "do not apply"),
    (["--workload", "random", "--background-load"], "the contention figures use the fixed workload"),
    (["--workload", "random", "--kv-cache-dtype", "fp8_e4m3"], "run the fixed workload for FP8"),
    (["--workload", "random", "--first-token-only"], "run the fixed workload for FP8"),
    (["--profile", "--first-token-only"], "do not apply"),
    (["--first-token-only"], "it needs an FP8 --kv-cache-dtype"),
    (["--first-token-only", "--kv-cache-dtype", "fp8", "--background-load"], "no --background-load"),
])
def test_family_options_that_cannot_apply_are_refused(argv, message, capsys):
    assert main(["bench", "vllm", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(len(allowed_cores()) < 2 or sys.platform != "linux", reason="needs Linux and two cores")
def test_the_background_load_keeps_one_core_busy_and_stops():
    with BackgroundLoad() as load:
        assert os.sched_getaffinity(load.process.pid) == {load.core}
        assert load.process.poll() is None
    assert load.process.poll() is not None


def test_the_summary_gives_each_system_its_slowdown_and_ratio_to_hf():
    runs = pd.DataFrame([{"system": s, "load": load, "repeat": 0, "wall_s": 1.0, "output_tok_s": tok}
                         for s, load, tok in (("engine", "quiet", 400.0), ("engine", "one core busy", 200.0),
                                              ("hf-continuous", "quiet", 100.0),
                                              ("hf-continuous", "one core busy", 80.0))])
    table = summarize(runs, ContentionConfig()).set_index("system")
    assert table.loc["engine", "slowdown"] == 2.0 and table.loc["hf-continuous", "slowdown"] == 1.25
    assert table.loc["engine", "vs_hf_quiet"] == 4.0 and table.loc["engine", "vs_hf_loaded"] == 2.5
    assert table.loc["engine", "ratio_change"] == pytest.approx(-0.375)


@pytest.mark.parametrize("argv, repeats", [(["--num-requests", "32"], 5), (["--num-requests", "32", "--repeats", "2"], 2),
                                           (["--workload", "random"], 3),
                                           (["--workload", "random", "--repeats", "1"], 1)])
def test_the_vllm_bench_runs_each_engine_as_often_as_its_workload_needs(argv, repeats, monkeypatch, tmp_path):
    """Five alternating runs of each engine on the fixed workload by default, three a workload in a random family;
    ``--repeats`` sets either (the benches themselves are stubbed: this checks what they are asked for)."""
    asked = []
    monkeypatch.setattr("lab.bench.vllm.run_vllm_bench",
                        lambda config, progress=None: asked.append(config.repeats) or pd.DataFrame([{"system": "x"}]))
    monkeypatch.setattr("lab.bench.vllm_family.run_family_bench",
                        lambda model, dtypes, seed, count, repeats, progress=None:
                        asked.append(repeats) or pd.DataFrame([{"system": "x"}]))
    assert main(["bench", "vllm", "--model", "tiny", "--out", str(tmp_path / "out.csv"), *argv]) == 0
    assert asked == [repeats]


"""The benchmarks run end to end on tiny shapes and the CLI writes their CSVs."""
import math
from pathlib import Path

import pandas as pd
import pytest

from lab.bench.block_manager import run_block_manager_bench
from lab.bench.kernels import KernelBenchConfig, run_kernel_bench
from lab.cli.main import main
from lab.hardware import describe_hardware
from lab.profiling.profile import Profile, feature_names


def test_kernel_bench_rows_and_accuracy():
    config = KernelBenchConfig(batch_sizes=(2,), context_lens=(40,), num_q_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=3, backends=("torch", "reference"), repeats=2)
    table = run_kernel_bench(config)
    assert list(table["kernel"]) == ["sdpa-contiguous", "torch", "reference"]
    assert (table["max_rel_err"] < 1e-5).all() and (table["median_ms"] > 0).all()


def test_block_manager_bench_reports_rates():
    table = run_block_manager_bench(block_size=16)
    assert len(table) == 5 and (table["median_rate"] > 0).all()


def test_cli_writes_csv(tmp_path, capsys):
    out = tmp_path / "k.csv"
    assert main(["bench", "kernels", "--batch", "1", "--context", "20", "--block-size", "7", "--repeats", "1",
                 "--out", str(out)]) == 0
    written = pd.read_csv(out)
    assert set(written["kernel"]) == {"sdpa-contiguous", "torch"}
    # the options that produced it ride along (those named like a column of the table are prefixed)
    assert written[["setting_batch", "setting_context", "setting_block_size", "repeats"]].iloc[0].tolist() == [1, 20, 7, 1]
    assert "lab_version" in written and "out" not in written
    assert main(["bench", "kernels", "--backends", "nope", "--batch", "1", "--context", "8", "--out", ""]) == 2
    assert "backend must be one of" in capsys.readouterr().err


def test_an_out_folder_gets_a_file_named_from_the_settings(tmp_path):
    from simulator.cli.main import main as simulator_main

    folder = tmp_path / "exports"
    assert simulator_main(["--workload", "sharegpt", "--num-requests", "20", "--rate", "4", "--allocators", "paged",
                           "--no-progress", "--out", f"{folder}/", "--checks", f"{folder}/"]) == 0
    summary, checks = (sorted(folder.glob(f"{kind}_*.csv")) for kind in ("summary", "checks"))
    assert len(summary) == 1 and len(checks) == 1
    assert summary[0].name.startswith("summary_sharegpt_20req_4rps_qwen3-8b_")
    table = pd.read_csv(summary[0])
    assert table[["workload", "num_requests", "arrival_rate_req_s", "max_model_len"]].iloc[0].tolist()[:3] == \
        ["sharegpt", 20, 4.0] and table["allocator"].tolist() == ["paged"]


def test_hardware_table_lists_backends():
    table = describe_hardware()
    assert "reference" in table.set_index("item").loc["kernel backends", "value"]


def test_e2e_bench_compares_the_systems_on_the_same_tokens():
    from lab.bench.e2e import E2EConfig, run_e2e_bench

    table = run_e2e_bench(E2EConfig(num_requests=4, prompt_range=(8, 40), output_range=(3, 9), repeats=1,
                                    chunk_budget=16))
    assert list(table["system"]) == ["paged-engine", "paged-engine-chunked", "hf-static", "hf-continuous"]
    assert table["same_tokens_as_engine"].all() and (table["output_tok_s"] > 0).all()
    engine_rows = table[table["system"].str.startswith("paged")]
    assert ((engine_rows["scheduler_share"] > 0) & (engine_rows["scheduler_share"] < 1)).all()
    assert engine_rows["steps"].iloc[1] > engine_rows["steps"].iloc[0]  # a 16-token budget chunks the prompts
    assert table.loc[table["system"] == "hf-continuous", "speedup_vs_hf_continuous"].iloc[0] == 1.0


def test_cli_generate_prints_tokens_and_metrics(tmp_path, capsys):
    out = tmp_path / "run.csv"
    assert main(["generate", "--num-prompts", "2", "--prompt-len", "9", "--max-tokens", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[0]" in printed and "[1]" in printed
    assert pd.read_csv(out)["output_tokens"].iloc[0] == 6
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2


BAD_INVOCATIONS = [
    # options the chosen workload or clock would ignore are refused, each named
    ("simulator", ["--workload", "sharegpt", "--time-scale", "2"], "--time-scale would be ignored"),
    ("simulator", ["--preset", "figure2", "--block-size", "32", "--rate", "4"], "--block-size, --rate would be"),
    ("simulator", ["--router", "least-loaded"], "--router would be ignored"),
    ("simulator", ["--workload", "sharegtp", "--rate", "3"], "neither a preset"),  # a typo is not called a trace
    ("simulator", ["twin", "--profile", "p.json", "--workload", "sharegpt", "--input-len", "50"], "--input-len would be"),
    ("lab", ["generate", "--prompt", "1,2,3", "--prompt-len", "8"], "--prompt-len would be ignored"),
    ("lab", ["bench", "kernels", "--block-size", "0"], "--block-size"),
    ("lab", ["bench", "kernels", "--batch", "1,x"], "--batch"),
    ("lab", ["bench", "kernels", "--repeats", "0"], "--repeats"),
    ("lab", ["bench", "kernels", "--device", "tpu"], "--device"),
    ("lab", ["bench", "kernels", "--backends", "triton", "--batch", "1", "--context", "8", "--repeats", "1"],
     "backend must be one of"),
    ("lab", ["bench", "block-manager", "--block-size", "-4"], "--block-size"),
    ("lab", ["bench", "e2e", "--repeats", "0"], "--repeats"),
    ("lab", ["bench", "e2e", "--systems", "vllm", "--num-requests", "2"], "systems must be"),
    ("lab", ["generate", "--num-prompts", "0"], "--num-prompts"),
    ("lab", ["generate", "--prompt", "1,x"], "comma-separated token ids"),
    ("lab", ["generate", "--prompt", ",,,"], "comma-separated token ids"),
    ("lab", ["generate", "--n", "300", "--num-prompts", "1"], "exceed max_num_seqs"),
    ("lab", ["generate", "--temperature", "nan", "--num-prompts", "1"], "temperature"),
    ("lab", ["generate", "--num-cpu-blocks", "-1"], "--num-cpu-blocks"),
    ("lab", ["generate", "--scheduling", "greedy"], "--scheduling"),
    ("simulator", ["--num-requests", "0"], "--num-requests"),
    ("simulator", ["--block-size", "0"], "--block-size"),
    ("simulator", ["--max-num-seqs", "x"], "--max-num-seqs"),
    ("simulator", ["--rate", "-1"], "rate"),
    ("simulator", ["plan", "--slo", "ttft_p91=1"], "SLO 'ttft_p91'"),
    ("simulator", ["plan", "--slo", "ttft_p90=1", "--replicas", "0..4"], "--replicas"),
    ("simulator", ["plan", "--slo", "ttft_p90=1", "--gpu-price", "l4=free"], "--gpu-price"),
    ("simulator", ["plan", "--slo", "ttft_p90=1", "--models", "gpt5", "--serial"], "unknown model"),
    ("simulator", ["sweep", "--grid", "/no/such.yaml", "--out", "r.csv"], "cannot read"),
    ("simulator", ["sweep", "--grid", "g.yaml", "--out", "r.txt"], ".parquet or .csv"),
    ("simulator", ["--rate", "nan"], "rate"),
    ("simulator", ["--time-scale", "-1"], "--time-scale"),
    ("simulator", ["--burstiness", "0"], "burstiness"),
    ("simulator", ["--max-model-len", "99999999999"], "max_model_len"),
    ("simulator", ["--kernel-csv", "/no/such.csv", "--num-requests", "3"], "No such file"),
    ("simulator", ["--preemption-mode", "evict"], "--preemption-mode"),
    ("simulator", ["--out", "README.md/"], "cannot write"),
    ("simulator", ["--timeseries", "/proc/version/ts.csv"], "cannot write"),
    ("lab", ["generate", "--out", "/proc/version/m.csv"], "cannot write"),
    ("lab", ["bench", "block-manager", "--out", "/proc/version/"], "cannot write"),
    ("simulator", ["paper", "--out", "README.md"], "is a file"),
    ("simulator", ["paper", "--out", "/proc/version/paper"], "cannot write"),
]


BAD_FILES = {  # {name} in an argv below is replaced by the path of a file with this content
    "bad_trace": b"arrival_time_s,prompt_tokens,output_tokens\n0,12,x\n",
    "huge_trace": b"arrival_time_s,prompt_tokens,output_tokens\n0,99999999999,5\n",
    "binary_trace": b"\x00\xff\xfe junk \x01",
    "bad_jsonl": b'{"timestamp": 0, "input_length": 10}\n',
    "bad_kernel_csv": b"kernel,backend\nx,torch\n",
    "bad_profile": b'{"model": "tiny"}',
    "trace": b"arrival_time_s,prompt_tokens,output_tokens\n0,12,5\n",  # well formed (for options it ignores)
    "bad_config/config.json": b"[1, 2, 3]",
    "bad_weights/config.json": b"{}",
    "bad_weights/model.safetensors": b"not a safetensors file",
}
BAD_FILE_INVOCATIONS = [
    ("simulator", ["--workload", "{bad_trace}.csv"], "row 2"),
    ("simulator", ["--workload", "{huge_trace}.csv"], "int32"),
    ("simulator", ["--workload", "{binary_trace}.csv"], "binary_trace"),
    ("simulator", ["--workload", "{bad_jsonl}.jsonl"], "row 1"),
    ("simulator", ["--kernel-csv", "{bad_kernel_csv}", "--num-requests", "3"], "bad_kernel_csv"),
    ("simulator", ["--profile", "{bad_profile}", "--num-blocks", "64"], "bad_profile"),
    ("simulator", ["--workload", "{trace}.csv", "--burstiness", "2", "--n", "2"], "--burstiness, --n would be"),
    ("simulator", ["--workload", "{trace}.csv", "--rate", "3", "--time-scale", "2"], "--time-scale would be"),
    ("simulator", ["--profile", "{profile}", "--num-blocks", "64", "--gpu", "h100-80gb"], "--gpu would be ignored"),
    ("simulator", ["--profile", "{profile}", "--num-blocks", "64", "--allocators", "paged,contiguous-oracle"],
     "--allocators would be ignored"),
    ("simulator", ["twin", "--profile", "{profile}", "--workload", "sharegpt", "--time-scale", "2"], "a time scale"),
    ("simulator", ["twin", "--model", "tiny", "--profile", "{bad_profile}", "--num-requests", "2"], "bad_profile"),
    ("lab", ["generate", "--model", "{bad_config}", "--num-prompts", "1"], "config.json"),
    ("lab", ["generate", "--model", "{bad_weights}", "--num-prompts", "1"], "bad_weights"),
    ("lab", ["bench", "e2e", "--model", "{bad_config}", "--num-requests", "1"], "config.json"),
]


@pytest.fixture
def bad_files(tmp_path):
    paths = {}
    for name, content in BAD_FILES.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content)
        paths[name.split("/")[0]] = str(path.parent if "/" in name else path)
    for name in ("bad_trace", "huge_trace", "binary_trace", "bad_jsonl", "trace"):
        suffix = ".jsonl" if name == "bad_jsonl" else ".csv"
        Path(paths[name]).rename(paths[name] + suffix)
    paths["profile"] = str(tmp_path / "profile.json")  # a valid one (for options it makes moot)
    Profile("tiny", "cpu", "torch.float32", 16, "torch", dict.fromkeys(feature_names([1]), 1e-4), [1]).save(
        paths["profile"])
    return paths


@pytest.mark.parametrize("program,argv,named", BAD_FILE_INVOCATIONS,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_files_exit_2_with_one_error_line_and_no_traceback(program, argv, named, bad_files, capsys):
    argv = [arg.format(**bad_files) for arg in argv]
    test_bad_flags_exit_2_with_one_error_line_and_no_traceback(program, argv, named, capsys)


def test_a_bad_simulator_configuration_fails_before_the_progress_bar_starts(bad_files, capsys):
    from simulator.cli.main import main as simulator_main

    assert simulator_main(["--profile", bad_files["bad_profile"], "--num-blocks", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "simulating" not in err


@pytest.mark.parametrize("program,argv,named", BAD_INVOCATIONS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_flags_exit_2_with_one_error_line_and_no_traceback(program, argv, named, capsys):
    from simulator.cli.main import main as simulator_main

    entry = main if program == "lab" else simulator_main
    try:
        quiet = program == "simulator" and argv[0] not in ("twin", "twin-bench")  # the twin draws no bar
        code = entry(argv + (["--no-progress"] if quiet else []))
    except SystemExit as exc:  # argparse rejects a flag
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert len([line for line in err.splitlines() if "error:" in line]) == 1 and named in err
    assert "Traceback" not in err


def _options_without_help(parser, path=()):
    """``(command path, option)`` of every option of ``parser`` and its subcommands that has no help text."""
    import argparse

    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _options_without_help(sub, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append((" ".join(path), action.option_strings[-1]))
    return missing


def test_every_option_of_every_command_says_what_it_does():
    from lab.cli.main import build_parser as lab_parser
    from simulator.bench import bench_parser
    from simulator.cli.main import build_parser as simulator_parser
    from simulator.cli.sweep import paper_parser, plan_parser, sweep_parser

    for parser in (lab_parser(), simulator_parser(), sweep_parser(), plan_parser(), paper_parser(), bench_parser()):
        assert _options_without_help(parser) == [], parser.prog


def test_the_kernel_bench_warms_every_call_up_before_timing_it(monkeypatch):
    """The first timed shape used to pay for the process's first SDPA calls (5-8 ms against 0.05 ms alone)."""
    from lab.bench import kernels as bench

    calls, first_timed = [], {}
    real_sdpa = bench.sdpa_decode

    def counting_sdpa(*args):
        calls.append(1)
        return real_sdpa(*args)

    real_median = bench.median_seconds

    def spying_median(fn, repeats=10, warmup=2, cuda=False):
        first_timed.setdefault("sdpa_calls_before", len(calls))
        return real_median(fn, repeats, warmup, cuda)

    monkeypatch.setattr(bench, "sdpa_decode", counting_sdpa)
    monkeypatch.setattr(bench, "median_seconds", spying_median)
    config = KernelBenchConfig(batch_sizes=(1,), context_lens=(32, 64), num_q_heads=4, num_kv_heads=2, head_dim=16,
                               repeats=2)
    bench.run_kernel_bench(config)
    assert first_timed["sdpa_calls_before"] == 0  # the warm-up's own medians come first...
    assert len(calls) > 2 * 2 * 3  # ...and call SDPA beyond the timed shapes' repeats and warm-up calls


def test_a_baseline_that_gets_faster_with_context_is_refused(monkeypatch):
    from lab.bench import kernels as bench

    times = iter([8e-3, 5e-5] + [1e-4] * 100)  # the unwarmed first shape, as the page measured it
    monkeypatch.setattr(bench, "warm_up", lambda config: None)
    retimed = []
    monkeypatch.setattr(bench, "retime_baseline", lambda table, config: retimed.append(len(table)))
    def timed(fn, repeats=10, warmup=2, cuda=False, back_to_back=1):
        fn()
        seconds = next(times)
        return bench.Timing(seconds, seconds, seconds)

    monkeypatch.setattr(bench, "time_calls", timed)
    config = KernelBenchConfig(batch_sizes=(1,), context_lens=(256, 512), num_q_heads=4, num_kv_heads=2, head_dim=16,
                               backends=(), repeats=1)
    with pytest.raises(bench.KernelBenchError, match="context 256"):
        bench.run_kernel_bench(config)
    assert retimed == [2]  # measured again once before it was refused
    times = iter([8e-3, 5e-5] + [1e-4] * 100)
    table = bench.run_kernel_bench(config, refuse_noisy=False)  # the app's call: kept, for a warning to say why
    assert len(table) == 2 and "context 256" in bench.baseline_problem(table)


def test_a_disturbed_baseline_is_measured_again_before_it_is_refused():
    from lab.bench import kernels as bench

    config = KernelBenchConfig(batch_sizes=(1,), context_lens=(64, 256), num_q_heads=4, num_kv_heads=2, head_dim=16,
                               repeats=3)
    table = bench.run_kernel_bench(config)
    sdpa = table["kernel"] == "sdpa-contiguous"
    # the first shape disturbed: 100 x the slowest SDPA time measured (x 100 of its own time did not always exceed
    # the second shape's, itself slowed by the other test worker)
    table.loc[sdpa, "median_ms"] = [100.0 * table.loc[sdpa, "median_ms"].max(), table.loc[sdpa, "median_ms"].iloc[1]]
    with pytest.raises(bench.KernelBenchError):
        bench.check_baseline(table)
    bench.retime_baseline(table, config)
    bench.check_baseline(table)
    torch_rows = table[table["kernel"] == "torch"]
    sdpa_rows = table[table["kernel"] == "sdpa-contiguous"]
    assert torch_rows["vs_sdpa"].to_numpy() == pytest.approx(
        torch_rows["median_ms"].to_numpy() / sdpa_rows["median_ms"].to_numpy())


def test_the_browser_flow_bench_compares_with_a_baseline_run_beside_it(capsys):
    """``benchmarks.app_flow --baseline``: a revision that is not a commit is refused before any browser starts;
    the table gives each change's median over the baseline's median of the same run."""
    from benchmarks.app_flow import main as app_flow_main, summarize

    assert app_flow_main(["--baseline", "no-such-revision", "--repeats", "1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --baseline 'no-such-revision' is not a commit of this repository"
    rows = [{"code": code, "commit": commit, "change": "rate", "seconds": seconds}
            for code, commit, seconds in (("this checkout", "b", 1.0), ("baseline", "a", 2.0),
                                          ("this checkout", "b", 3.0), ("baseline", "a", 4.0),
                                          ("this checkout", "b", 0.5), ("baseline", "a", 3.0))]
    table = {row["code"]: row for row in summarize(rows)}
    assert table["this checkout"]["median_s"] == 1.0 and table["baseline"]["median_s"] == 3.0
    assert table["this checkout"]["vs_baseline"] == pytest.approx(1 / 3) and table["baseline"]["vs_baseline"] == 1.0
    assert "vs_baseline" not in summarize(rows[::2])[0]  # no baseline, no ratio


def test_every_scheduling_flag_reaches_the_run(tmp_path, monkeypatch):
    """``--long-prefill-token-threshold`` was built by every command and read by none (issue 70): each command that
    offers the ``SchedulingSettings`` flags passes them all on (``scheduling_settings``), and the threshold changes a
    chunked simulation."""
    from dataclasses import fields

    import lab.engine
    import simulator.cli.main
    from lab.sched.scheduler import SchedulingSettings

    runs = {}
    for threshold in (0, 16):
        out = tmp_path / f"t{threshold}.csv"
        assert simulator.cli.main.main(["--scheduling", "chunked", "--long-prefill-token-threshold", str(threshold),
                                        "--num-requests", "40", "--allocators", "paged", "--out", str(out)]) == 0
        runs[threshold] = pd.read_csv(out, comment="#")
    assert not runs[0]["throughput_tok_s"].equals(runs[16]["throughput_tok_s"])

    seen = {}

    class Recorder:
        def __init__(self, model, **kwargs):
            seen.update(kwargs)
            raise SystemExit(0)

    monkeypatch.setattr(lab.engine, "LLMEngine", Recorder)
    with pytest.raises(SystemExit):
        main(["generate", "--model", "tiny", "--scheduling", "vllm", "--long-prefill-token-threshold", "8",
              "--no-scheduler-reserve-full-isl"])
    assert {f.name for f in fields(SchedulingSettings)} <= set(seen)
    assert seen["long_prefill_token_threshold"] == 8 and seen["scheduler_reserve_full_isl"] is False


def test_each_precision_s_vllm_bench_keeps_its_own_default_file():
    """The README's rows read fp32 from vllm_cpu.csv and bf16 from vllm_cpu_bf16.csv: the bf16 command once wrote
    over the fp32 figures, and so did the background load's."""
    from argparse import Namespace

    from lab.cli.main import VLLM_BENCH_OUT, _vllm_bench_out

    def out(**given):
        return _vllm_bench_out(Namespace(**{"out": VLLM_BENCH_OUT, "dtype": "float32", "kv_cache_dtype": "auto",
                                            "first_token_only": False, "background_load": False,
                                            **given}))

    assert out() == VLLM_BENCH_OUT
    assert out(dtype="bfloat16") == "benchmarks/results/vllm_cpu_bf16.csv"
    assert out(kv_cache_dtype="fp8_e4m3") == "benchmarks/results/vllm_fp8_cpu.csv"
    assert out(kv_cache_dtype="fp8_e4m3", first_token_only=True) == "benchmarks/results/vllm_fp8_agreement_cpu.csv"
    assert out(background_load=True) == "benchmarks/results/vllm_contention_cpu.csv"
    assert out(dtype="bfloat16", out="mine.csv") == "mine.csv"


def test_the_vllm_bench_pairs_each_repeat_s_runs():
    """The recorded tiny bf16 TTFTs of 525c9cf: ours was 1.03, 1.24 and 1.03 times vLLM's in the three repeats, and the
    ratio of the medians says 1.24 because ours ran in a slow spell once; the paired row says 1.03."""
    from lab.bench.vllm import METRICS, _medians

    ttft = {"vllm": [0.0395, 0.0323, 0.0302], "ours": [1.03 * 0.0395, 1.24 * 0.0323, 1.03 * 0.0302]}
    rows = [{"system": name, "repeat": r, **{m: 1.0 for m in METRICS}, "preemptions": 0, "ttft_p50_s": ttft[name][r]}
            for name in ("ours", "vllm") for r in range(3)]
    summary = {row["system"]: row for row in _medians(pd.DataFrame(rows), "quiet")}
    assert summary["ours / vllm"]["ttft_p50_s"] == pytest.approx(1.24)
    assert summary["ours / vllm, paired"]["ttft_p50_s"] == pytest.approx(1.03)
    assert summary["ours / vllm, paired"]["output_tok_s"] == 1.0
    assert math.isnan(summary["ours / vllm, paired"]["preemptions"])  # none on either side: no ratio

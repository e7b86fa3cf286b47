"""Every option of ``python -m simulator`` either changes the result or is refused (exit 2, one ``error:`` line):
none is accepted and ignored (issue 70: ``--long-prefill-token-threshold`` was built by every command and read by
none). A new option fails ``test_every_option_is_enumerated`` until it gets an alternative value here."""
import argparse

import pandas as pd
import pytest

import simulator.cli.main as simulator_cli

BASE = ["--num-requests", "24", "--allocators", "paged,contiguous-oracle", "--rate", "4", "--no-progress"]
# option -> the arguments that give it a value other than its default (with what that value needs)
ALTERNATIVES = {
    "--workload": ["--workload", "alpaca"], "--preset": ["--preset", "figure2"],
    "--allocators": ["--allocators", "paged"], "--block-size": ["--block-size", "32"],
    "--model": ["--model", "qwen3-0.6b"], "--gpu": ["--gpu", "h100-80gb"], "--max-model-len": ["--max-model-len", "1024"],
    "--rate": ["--rate", "1"], "--burstiness": ["--burstiness", "0.3"], "--num-requests": ["--num-requests", "20"],
    "--n": ["--n", "2"], "--beam-width": ["--beam-width", "2"], "--shared-prefix": ["--shared-prefix", "64"],
    "--time-scale": ["--time-scale", "2"], "--kv-cache-dtype": ["--kv-cache-dtype", "fp8"],
    "--capacity-tokens": ["--capacity-tokens", "3000"], "--num-blocks": ["--num-blocks", "150"],
    "--max-num-seqs": ["--max-num-seqs", "4"], "--max-num-batched-tokens": ["--max-num-batched-tokens", "256"],
    "--scheduling": ["--scheduling", "chunked"], "--long-prefill-token-threshold": ["--long-prefill-token-threshold", "8"],
    "--scheduler-reserve-full-isl": ["--no-scheduler-reserve-full-isl"],
    "--preemption-mode": ["--preemption-mode", "swap", "--capacity-tokens", "3000"],
    "--num-cpu-blocks": ["--num-cpu-blocks", "10"], "--kv-offload-gib": ["--kv-offload-gib", "4", "--shared-prefix", "64"],
    "--address-space": ["--address-space", "buddy"], "--no-prefix-caching": ["--no-prefix-caching", "--shared-prefix", "64"],
    "--replicas": ["--replicas", "2"], "--router": ["--router", "least-loaded"], "--max-points": ["--max-points", "5"],
    "--seed": ["--seed", "1"],
}
# options that produce no result of their own: where it goes, how it is shown, or a file the tests of its own cover
EXEMPT = {"--out": "where the summary goes", "--timeseries": "where the timeseries goes", "--checks": "an output",
          "--no-progress": "how progress is shown", "--help": "help",
          "--profile": "a measured profile: tests/test_profile_twin.py runs it, and it refuses what it makes moot",
          "--kernel-csv": "a kernel bench CSV: tests/test_simulator.py calibrates from one"}


def _options() -> set[str]:
    parser = simulator_cli.build_parser()
    return {option for action in parser._actions if not isinstance(action, argparse._SubParsersAction)
            for option in action.option_strings if option.startswith("--") and not option.startswith("--no-scheduler")}


def test_every_option_is_enumerated():
    assert _options() == set(ALTERNATIVES) | set(EXEMPT)


def _run(tmp_path, argv, name):
    summary, timeseries = tmp_path / f"{name}.csv", tmp_path / f"{name}-ts.csv"
    status = simulator_cli.main([*argv, "--out", str(summary), "--timeseries", str(timeseries)])
    if status != 0:
        return status, None
    frame = pd.read_csv(summary, comment="#").drop(columns=["wall_time_s"], errors="ignore")
    return status, (frame, pd.read_csv(timeseries, comment="#").drop(columns=["wall_time_s"], errors="ignore"))


@pytest.mark.parametrize("option", sorted(ALTERNATIVES))
def test_an_option_changes_the_result_or_is_refused(tmp_path, option, capsys):
    status, base = _run(tmp_path, BASE, "base")
    assert status == 0
    argv = [*BASE, *ALTERNATIVES[option]]
    status, result = _run(tmp_path, argv, "changed")
    if status != 0:
        assert status == 2 and "error:" in capsys.readouterr().err, option
        return
    summary, timeseries = result
    same = summary.shape == base[0].shape and summary.equals(base[0]) and timeseries.equals(base[1])
    assert not same, f"{' '.join(ALTERNATIVES[option])} was accepted and changed nothing"


@pytest.mark.parametrize("argv", [["--burstiness", "0.3"], ["--workload", "x.csv", "--rate", "2"]])
def test_an_option_the_workload_makes_moot_is_refused(tmp_path, argv, capsys):
    """Burstiness shapes arrival gaps, and an infinite rate (the default) has none; a rate rescales a trace's
    arrivals, and a trace whose arrivals are all equal has none to rescale."""
    if "x.csv" in argv:
        trace = tmp_path / "x.csv"
        trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,10\n0,12,5\n")
        argv = [a if a != "x.csv" else str(trace) for a in argv]
    assert simulator_cli.main(["--num-requests", "10", "--no-progress", *argv]) == 2
    assert "would be ignored" in capsys.readouterr().err


GENERATE_BASE = ["generate", "--model", "tiny", "--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "3"]
# option -> arguments that give it a value other than its default (what that value needs with it)
GENERATE_ALTERNATIVES = {
    "--model": ["--model", "qwen3-0.6b-random-4l"], "--device": ["--device", "cpu"], "--block-size": ["--block-size", "4"],
    "--backend": ["--backend", "reference"], "--prompt": ["--prompt", "1,2,3"], "--prompt-ids": ["--prompt-ids", "1,2,3"],
    "--num-prompts": ["--num-prompts", "3"], "--prompt-len": ["--prompt-len", "5"], "--max-tokens": ["--max-tokens", "4"],
    "--temperature": ["--temperature", "0.7"], "--top-k": ["--top-k", "5"], "--top-p": ["--top-p", "0.5"],
    "--n": ["--n", "2", "--temperature", "1.0"], "--seed": ["--seed", "3"], "--num-blocks": ["--num-blocks", "40"],
    "--no-prefix-caching": ["--no-prefix-caching"], "--max-num-seqs": ["--max-num-seqs", "1"],
    "--max-num-batched-tokens": ["--max-num-batched-tokens", "64"], "--scheduling": ["--scheduling", "vllm"],
    "--long-prefill-token-threshold": ["--long-prefill-token-threshold", "4"],
    "--scheduler-reserve-full-isl": ["--no-scheduler-reserve-full-isl"], "--preemption-mode": ["--preemption-mode", "swap"],
    "--num-cpu-blocks": ["--num-cpu-blocks", "8"], "--kv-cache-dtype": ["--kv-cache-dtype", "fp8_e4m3"],
    "--calculate-kv-scales": ["--calculate-kv-scales", "--kv-cache-dtype", "fp8"],
}
GENERATE_EXEMPT = {"--out": "where the metrics go", "--help": "help"}


def _generate_options() -> set[str]:
    import lab.cli.main as lab_cli

    parser = lab_cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    generate = commands.choices["generate"]
    return {option for action in generate._actions for option in action.option_strings
            if option.startswith("--") and not option.startswith("--no-scheduler")}


def test_every_generate_option_is_enumerated():
    assert _generate_options() == set(GENERATE_ALTERNATIVES) | set(GENERATE_EXEMPT)


@pytest.mark.parametrize("option", sorted(GENERATE_ALTERNATIVES))
def test_a_generate_option_reaches_the_engine_or_is_refused(option, monkeypatch, capsys):
    """``lab generate`` with an engine that records what it was given (the model, its config, the prompts and the
    sampling parameters): an option changes what the engine gets, or the command refuses it."""
    import lab.cli.main as lab_cli
    import lab.engine

    class Recorder:
        tokenizer = None

        class hf_model:
            class config:
                vocab_size = 1000

        def __init__(self, model, **config):
            self.seen = {"model": model, **config}

        def generate(self, prompts, params, progress=False):
            self.seen.update(prompts=prompts, params=repr(params))
            seen.append(self.seen)
            return []

        def run_metrics(self):
            return {}

    seen = []
    monkeypatch.setattr(lab.engine, "LLMEngine", Recorder)
    assert lab_cli.main(GENERATE_BASE) == 0
    status = lab_cli.main([*GENERATE_BASE, *GENERATE_ALTERNATIVES[option]])
    if status != 0:
        assert status == 2 and "error:" in capsys.readouterr().err
        return
    assert seen[1] != seen[0], f"{' '.join(GENERATE_ALTERNATIVES[option])} reached nothing"


PLAN_BASE = ["plan", "--slo", "ttft_p90=2", "--num-requests", "20", "--serial", "--no-progress"]
PLAN_ALTERNATIVES = {
    "--workload": ["--workload", "alpaca"], "--num-requests": ["--num-requests", "30"], "--slo": ["--slo", "ttft_p90=1"],
    "--models": ["--models", "qwen3-0.6b"], "--gpus": ["--gpus", "l4"], "--tp": ["--tp", "2"],
    "--replicas": ["--replicas", "2"], "--allocators": ["--allocators", "paged"], "--block-size": ["--block-size", "32"],
    "--router": ["--router", "random"], "--max-model-len": ["--max-model-len", "1024"],
    "--target-rate": ["--target-rate", "3"], "--gpu-price": ["--gpu-price", "a100-80gb=5"],
    "--kv-cache-dtype": ["--kv-cache-dtype", "fp8"], "--kv-offload-gib": ["--kv-offload-gib", "4"],
    "--host-price": ["--host-price", "0.5"], "--rate-start": ["--rate-start", "2"], "--tolerance": ["--tolerance", "0.1"],
    "--address": ["--address", "127.0.0.1:1"], "--num-cpus": ["--num-cpus", "1"],
}
PLAN_EXEMPT = {"--out": "where the table goes", "--serial": "how runs are spread (the same plan)",
               "--no-progress": "how progress is shown", "--help": "help"}


def _plan_options() -> set[str]:
    from simulator.cli.sweep import plan_parser

    return {option for action in plan_parser()._actions for option in action.option_strings if option.startswith("--")}


def test_every_plan_option_is_enumerated():
    assert _plan_options() == set(PLAN_ALTERNATIVES) | set(PLAN_EXEMPT)


@pytest.mark.parametrize("option", sorted(PLAN_ALTERNATIVES))
def test_a_plan_option_reaches_the_plan_or_is_refused(option, monkeypatch, capsys):
    """``simulator plan`` up to its runs (``run_plan`` records what it was given and stops): an option changes the
    configurations, SLOs, search, target, prices or where it runs, or the command refuses it."""
    import simulator.experiments.plan as plan

    seen = []

    def recorded(*args, **kwargs):
        seen.append(repr((args, kwargs)))
        raise SystemExit(0)

    monkeypatch.setattr(plan, "run_plan", recorded)
    with pytest.raises(SystemExit):
        simulator_cli.main(PLAN_BASE)
    try:
        status = simulator_cli.main([*PLAN_BASE, *PLAN_ALTERNATIVES[option]])
    except SystemExit:
        status = 0
    if status != 0:
        assert status == 2 and "error:" in capsys.readouterr().err
        return
    assert seen[1] != seen[0], f"{' '.join(PLAN_ALTERNATIVES[option])} reached nothing"

"""``scripts/gpu_check.sh`` runs only where a GPU is lent, for minutes at most, so it is tried here first: its dry run
executes every default step's Python entry on this CPU (tiny model, small sizes, the `gpu` tests collected), and its
GPU command lines (printed by ``GPU_CHECK_ECHO=1``) parse with the CLIs' own parsers, name known models, backends
and systems, fit one device call and write at most eight files."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from lab.bench.e2e import SYSTEMS
from lab.cli.main import build_parser
from lab.models.qwen3 import PRESETS
from simulator.cli.twin import twin_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU_CHECK_LIMIT_S = 480  # the guide's bound on scripts/gpu_check.sh
DEFAULT_STEPS = ["tests-kernels", "tests-engine", "tests-fp8", "parity", "decode", "bandwidth", "e2e"]
ALL_STEPS = DEFAULT_STEPS + ["profile", "twin"]


def _env(out: Path, **extra) -> dict:
    env = {**os.environ, "OUT": str(out), **extra}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this interpreter's python3 first
    return env


def gpu_commands(out: Path, steps: list[str]) -> dict[str, tuple[int, list[str]]]:
    """``{step: (time limit in s, argv)}`` as the script would run them on a GPU."""
    printed = subprocess.run(["bash", str(SCRIPT), *steps], cwd=ROOT, env=_env(out, GPU_CHECK_ECHO="1"),
                             capture_output=True, text=True, timeout=60, check=True).stdout
    commands = {}
    for line in printed.splitlines():
        words = shlex.split(line)
        if words and words[0] in ALL_STEPS:
            commands[words[0]] = (int(words[1]), words[2:])
    return commands


@pytest.fixture
def commands(tmp_path, monkeypatch):
    monkeypatch.setattr("lab.hardware.check_device", lambda name: name)  # as on the GPU machine
    return gpu_commands(tmp_path, ALL_STEPS)


def parsed(argv: list[str]):
    """``python -m lab ...`` parsed by the lab's parser, ``python -m simulator twin ...`` by the twin's."""
    assert Path(argv[0]).name.startswith("python") and argv[1] == "-m", argv
    return (build_parser() if argv[2] == "lab" else twin_parser()).parse_args(argv[3:])


def test_the_default_steps_fit_one_device_call_and_eight_files(tmp_path):
    default = gpu_commands(tmp_path, [])
    assert list(default) == DEFAULT_STEPS
    # the limits bound the run (8 minutes, so a fix and a second run fit the session's device time); a few seconds
    # more go to nvidia-smi and the version line
    assert sum(limit for limit, _ in default.values()) <= GPU_CHECK_LIMIT_S - 10
    everything = gpu_commands(tmp_path, ALL_STEPS)
    written = {argv[argv.index("--out") + 1] for _, argv in everything.values() if "--out" in argv}
    assert len(written) + 2 <= 8  # with gpu_info.csv and gpu_check.log


def test_the_gpu_commands_parse_with_known_names(commands):
    lab = {name: parsed(argv) for name, (_, argv) in commands.items() if not name.startswith("tests-")}
    for name in ("parity", "decode", "e2e", "profile", "twin"):
        assert lab[name].model in PRESETS and lab[name].device == "cuda" and lab[name].backend == "cupy", name
    assert lab["twin"].profile == lab["profile"].out and lab["twin"].model == lab["profile"].model
    bandwidth = lab["bandwidth"]
    assert bandwidth.device == "cuda" and bandwidth.back_to_back == 50 and set(bandwidth.backends.split(",")) == \
        {"torch", "cupy"} and (64, 512) in bandwidth.shapes and (8, 32768) in bandwidth.shapes
    assert set(lab["e2e"].systems.split(",")) <= set(SYSTEMS)
    assert lab["decode"].batch == (64,) and lab["decode"].context == (512, 4096)


def test_the_tests_steps_name_files_that_hold_gpu_tests(commands):
    for name in ("tests-kernels", "tests-engine", "tests-fp8"):
        argv = commands[name][1]
        assert argv[1:3] == ["-m", "pytest"] and "gpu" in argv
        assert all((ROOT / word).is_file() for word in argv if word.startswith("tests/"))


def test_the_dry_run_runs_every_default_step_on_the_cpu(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=400)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    for step in DEFAULT_STEPS:
        assert re.search(rf"^=== {step}: exit 0 after", log, re.M), (step, log[-3000:])
    for test_file in re.findall(r"(tests/test_\w+\.py)", SCRIPT.read_text()):
        assert f"{test_file}::" in log, test_file  # collected: each file named holds gpu tests
    parity = pd.read_csv(tmp_path / "parity_gpu.csv")
    greedy = parity[parity["check"] == "greedy_tokens"]
    assert len(greedy) == 2 and (greedy["tokens_equal"] == 1.0).all() and not greedy["cuda_graphs"].any()
    assert parity.loc[parity["check"] == "first_step_logits", "top1_agreement"].notna().all()
    assert len(pd.read_csv(tmp_path / "decode_gpu.csv")) == 2
    assert set(pd.read_csv(tmp_path / "kernels_gpu.csv")["batch"]) == {1, 2}
    assert set(pd.read_csv(tmp_path / "e2e_gpu.csv")["system"]) >= {"paged-engine", "hf-continuous"}
    assert len(list(tmp_path.iterdir())) <= 8


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    """A step that fails (here: pytest exits 3) is logged with its exit status; the next step still runs and the
    script exits non-zero."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(f'#!/bin/sh\ncase "$*" in "-m pytest"*) exit 3;; esac\nexec {sys.executable} "$@"\n')
    (fake / "python3").chmod(0o755)
    env = _env(tmp_path)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", "tests-kernels", "bandwidth"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=200)
    assert run.returncode != 0
    assert "=== tests-kernels: exit 3" in run.stdout and "=== bandwidth: exit 0" in run.stdout
    assert (tmp_path / "kernels_gpu.csv").is_file()

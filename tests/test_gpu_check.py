"""``scripts/gpu_check.sh`` runs only where a GPU is lent, for minutes at most: its command lines are checked here, on
CPU, so that a lent GPU is not spent on a renamed flag. Each step's ``python -m lab`` (or ``simulator twin``) arguments parse with the CLI's
own parser (the device check told that CUDA exists), name known models, backends and systems, and the twin reads the
profile the profile step writes; the pytest step collects ``gpu`` tests; the steps' time limits fit one device call."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lab.bench.e2e import SYSTEMS
from lab.cli.main import build_parser
from lab.models.qwen3 import PRESETS
from simulator.cli.twin import twin_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU_CHECK_LIMIT_S = 480  # the guide's bound on scripts/gpu_check.sh


def script_steps(out: Path) -> dict[str, tuple[int, list[str]]]:
    """``{step name: (time limit in s, command argv)}`` from the script's ``step NAME LIMIT COMMAND...`` lines."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    steps = {}
    for line in text.splitlines():
        if line.startswith("step "):
            words = shlex.split(line.replace('"$py"', "python").replace('"$out', f'"{out}'))
            steps[words[1]] = (int(words[2]), words[3:])
    return steps


@pytest.fixture
def steps(tmp_path, monkeypatch):
    monkeypatch.setattr("lab.hardware.check_device", lambda name: name)  # as on the GPU machine
    return script_steps(tmp_path)


def lab_args(argv: list[str]):
    """``python -m lab ...`` parsed by the lab's parser, ``python -m simulator twin ...`` by the twin's."""
    assert argv[:2] == ["python", "-m"] and argv[2] in ("lab", "simulator"), argv
    return (build_parser() if argv[2] == "lab" else twin_parser()).parse_args(argv[3:])


def test_every_step_runs_and_they_fit_one_device_call(steps):
    default = re.search(r'steps=" \$\{\*:-([a-z0-9 ]+)\} "', SCRIPT.read_text()).group(1).split()
    assert list(steps) == default == ["tests", "decode", "e2e", "kernels", "profile", "twin"]
    # the limits bound the run (8 minutes, so a fix and a second run fit the session's device time); a few seconds
    # more go to nvidia-smi and the version line
    assert sum(limit for limit, _ in steps.values()) <= GPU_CHECK_LIMIT_S - 5


def test_the_lab_commands_parse_with_known_names(steps):
    profile, twin = lab_args(steps["profile"][1]), lab_args(steps["twin"][1])
    kernels, e2e, decode = lab_args(steps["kernels"][1]), lab_args(steps["e2e"][1]), lab_args(steps["decode"][1])
    for args in (profile, twin, e2e, decode):
        assert args.model in PRESETS and args.device == "cuda" and args.backend == "cupy"
    assert twin.profile == profile.out and twin.model == profile.model
    assert set(kernels.backends.split(",")) <= {"torch", "cupy", "reference"} and kernels.device == "cuda"
    assert set(e2e.systems.split(",")) <= set(SYSTEMS)


def test_the_pytest_step_collects_gpu_tests(steps):
    argv = steps["tests"][1]
    assert argv[:3] == ["python", "-m", "pytest"] and "gpu" in argv
    files = [word for word in argv if word.startswith("tests/")]
    assert files and all((ROOT / name).is_file() for name in files)
    collected = subprocess.run([sys.executable, *argv[1:], "--collect-only"], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    for name in files:  # each file named holds some of the gpu tests
        assert f"{name}::" in collected.stdout, name

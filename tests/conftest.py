import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TRACES = ROOT.parent / "shared" / "traces"


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# The suite runs on two pytest-xdist workers, a test file at a time on one of them (pyproject's addopts, ``--dist
# loadfile``): a file's module fixtures (a Streamlit server, a vLLM peer) and the order of its checks stay whole.
def pytest_configure(config):
    """Each xdist worker's torch gets its share of the cores: two workers each running a team of every core's
    threads make each OpenMP barrier wait for a thread the other worker's team holds up."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.skip(f"shared traces not found at {TRACES}")
    return TRACES

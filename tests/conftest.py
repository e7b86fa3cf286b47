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
# xdist hands files out in collection order (with --no-loadscope-reorder, in pyproject; by default it orders them by
# their number of tests), so the longest go first, as in longest-first scheduling. Ordered by tests, the vLLM files
# (about 2 and 1.5 minutes, few tests) come last, where one worker may run them while the other has nothing left. The ranks come
# from worker-seconds per file, measured with --durations=0 on this 2-core machine.
LONGEST_FIRST = ("test_browser.py", "test_app.py", "test_browser_engines.py", "test_vllm_twin.py",
                 "test_vllm_peer.py", "test_browser_fp8.py", "test_gpu_check.py", "test_kernels.py",
                 "test_fp8_kv.py", "test_simulator.py", "test_paper.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
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

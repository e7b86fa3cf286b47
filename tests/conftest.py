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


# The suite runs on two pytest-xdist workers (pyproject's addopts, ``--dist loadgroup``). Files that share a costly
# resource run on one worker, in file order: the browser tests share a Streamlit server and the order of their
# checks (the server log is read last), the vLLM tests a peer process each, and the nvcc tests one offline build of
# every CUDA instance (tests/cuda_build.py builds it once per process).
XDIST_GROUPS = {"browser": ("test_browser.py", "test_browser_fp8.py"),
                "vllm": ("test_vllm_peer.py", "test_vllm_server.py", "test_vllm_twin.py"),
                "nvcc": ("test_cupy_fp8.py", "test_cupy_launcher.py", "test_kernels.py")}
_GROUP_OF = {name: group for group, names in XDIST_GROUPS.items() for name in names}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _GROUP_OF.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
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

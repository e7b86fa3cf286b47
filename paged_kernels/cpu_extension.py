"""The CPU decode and prefill attention that read the block pool in place and the fused q/k norm + rotary + cache write
(``csrc/cpu_paged_attention.cpp``), a torch C++
extension compiled on first use with this machine's C++ compiler (``torch.utils.cpp_extension``; nothing is
downloaded, the build is cached under ``~/.cache/torch_extensions``). Where it cannot be built, the torch backend
gathers the blocks instead (``status`` says why)."""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
_lock = threading.Lock()
_module = None
_error: str | None = None


def extension():
    """The compiled module, or None when it cannot be built here (the reason: ``status``)."""
    global _module, _error
    if _module is None and _error is None:
        with _lock:
            if _module is None and _error is None:
                try:
                    from torch.utils.cpp_extension import load

                    _ninja_on_path()

                    _module = load(_build_name(), [str(SOURCE)],
                                   extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                                   extra_ldflags=["-fopenmp"], verbose=False)
                except Exception as exc:  # no compiler, no headers: the gathering path serves
                    _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                    warnings.warn(f"the in-place CPU attention could not be built ({_error}); attention on the "
                                  f"CPU gathers the blocks instead", RuntimeWarning, stacklevel=2)
    return _module


def _build_name() -> str:
    """The extension's name with a hash of its source: checkouts of different sources on one machine (worktrees,
    branches) each keep their own build under ``~/.cache/torch_extensions`` instead of rebuilding over each other's
    and loading a module whose functions take other arguments."""
    import hashlib

    return f"minipaged_cpu_attention_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]}"


def _ninja_on_path() -> None:
    """The ``ninja`` the lock installs (the pip package's binary) on ``PATH``, which the build runs: an environment
    used without activating it has its ``bin/`` off ``PATH``."""
    try:
        import ninja
    except ImportError:  # the system's ninja, if any, serves
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def status() -> str | None:
    """None when the extension is built (or builds now), else why it cannot be."""
    extension()
    return _error

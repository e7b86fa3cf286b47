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
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def extension():
    """The compiled module, or None when it cannot be built here (the reason: ``status``)."""
    global _module, _error
    if _module is None and _error is None:
        with _lock:
            if _module is None and _error is None:
                try:
                    _module = _built() or _build()
                except Exception as exc:  # no compiler, no headers: the gathering path serves
                    _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                    warnings.warn(f"the in-place CPU attention could not be built ({_error}); attention on the "
                                  f"CPU gathers the blocks instead", RuntimeWarning, stacklevel=2)
    return _module


def _build_name() -> str:
    """The extension's name with a hash of what its binary depends on: the source, torch's version, Python's, the
    compiler flags and this CPU's features (``-march=native``). Checkouts of different sources on one machine
    (worktrees, branches) each keep their own build instead of rebuilding over each other's, and a checkout or a
    fresh virtual environment with the same inputs loads the binary already built (``_built``)."""
    import hashlib
    import sys

    import torch

    inputs = [SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(), repr(CFLAGS).encode(),
              _cpu_features().encode()]
    digest = hashlib.sha256(b"\0".join(inputs)).hexdigest()[:10]
    return f"minipaged_cpu_attention_{digest}"


def _cpu_features() -> str:
    """The CPU's model and feature flags (``/proc/cpuinfo``), or the platform's machine name elsewhere."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _build_directory() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / _build_name()


def _built():
    """The module already built from the same inputs (``_build_name``), loaded without running the build: torch's
    own check runs ninja, which rebuilds whenever the source's path or the headers' timestamps differ (another
    checkout, a fresh virtual environment). None when there is none yet or a build is under way."""
    import importlib.util

    directory = _build_directory()
    library = directory / f"{directory.name}.so"
    if not library.exists() or (directory / "lock").exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(directory.name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:  # a binary that does not load here: build it again
        return None
    return module


def _build():
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    directory = _build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    return load(directory.name, [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(directory), verbose=False)


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

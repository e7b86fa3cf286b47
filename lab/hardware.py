"""What this machine offers: CPU, memory, GPU, CuPy and the kernel backends."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pandas as pd

from .errors import InputError


def check_device(name) -> str:
    """``name`` if it is ``cpu`` or ``cuda[:N]`` for a GPU this machine has, else ``ValueError`` saying why."""
    import torch

    if name == "cpu":
        return name
    if not isinstance(name, str) or name.split(":")[0] != "cuda":
        raise InputError(f"expected cpu or cuda[:N], got {name!r}")
    if not torch.cuda.is_available():
        raise InputError(f"{name!r}: this machine has no CUDA device (torch sees none)")
    try:
        index = torch.device(name).index
    except RuntimeError as exc:
        raise InputError(f"{name!r}: {exc}") from None
    if index is not None and index >= torch.cuda.device_count():
        raise InputError(f"{name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo on Linux), else what ``platform`` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    """Physical memory of the machine, when the OS tells."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def describe_hardware() -> pd.DataFrame:
    """A two-column table (item, value) describing the hardware and the usable kernel backends."""
    import torch

    import paged_kernels

    usable, reason = paged_kernels.cupy_status()
    memory = memory_bytes()
    rows = [("CPU", f"{cpu_name()} × {os.cpu_count()} cores"),
            ("memory", f"{memory / 2**30:.0f} GiB" if memory else "unknown"), ("torch", torch.__version__)]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.append(("GPU", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"))
    else:
        rows.append(("GPU", "none visible"))
    rows += [("CuPy kernels", "yes" if usable else f"no — {reason}"),
             ("kernel backends", ", ".join(paged_kernels.available_backends()))]
    return pd.DataFrame(rows, columns=["item", "value"])

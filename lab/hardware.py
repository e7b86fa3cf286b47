"""What this machine offers: CPU, GPU, CuPy and the kernel backends."""
from __future__ import annotations

import os
import platform

import pandas as pd


def describe_hardware() -> pd.DataFrame:
    """A two-column table (item, value) describing the hardware and the usable kernel backends."""
    import torch

    import kernels

    usable, reason = kernels.cupy_status()
    rows = [("CPU", f"{platform.processor() or platform.machine()} × {os.cpu_count()} cores"),
            ("torch", torch.__version__)]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.append(("GPU", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"))
    else:
        rows.append(("GPU", "none visible"))
    rows += [("CuPy kernels", "yes" if usable else f"no — {reason}"),
             ("kernel backends", ", ".join(kernels.available_backends()))]
    return pd.DataFrame(rows, columns=["item", "value"])

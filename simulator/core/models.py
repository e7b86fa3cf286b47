"""Model and GPU presets and the one cost model of the simulator: a per-iteration roofline."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from lab import user_files
from lab.checks import entry_point
from lab.errors import InputError

GiB = 1 << 30


@dataclass(slots=True)
class ModelSpec:
    """Transformer shape; every figure the memory and cost model needs derives from it."""

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    mlp_matrices: int = 3  # 3 for gated SwiGLU (Qwen3, Llama), 2 for OPT's fc1/fc2
    kv_dtype_bytes: int = 0  # bytes of one cached K or V element (0: the model's dtype; 1: an FP8 KV cache)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, in the KV cache's element type."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    @property
    def layer_params(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        return attention + self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token (the input embedding is a lookup, the lm_head is a matmul)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size


@dataclass(slots=True)
class GPUSpec:
    """Memory (bytes), HBM bandwidth (bytes/s), dense 16-bit peak (FLOP/s), the effective host link (bytes/s) that
    swapping uses, and the fixed cost of one device<->host copy call (one per block, layer and K/V, as vLLM swaps)."""

    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    peak_flops: float
    host_link_bytes_s: float = 25e9  # PCIe 4.0 x16, effective
    copy_call_overhead_s: float = 2e-6
    nvlink_bytes_s: float = 300e9  # per direction, what a ring all-reduce moves (A100 NVLink 3: 600 GB/s both ways)
    collective_latency_s: float = 10e-6  # fixed cost of one all-reduce
    price_per_hour: float = 2.0  # USD per GPU-hour (list-price placeholders; override per run or on the CLI)


MODELS = {m.name: m for m in [
    ModelSpec("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936, tied_embeddings=True),
    ModelSpec("qwen3-1.7b", 28, 2048, 16, 8, 128, 6144, 151936, tied_embeddings=True),
    ModelSpec("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936, tied_embeddings=True),
    ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    ModelSpec("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936),
    ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936),
    ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    ModelSpec("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    ModelSpec("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, tied_embeddings=True, mlp_matrices=2),
    ModelSpec("opt-66b", 64, 9216, 72, 72, 128, 36864, 50272, tied_embeddings=True, mlp_matrices=2),
    ModelSpec("opt-175b", 96, 12288, 96, 96, 128, 49152, 50272, tied_embeddings=True, mlp_matrices=2),
]}

GPUS = {g.name: g for g in [
    GPUSpec("a100-40gb", 40 * GiB, 1.555e12, 312e12, price_per_hour=3.0),
    GPUSpec("a100-80gb", 80 * GiB, 2.039e12, 312e12, price_per_hour=3.7),
    GPUSpec("h100-80gb", 80 * GiB, 3.35e12, 989e12, host_link_bytes_s=50e9, nvlink_bytes_s=450e9,  # PCIe 5, NVLink 4
            price_per_hour=6.0),
    GPUSpec("h200", 141e9, 4.8e12, 989e12, host_link_bytes_s=50e9, nvlink_bytes_s=450e9, price_per_hour=7.0),
    GPUSpec("l4", 24e9, 300e9, 121e12, nvlink_bytes_s=32e9, price_per_hour=0.8),  # no NVLink: PCIe 4 peer to peer
    GPUSpec("rtx-4090", 24 * GiB, 1.008e12, 165e12, nvlink_bytes_s=32e9, price_per_hour=0.7),
]}


@entry_point
def get_model(name_or_spec) -> ModelSpec:
    """A model preset by name (case-insensitive), or the spec itself."""
    return _preset(name_or_spec, ModelSpec, MODELS, "model")


@entry_point
def get_gpu(name_or_spec) -> GPUSpec:
    """A GPU preset by name (case-insensitive), or the spec itself."""
    return _preset(name_or_spec, GPUSpec, GPUS, "GPU")


def _preset(name_or_spec, kind: type, presets: dict, noun: str):
    if isinstance(name_or_spec, kind):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise InputError(f"{noun} must be a preset name or a {kind.__name__}; got {name_or_spec!r}; "
                         f"presets: {', '.join(presets)}")
    key = name_or_spec.lower()
    if key not in presets:
        raise InputError(f"unknown {noun} {name_or_spec!r}; presets: {', '.join(presets)}")
    return presets[key]


def override(spec, **changes):
    """A copy of a model or GPU spec with some fields replaced (None values are ignored). Numbers must be finite
    and positive (integers where the field is one); ``ValueError`` names the field otherwise."""
    changes = {k: v for k, v in changes.items() if v is not None}
    kinds = {f.name: {"int": int, "float": float, "str": str, "bool": bool}[str(f.type)] for f in dataclasses.fields(spec)}
    unknown = set(changes) - set(kinds)
    if unknown:
        raise InputError(f"unknown {type(spec).__name__} field(s): {', '.join(sorted(map(str, unknown)))}")
    for name, value in changes.items():
        _check_field(type(spec).__name__, name, kinds[name], value)
    return dataclasses.replace(spec, **changes)


def _check_field(owner: str, name: str, kind: type, value) -> None:
    if kind is str:
        if not isinstance(value, str) or not value:
            raise InputError(f"{owner}.{name}={value!r}: expected a non-empty string")
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise InputError(f"{owner}.{name}={value!r}: expected True or False")
        return
    number = numbers.Integral if kind is int else numbers.Real
    if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value) or value <= 0 \
            or value > 1e30:
        allowed = "an integer" if kind is int else "a number"
        raise InputError(f"{owner}.{name}={value!r}: expected {allowed} > 0")


def check_tensor_parallel(model: ModelSpec, tp: int) -> None:
    """Refuse a tensor-parallel degree that does not split ``model``'s heads evenly, as vLLM refuses it (attention
    heads divisible by ``tp``; KV heads divisible by it, or replicated when ``tp`` is a multiple of them:
    ``ModelConfig.verify_with_parallel_config`` and ``get_num_kv_heads``, vllm/config/model.py)."""
    kv = model.num_kv_heads
    if model.num_q_heads % tp or (kv % tp if tp <= kv else tp % kv):
        raise InputError(f"tp={tp} does not divide {model.name}'s {model.num_q_heads} attention heads and "
                         f"{kv} KV heads evenly (vLLM refuses it); try a divisor of {model.num_q_heads}")


@entry_point
def kv_capacity_tokens(model: ModelSpec, gpu: GPUSpec, gpu_memory_utilization: float = 0.9,
                       activation_reserve_bytes: float = 1 * GiB, tp: int = 1) -> int:
    """Tokens of KV that fit: per GPU, memory x utilization - its share of the weights - activation reserve, over
    its share of a token's KV (tensor parallelism over ``tp`` GPUs splits weights and KV heads)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise InputError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free = gpu.memory_bytes * gpu_memory_utilization - model.weight_bytes / tp - activation_reserve_bytes
    if free * tp < model.kv_bytes_per_token:
        raise InputError(f"{model.name} ({model.weight_bytes / GiB:.1f} GiB of weights) leaves no KV memory on "
                         f"{tp} x {gpu.name} at utilization {gpu_memory_utilization}")
    return int(free * tp // model.kv_bytes_per_token)


# The paged kernel's slowdown against reading the same KV contiguously, by block size: each block costs a
# block-table lookup and a separate, shorter load, worth about DEFAULT_BLOCK_OVERHEAD_TOKENS tokens of bandwidth
# (factor 1 + 2 / B: 3x at B = 1, 1.25x at B = 8, 1.06x at B = 32), the shape of the vLLM paper's Fig. 18a where
# blocks below 16 slow the kernel down. A kernel CSV with several block sizes replaces it with the measured curve.
DEFAULT_BLOCK_OVERHEAD_TOKENS = 2.0


KERNEL_CSV_COLUMNS = ("kernel", "batch", "context", "kv_gb_per_s")


def read_kernel_csv(path: str | Path):
    """A ``python -m lab bench kernels`` CSV, read strictly by ``lab.user_files`` (distinct column names, every row
    as many fields as the header) and checked: ``batch``, ``context`` (and ``block_size`` where given) whole numbers
    >= 1, every paged kernel's ``kv_gb_per_s`` a bandwidth in (0, 1e6) GB/s, at least one paged row. The numeric
    columns come back as numbers; ``InputError`` names the file, line and column of the first bad field."""
    import numpy as np
    import pandas as pd

    name = str(path)
    frame = user_files.csv_frame(user_files.read_text(path, InputError, user_files.MAX_SETTINGS_BYTES), name,
                                 InputError, KERNEL_CSV_COLUMNS)
    frame["kernel"] = frame["kernel"].str.strip().str.lower()  # SDPA-contiguous is the baseline too
    for column in ("batch", "context", "block_size"):
        if column in frame:
            values = user_files.numeric_column(frame, column, name, InputError)
            bad = (values < 1) | (values != np.floor(values)) | (values > 2**31)
            if bad.any():
                row = int(np.argmax(bad))
                raise InputError(f"{name}: line {frame.index[row]}, column {column}: "
                                 f"{user_files.shown(frame[column].iloc[row])} is not a whole number in [1, 2^31]")
            frame[column] = values.astype(np.int64)
    paged = frame["kernel"] != "sdpa-contiguous"
    if not paged.any():
        raise InputError(f"{name}: no paged-kernel rows")
    rates = user_files.numeric_column(frame[paged], "kv_gb_per_s", name, InputError)
    bad = ~((rates > 0) & (rates < 1e6))
    if bad.any():
        row = int(np.argmax(bad))
        raise InputError(f"{name}: line {frame.index[paged.to_numpy()][row]}, column kv_gb_per_s: "
                         f"{user_files.shown(frame['kv_gb_per_s'][paged].iloc[row])} is not a bandwidth in (0, 1e6) GB/s")
    frame["kv_gb_per_s"] = pd.to_numeric(frame["kv_gb_per_s"].str.strip(), errors="coerce")  # only paged rows count
    return frame


def block_slowdown_curve(table) -> dict[int, float]:
    """Measured slowdown per block size from a kernel benchmark table with several block sizes: the best achieved
    KV bandwidth over each block size's (median over the paged kernels' rows at the table's largest shape)."""
    paged = table[table["kernel"] != "sdpa-contiguous"]
    size = paged["batch"] * paged["context"]
    largest = paged[size == size.max()]
    bandwidth = largest.groupby("block_size")["kv_gb_per_s"].median()
    return {int(b): float(bandwidth.max() / value) for b, value in bandwidth.items()}


@entry_point
@dataclass(slots=True)
class CostModel:
    """Roofline time of one iteration: max(FLOPs / achievable FLOP/s, weight bytes / achievable bandwidth + KV bytes /
    attention bandwidth) + a fixed per-step overhead. Copies (grow-by-copy) cost read + write over bandwidth. With
    tensor parallelism over ``tp`` GPUs each GPU does 1/tp of the work and every layer adds two ring all-reduces of
    the batch's hidden states over NVLink (2 (tp - 1) / tp of the bytes, plus a fixed latency each).

    ``block_size`` (paged runs; None for contiguous KV) makes attention depend on it twice: every sequence reads its
    last, partly filled block whole (on average (B - 1) / 2 slots more), and the KV bandwidth drops by the kernel's
    slowdown at that block size (``block_slowdown``: the measured curve of a kernel CSV, else 1 + 2 / B)."""

    model: ModelSpec
    gpu: GPUSpec
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.85
    step_overhead_s: float = 1e-3
    attention_bandwidth_bytes_s: float | None = None  # None: bandwidth x efficiency; a kernel CSV can calibrate it
    tp: int = 1
    block_size: int | None = None  # paged KV blocks of this many tokens; None: contiguous KV
    block_slowdowns: dict | None = None  # measured {block size: slowdown}; None: the default curve
    _terms: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

    @property
    def block_slowdown(self) -> float:
        """How much slower the attention kernel reads KV at ``block_size`` than contiguously (1.0 for None)."""
        if self.block_size is None:
            return 1.0
        if not self.block_slowdowns:
            return 1.0 + DEFAULT_BLOCK_OVERHEAD_TOKENS / self.block_size
        sizes = sorted(self.block_slowdowns)
        if self.block_size <= sizes[0] or self.block_size >= sizes[-1]:
            return self.block_slowdowns[sizes[0] if self.block_size <= sizes[0] else sizes[-1]]
        # log-linear between the measured sizes around it
        upper = next(s for s in sizes if s >= self.block_size)
        lower = sizes[sizes.index(upper) - 1]
        weight = (math.log(self.block_size) - math.log(lower)) / (math.log(upper) - math.log(lower))
        return self.block_slowdowns[lower] * (1 - weight) + self.block_slowdowns[upper] * weight

    @property
    def _bandwidth(self) -> float:
        return self.gpu.bandwidth_bytes_s * self.bandwidth_efficiency

    @property
    def _attention_bandwidth(self) -> float:
        return self.attention_bandwidth_bytes_s or self._bandwidth

    def iteration_time(self, num_tokens: int, attention_pairs: float, kv_tokens_read: float,
                       num_decode_seqs: int = 0) -> float:
        """Seconds for an iteration over ``num_tokens`` tokens whose attention covers ``attention_pairs``
        (query, key) pairs and reads ``kv_tokens_read`` cached tokens of KV, ``num_decode_seqs`` of them decoding
        (each reads its last block whole when KV is paged)."""
        if num_tokens == 0:
            return 0.0
        if not self._terms:
            self._terms = self._precompute()
        token_s, pair_s, weights_s, kv_token_s, reduce_s, reduce_token_s, partial_tokens = self._terms
        compute_s = token_s * num_tokens + pair_s * attention_pairs
        memory_s = weights_s + kv_token_s * (kv_tokens_read + num_tokens + partial_tokens * num_decode_seqs)
        return (compute_s if compute_s > memory_s else memory_s) + self.step_overhead_s + \
            (reduce_s + reduce_token_s * num_tokens if self.tp > 1 else 0.0)

    def _precompute(self) -> tuple[float, ...]:
        """Per GPU: seconds per token of matmuls, per attention pair, for the weights, per KV token moved; the
        all-reduces' fixed seconds and seconds per token."""
        m, tp, peak = self.model, self.tp, self.gpu.peak_flops * self.flops_efficiency
        reduces = 2 * m.num_layers
        ring = 2 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes / self.gpu.nvlink_bytes_s
        return (2 * m.matmul_params / peak / tp, 4 * m.num_layers * m.num_q_heads * m.head_dim / peak / tp,
                m.weight_bytes / self._bandwidth / tp,
                m.kv_bytes_per_token * self.block_slowdown / self._attention_bandwidth / tp,
                reduces * self.gpu.collective_latency_s, reduces * ring,
                0.0 if self.block_size is None else (self.block_size - 1) / 2)

    def copy_time(self, num_tokens: int) -> float:
        """Seconds to copy ``num_tokens`` tokens of KV within device memory."""
        return 2 * num_tokens * self.model.kv_bytes_per_token / self._bandwidth / self.tp

    def block_bytes(self, block_size: int) -> float:
        """One KV block's bytes on one GPU (each holds its heads' share under tensor parallelism)."""
        return block_size * self.model.kv_bytes_per_token / self.tp

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to move ``num_blocks`` KV blocks between device and host: bytes over the host link plus one copy
        call per block, layer and K/V (so small blocks swap slowly, as the vLLM paper's section 7 reports)."""
        if num_blocks == 0:
            return 0.0
        block_bytes = self.block_bytes(block_size)
        calls = 2 * self.model.num_layers * num_blocks
        return num_blocks * block_bytes / self.gpu.host_link_bytes_s + calls * self.gpu.copy_call_overhead_s

    def calibrate_from_kernel_csv(self, path: str | Path) -> float:
        """Set the attention bandwidth from a ``python -m lab bench kernels`` CSV: the median achieved KV GB/s of
        the paged kernels at the CSV's largest shape; a CSV of several block sizes also gives the measured slowdown
        per block size (``block_slowdown_curve``). Returns the bandwidth in bytes/s."""
        paged = read_kernel_csv(path)
        paged = paged[paged["kernel"] != "sdpa-contiguous"]
        if "block_size" in paged and paged["block_size"].nunique() > 1:
            self.block_slowdowns = block_slowdown_curve(paged)
        size = paged["batch"] * paged["context"]
        largest = paged[size == size.max()]
        if self.block_slowdowns:  # the bandwidth of the best block size; the curve prices the others
            best = min(self.block_slowdowns, key=self.block_slowdowns.get)
            largest = largest[largest["block_size"] == best]
        self.attention_bandwidth_bytes_s = float(largest["kv_gb_per_s"].median() * 1e9)
        self._terms = ()
        return self.attention_bandwidth_bytes_s

"""The launch ledger: how many kernels a step of the CUDA code path launches, counted on a CPU.

A decode step on a GPU is bound by launches, not by bytes, when each op is its own kernel. This runs one prefill
and one decode step of the model runner's CUDA path on PyTorch's meta device (shapes without data, as
``tests/test_device_placement.py`` does) with the CuPy launcher recorded instead of launched, and counts per layer
and per step: every CuPy launch, and every aten op that would launch a kernel on CUDA (views, reshapes and
allocations launch none; a GEMM counts one). It also times what the host does per step outside the forward on this
machine's CPU, with a real engine.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import paged_kernels
from paged_kernels import cupy_backend

from lab.models.qwen3 import load_hf_model
from lab.worker.model_runner import ForwardBatch, ModelRunner
from lab.worker.static_decode import MAX_GRAPH_CONTEXT, StaticDecode

# aten ops that launch nothing on CUDA: views and metadata, and allocations (memory comes from the caching allocator)
NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
    "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "empty", "empty_like",
    "empty_strided", "lift_fresh", "reshape", "_reshape_alias", "narrow", "view_as", "unflatten", "flatten",
    "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "resolve_conj", "resolve_neg",
})
COPY_IF_NEW = frozenset({"to", "_to_copy", "contiguous"})  # a copy or conversion kernel only when they make a tensor
LEDGER_COLUMNS = ["model", "step", "tokens", "context", "layer", "kind", "launches"]


@dataclass(slots=True)
class LedgerConfig:
    """The model (a preset; its shapes, random weights on the meta device) and the two steps counted."""

    model: str = "qwen3-0.6b-random"
    batch: int = 64  # sequences of the decode step
    context: int = 512  # tokens each decode sequence attends to
    prompt_len: int = 128  # tokens of the prefill step (one prompt, nothing cached)
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    cuda_graphs: bool = True  # the engine's default: decode steps replay graphs captured for the graph context


def graph_context(runner: ModelRunner) -> int:
    """The context a decode graph is captured for: the engine's default ``max_model_len`` (the model's), at most
    ``MAX_GRAPH_CONTEXT``."""
    return min(getattr(runner.hf.config, "max_position_embeddings", MAX_GRAPH_CONTEXT), MAX_GRAPH_CONTEXT)


class _Counter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel, by (layer, op)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.layer = -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        out = func(*args, **(kwargs or {}))
        if name not in NO_LAUNCH and (name not in COPY_IF_NEW or out is not args[0]):
            self.counts[(self.layer, f"aten.{name}")] += 1
        return out


@contextlib.contextmanager
def _recorded_cupy(counter: _Counter):
    """The CuPy backend on meta tensors: every launch is recorded as one kernel of the current layer."""
    saved = (paged_kernels.cupy_status, cupy_backend.is_cuda, cupy_backend._launch, cupy_backend._kernel,
             cupy_backend._sm_count)

    def record(kernel, grid, block, args, device, shared_mem=0):
        counter.counts[(counter.layer, f"cupy.{kernel.split('<')[0]}")] += 1

    paged_kernels.cupy_status = lambda: (True, "ok")
    cupy_backend.is_cuda = lambda tensor: True
    cupy_backend._launch, cupy_backend._kernel = record, lambda name, *rest: name
    cupy_backend._sm_count = lambda device: 132
    try:
        yield
    finally:
        (paged_kernels.cupy_status, cupy_backend.is_cuda, cupy_backend._launch, cupy_backend._kernel,
         cupy_backend._sm_count) = saved


def _meta_runner(config: LedgerConfig, num_blocks: int) -> ModelRunner:
    hf_model, _ = load_hf_model(config.model, config.dtype, torch.device("meta"))
    runner = ModelRunner(hf_model, num_blocks, config.block_size, "torch")
    runner.attention_backend = runner.cache_backend = "cupy"  # what auto picks on a GPU for these shapes
    return runner


def _decode_batch(config: LedgerConfig, runner: ModelRunner) -> ForwardBatch:
    """The decode step as the engine feeds it: through the static decode buffers (``StaticDecode.graph_inputs``:
    int64 ids, positions and slots, int32 lengths, block tables as wide as the graph context), attention partitioned
    for the graph context with graphs on, for the batch's own context without."""
    context = graph_context(runner)
    static = StaticDecode(runner, config.batch, context, graphs=False)
    batch, _ = static.graph_inputs(config.batch, context if config.cuda_graphs else config.context)
    return batch


def _prefill_batch(config: LedgerConfig) -> ForwardBatch:
    tokens = config.prompt_len
    meta = dict(device="meta", dtype=torch.long)
    table = torch.empty(-(-tokens // config.block_size), **meta)
    return ForwardBatch(torch.empty(tokens, **meta), torch.empty(tokens, **meta), torch.empty(tokens, **meta),
                        [tokens], [0], [table], None, None, 0)


def count_launches(config: LedgerConfig | None = None) -> pd.DataFrame:
    """One row per (step, layer, kind) with its launches: ``layer`` -1 is outside the decoder layers (embedding,
    final norm, LM head). Kinds are ``cupy.<kernel>`` or ``aten.<op>``."""
    config = config or LedgerConfig()
    blocks_needed = config.batch * -(-config.context // config.block_size) + 1
    runner = _meta_runner(config, blocks_needed)
    rows = []
    for step, batch, tokens, context in (("prefill", _prefill_batch(config), config.prompt_len, 0),
                                         ("decode", _decode_batch(config, runner), config.batch, config.context)):
        counter = _Counter()
        layer_of = runner._layer

        def counted_layer(index, *args, counter=counter, layer_of=layer_of):
            counter.layer = index
            try:
                return layer_of(index, *args)
            finally:
                counter.layer = -1

        runner._layer = counted_layer
        rows_to_sample = torch.arange(1 if step == "prefill" else config.batch, device="meta") + (
            tokens - 1 if step == "prefill" else 0)
        with _recorded_cupy(counter), counter:
            runner.forward(batch, rows_to_sample)
        del runner._layer
        rows += [{"model": config.model, "step": step, "tokens": tokens, "context": context, "layer": layer,
                  "kind": kind, "launches": count} for (layer, kind), count in sorted(counter.counts.items())]
    return pd.DataFrame(rows, columns=LEDGER_COLUMNS)


def per_layer(ledger: pd.DataFrame) -> pd.DataFrame:
    """Launches per decoder layer (their mean; every layer launches the same) and outside them, per step."""
    layers = ledger[ledger["layer"] >= 0]
    inside = layers.groupby(["step", "layer"])["launches"].sum().groupby("step").mean()
    outside = ledger[ledger["layer"] < 0].groupby("step")["launches"].sum()
    total = ledger.groupby("step")["launches"].sum()
    return pd.DataFrame({"per_layer": inside, "outside_layers": outside, "per_step": total}).fillna(0).reset_index()


def host_time_per_step(model: str = "tiny", num_seqs: int = 64, steps: int = 30) -> dict:
    """What the host does in a decode step outside the forward, on this machine's CPU: a real engine decoding
    ``num_seqs`` sequences; per step, the step's wall time minus its forward's (median over ``steps`` steps). Then
    the same steps with the forward stubbed (it returns fixed logits): the host's work without a CPU forward
    using the cores and their caches in between, as on a GPU, where the forward does not run on the host."""
    from lab.engine.llm_engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, num_blocks=num_seqs * 8, max_num_seqs=num_seqs)
    for index in range(num_seqs):
        engine.add_request([1 + index % 500, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=2 * steps + 8,
                                                                                  ignore_eos=True))
    forward, spent = engine.runner.forward, []

    def timed(*args):
        started = time.perf_counter()
        try:
            return forward(*args)
        finally:
            spent.append(time.perf_counter() - started)

    engine.runner.forward = timed
    engine.step()  # the prefill
    outside = []
    for _ in range(steps):
        spent.clear()
        started = time.perf_counter()
        engine.step()
        outside.append(time.perf_counter() - started - sum(spent))
    logits = torch.zeros(num_seqs, engine.hf_model.config.vocab_size, dtype=engine.runner.dtype)
    engine.runner.forward = lambda batch, rows: logits
    stubbed = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        stubbed.append(time.perf_counter() - started)
    return {"model": model, "num_seqs": num_seqs, "host_ms_per_step": 1e3 * statistics.median(outside),
            "host_ms_min": 1e3 * min(outside), "host_ms_max": 1e3 * max(outside),
            "host_ms_per_step_stubbed": 1e3 * statistics.median(stubbed)}


def launch_summary(config: LedgerConfig | None = None, host_model: str = "tiny") -> pd.DataFrame:
    """One row per step: launches per decoder layer, outside the layers and per step (the ledger's sums), and for
    the decode step the host's time outside the forward (``host_time_per_step`` on this CPU with ``host_model``)."""
    config = config or LedgerConfig()
    summary = per_layer(count_launches(config))
    summary.insert(0, "model", config.model)
    summary["tokens"] = summary["step"].map({"prefill": config.prompt_len, "decode": config.batch})
    summary["context"] = summary["step"].map({"prefill": 0, "decode": config.context})
    host = host_time_per_step(host_model, config.batch)
    summary["host_ms_per_step"] = summary["step"].map({"decode": host["host_ms_per_step"]})
    summary["host_ms_per_step_stubbed"] = summary["step"].map({"decode": host["host_ms_per_step_stubbed"]})
    summary["host_model"] = host_model
    return summary

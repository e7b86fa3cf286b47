"""Decode-only steps through fixed buffers: what a CUDA graph replays.

A decode step of a small model on a GPU is bound by launching its ~250 kernels from Python, not by its bytes. nano-vllm
and vLLM capture the decode forward as CUDA graphs, one per batch-size bucket (1, 2, 4, 8, 16, 32, ...), and replay
the smallest bucket that holds the batch: the inputs live in static buffers that each step overwrites, the rows past
the batch are padding (slot -1: nothing written; length 0: attends to nothing, outputs zeros), and the LM head runs
outside the graph on the real rows only.

This module is that, on the model runner's own forward (``ModelRunner.hidden_states``). With ``graphs`` (CUDA) every
bucket is captured when the engine is made (``capture_all``, as vLLM captures at start-up: no step, and so no timed
step, ever includes a capture), into one memory pool, after an eager run of it (it compiles and loads every CuPy
kernel the graph launches); then its replay is compared with the eager forward on the same buffers, and any
difference turns the graphs off with a warning, so a GPU never gets a wrong answer from a graph. Without graphs the
same buffers run eagerly: on a CPU this is how the tests check the padded path against the plain forward.

A graph replays reads of fixed addresses, so every tensor it reads is owned by this object (``buffers``: the int64
step vectors, the int32 lengths the kernels take, the block tables, the row indices) and a capture refuses inputs
that are not views of them (``check_owned``). The runner is held by a weak reference: the runner owns this object,
and a cycle between them would keep a dropped engine's KV pool alive until a garbage collection.
"""
from __future__ import annotations

import gc
import inspect
import warnings
import weakref

import torch

from .model_runner import ForwardBatch, ModelInput

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# The attention kernels' partitioning is fixed when a graph is captured, for the longest context it may see: a decode
# step whose longest sequence is longer runs eagerly instead (the v2 kernel's partitions past a sequence's end return
# at once, but a fixed grid for 40,960 tokens would be 80 partitions per sequence and head in every step).
MAX_GRAPH_CONTEXT = 8192
_HAS_LIVENESS_CHECK = "check_input_liveness" in inspect.signature(torch.cuda.graph.__init__).parameters
VECTORS = ("input_ids", "positions", "slot_mapping", "seq_lens")  # rows of the static int64 buffer
PADDING = (0, 0, -1, 0)  # each row's value in a padding column


class StaticDecode:
    """Static buffers for decode steps of up to ``max_batch`` sequences of up to ``max_context`` tokens, and (with
    ``graphs``) their CUDA graphs per bucket."""

    check_liveness = False  # also torch's own check that a capture's inputs outlive it, where torch has it (tests)

    def __init__(self, runner, max_batch: int, max_context: int, graphs: bool):
        self.runner, self.max_context = weakref.proxy(runner), max_context
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        device, block_size = runner.device, runner.key_caches[0].shape[2]
        with torch.inference_mode(False):  # plain tensors: eager steps outside inference mode write them too
            self.vectors = torch.tensor([[value] * max_batch for value in PADDING], dtype=torch.long, device=device)
            self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)  # the kernels' dtype: no cast
            self.block_tables = torch.zeros((max_batch, -(-max_context // block_size)), dtype=torch.int32,
                                            device=device)
            self.rows = torch.arange(max_batch, device=device)  # the rows whose hidden states the LM head reads
        self.use_graphs = graphs and device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, its output)
        self.pool = None  # the memory pool every graph is captured into

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of its own a graph may read (the model's weights and KV caches are the runner's)."""
        return self.vectors, self.seq_lens, self.block_tables, self.rows

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of ``buffers`` or a view of one (it lives as long as this object)."""
        storage = tensor.untyped_storage().data_ptr()
        return any(storage == buffer.untyped_storage().data_ptr() for buffer in self.buffers)

    def check_owned(self, batch: ForwardBatch, rows: torch.Tensor) -> None:
        """Raise ``RuntimeError`` unless every tensor of a graph's inputs is a view of ``buffers``: a tensor made for
        a capture and dropped after it would be read by every replay after the allocator reused its memory."""
        inputs = {"rows": rows, **{name: getattr(batch, name) for name in ForwardBatch.__dataclass_fields__
                                   if isinstance(getattr(batch, name), torch.Tensor)}}
        strays = [name for name, tensor in inputs.items() if not self.owns(tensor)]
        if strays:
            raise RuntimeError(f"a CUDA graph's input(s) {', '.join(strays)} are not static buffers of the graph's owner")

    def graph_inputs(self, bucket: int, max_seq_len: int) -> tuple[ForwardBatch, torch.Tensor]:
        """The forward's inputs for ``bucket`` sequences, all views of ``buffers``: what a capture, a replay and an
        eager run of the buffers read (and what the launch ledger counts)."""
        input_ids, positions, slot_mapping, _ = self.vectors[:, :bucket]
        batch = ForwardBatch(input_ids, positions, slot_mapping, [], [], [], self.block_tables[:bucket],
                             self.seq_lens[:bucket], max_seq_len)
        return batch, self.rows[:bucket]

    def capture_all(self) -> None:
        """Capture every bucket's graph now, on padding (nothing written, zero lengths), so that no step includes a
        capture. Garbage is collected first: torch no longer does before a capture, and a collection during one
        could free another engine's graphs in the middle of it."""
        if not self.use_graphs:
            return
        gc.collect()
        for bucket in self.buckets:
            if self.use_graphs:
                self._capture(bucket)

    def takes(self, step: ModelInput) -> bool:
        """Whether ``step`` is a decode-only step these buffers hold."""
        return (not step.prefill_seq_ids and 0 < len(step.decode_seq_ids) <= self.buckets[-1]
                and step.max_seq_len <= self.max_context)

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    @torch.inference_mode()
    def run(self, step: ModelInput, kv) -> torch.Tensor:
        """The logits of the step's sequences (one row each, in order)."""
        num_seqs = len(step.decode_seq_ids)
        bucket = self.bucket(num_seqs)
        self._fill(step, kv, bucket)
        if bucket in self.graphs:
            graph, hidden = self.graphs[bucket]
            graph.replay()
        else:
            hidden = self._eager(bucket, step.max_seq_len)
        return self.runner.hf.lm_head(hidden[:num_seqs])

    def _fill(self, step: ModelInput, kv, bucket: int) -> None:
        """The step's inputs into the buffers' first ``bucket`` columns, padding after its sequences: one upload of
        the vectors with the batch's block-table rows and changed entries (``lab.worker.block_tables``), then the rows'
        gather into the static block tables."""
        num_seqs, pad = len(step.decode_seq_ids), bucket - len(step.decode_seq_ids)
        positions, tables = step.positions, self.runner.block_tables
        batch_rows, updates = tables.plan(step.decode_seq_ids, kv)
        rows = (step.input_ids, positions, kv.get_decode_slots(step.decode_seq_ids, positions),
                [position + 1 for position in positions])
        ints = self.runner._upload(torch.tensor([value for row, pad_value in zip(rows, PADDING)
                                                 for value in row + [pad_value] * pad] + batch_rows + updates,
                                                dtype=torch.long))
        self.vectors[:, :bucket].copy_(ints[:len(PADDING) * bucket].view(len(PADDING), bucket))
        self.seq_lens[:bucket].copy_(self.vectors[3, :bucket])
        tables.apply(ints[len(PADDING) * bucket + num_seqs:])
        width = -(-step.max_seq_len // self.runner.block_size)
        self.block_tables[:num_seqs, :width].copy_(tables.gather(ints[len(PADDING) * bucket:][:num_seqs], width))

    def _eager(self, bucket: int, max_seq_len: int) -> torch.Tensor:
        return self.runner.hidden_states(*self.graph_inputs(bucket, max_seq_len))

    def _capture(self, bucket: int) -> None:
        """Capture ``bucket``'s graph (into the pool all buckets share: a replay's output is read before the next
        replay), after an eager run of it (it compiles and loads every kernel the graph launches); then its replay
        must equal the eager forward on the same buffers, bit for bit."""
        self._eager(bucket, self.max_context)
        torch.cuda.synchronize()
        graph, (batch, rows) = torch.cuda.CUDAGraph(), self.graph_inputs(bucket, self.max_context)
        self.check_owned(batch, rows)
        liveness = {"check_input_liveness": True} if self.check_liveness and _HAS_LIVENESS_CHECK else {}
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local", **liveness):
            hidden = self.runner.hidden_states(batch, rows)
        self.pool = self.pool or graph.pool()
        self.graphs[bucket] = (graph, hidden)
        graph.replay()
        replayed = hidden.clone()
        eager = self._eager(bucket, self.max_context)
        if not torch.equal(replayed, eager):
            difference = (replayed.float() - eager.float()).abs().max().item()
            warnings.warn(f"CUDA graphs disabled: the replay of the {bucket}-sequence graph differed from the eager "
                          f"forward (max |difference| {difference:.3g}); decode steps run eagerly", RuntimeWarning,
                          stacklevel=3)
            self.graphs.clear()
            self.use_graphs = False

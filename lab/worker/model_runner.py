"""The model runner: a Qwen3's weights (HF transformers) run by our own varlen forward over the paged KV cache.

Prefill writes K/V into the cache through ``slot_mapping`` (``paged_kernels.write_kv_cache``); decode tokens attend
with ``paged_kernels.paged_attention_decode``; prefill tokens attend over the pool in place on a CPU
(``paged_attention_prefill``), else with torch SDPA over their own K/V, plus the cached prefix gathered from the paged
cache when the prefix cache served part of the prompt. The runner sees a step as a
``ModelInput`` (host lists built from the scheduler's plan) and the pool through ``KVView``'s reads: it knows
nothing of how blocks are managed.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

import paged_kernels
from paged_kernels.torch_backend import dequantize, gather_kv, paged_attention_prefill, quantize, synchronize

from .block_tables import DeviceBlockTables
from lab.models.qwen3 import head_dim_of

# A chunk of at least this many new tokens after a longer cached prefix attends on a CPU in two flash passes
# (prefix, then causal over itself, merged by log-sum-exp) instead of under an explicit mask, which makes SDPA
# compute every pair; below it the two cost the same (docs/digital_twin.md).
SPLIT_ATTENTION_MIN_TOKENS = 256
# torch's CPU flash attention with its log-sum-exp (a private op: where a torch lacks it, the mask serves)
_FLASH_ATTENTION_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class KVView(Protocol):
    """What the runner reads of the block pool (``lab.kv_cache.block_manager.KVBlockManager`` is one)."""

    def get_block_table(self, seq_id) -> list[int]: ...

    def block_table_view(self, seq_id): ...  # the table itself, not a copy (lab.worker.block_tables)

    def get_slot_mapping(self, seq_id, start: int, end: int) -> list[int]: ...

    def get_decode_slots(self, seq_ids: list, positions: list[int]) -> list[int]: ...


@dataclass(slots=True)
class ModelInput:
    """A step's work on the host, in batch order: each prompt chunk's tokens, then one token per decode sequence."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prefill_spans: list[tuple] = field(default_factory=list)  # (seq_id, start, end): the cache slots each chunk writes
    prefill_seq_ids: list = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)  # new tokens of each chunk
    prefill_cached: list[int] = field(default_factory=list)  # tokens before each chunk, already in the cache
    decode_seq_ids: list = field(default_factory=list)
    max_seq_len: int = 0  # the longest decode sequence, its new token included (kernels need not read it back)
    logit_rows: list[int] = field(default_factory=list)  # the rows whose logits are sampled
    samplers: list[list] = field(default_factory=list)  # per logit row, the sequences that sample from it

    @classmethod
    def from_plan(cls, plan, kv_len) -> "ModelInput":
        """Read a ``SchedulerOutput``: its chunks' tokens (``chunk.seq.data.token_ids``) and each decode sequence's
        last token (``seq.data.output[-1]``) at ``kv_len(seq) - 1``. A chunk whose ``samples`` is not empty
        samples from its last row (a group's forks share their prompt's last row)."""
        step = cls()
        for chunk in plan.prefill_chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            step.input_ids += seq.data.token_ids[start:end]
            step.positions += range(start, end)
            step.prefill_spans.append((seq.seq_id, start, end))
            step.prefill_seq_ids.append(seq.seq_id)
            step.prefill_lens.append(chunk.num_tokens)
            step.prefill_cached.append(start)
            if chunk.samples:
                step.logit_rows.append(len(step.input_ids) - 1)
                step.samplers.append(chunk.samples)
        seqs = plan.decode_seqs
        if seqs:  # one token each: whole lists at once (64 sequences a step on the hot path)
            first = len(step.input_ids)
            positions = [kv_len(seq) - 1 for seq in seqs]
            step.logit_rows += range(first, first + len(seqs))
            step.samplers += [[seq] for seq in seqs]
            step.input_ids += [seq.data.output[-1] for seq in seqs]
            step.positions += positions
            step.decode_seq_ids = [seq.seq_id for seq in seqs]
            step.max_seq_len = max(positions) + 1
        return step


@dataclass(slots=True)
class ForwardBatch:
    """A flat batch: prefill sequences first (each a run of tokens), then one token per decode sequence.

    ``prefill_lens``/``prefill_cached`` give each prefill sequence's new-token count and how many tokens before them
    are already in the cache (prefix hits); ``prefill_block_tables`` their block tables (a row each, padded),
    ``prefill_start_loc`` where each one's rows start (and the end), ``prefill_context_lens`` ``prefill_cached`` as a
    tensor. ``block_tables``/``seq_lens``
    describe the decode sequences (``seq_lens`` includes the token being decoded; ``max_seq_len`` is their longest,
    known on the host so that the decode kernels need not read it back from the device every layer).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefill_lens: list[int]
    prefill_cached: list[int]
    prefill_block_tables: torch.Tensor | list
    block_tables: torch.Tensor | None
    seq_lens: torch.Tensor | None
    max_seq_len: int = 0
    prefill_start_loc: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None


class ModelRunner:
    """The paged KV cache (one key and one value tensor ``[num_blocks, num_kv_heads, block_size, head_dim]`` per
    layer, and the host pool swapped sequences go to) and the forward pass over it, using an HF
    ``Qwen3ForCausalLM``'s modules as weights. A step: ``execute_copies`` (the plan's swaps and copy-on-write), then
    ``run`` (``prepare`` the tensors of a ``ModelInput``, ``forward``)."""

    def __init__(self, hf_model, num_blocks: int, block_size: int, attention_backend: str = "auto",
                 num_host_blocks: int = 0, kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False):
        config = hf_model.config
        self.hf = hf_model
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        # auto may pick cupy for the cache ops but torch for attention (e.g. the tiny preset's head_dim 32).
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = paged_kernels.fp8.is_fp8(kv_cache_dtype)
        self.attention_backend = self.resolve_attention_backend(hf_model, attention_backend, kv_cache_dtype)
        self.cache_backend = "torch" if attention_backend == "reference" or self.quantized else \
            paged_kernels.resolve_backend(attention_backend, probe)
        # FP8 caches hold the codes as bytes (vLLM's uint8 storage); their per-layer scales: 1.0 until calibrated
        cache_dtype = torch.uint8 if self.quantized else self.dtype
        self.k_scales, self.v_scales = [1.0] * self.num_layers, [1.0] * self.num_layers
        self.calculate_kv_scales = calculate_kv_scales and self.quantized  # pending until the first prefill
        shape = (num_blocks, self.num_kv_heads, block_size, self.head_dim)
        self.key_caches = [torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(self.num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=cache_dtype, device=self.device)
                             for _ in range(self.num_layers)]
        # The host pool (pinned on CUDA, so device<->host copies are asynchronous): swapped-out sequences' blocks
        # and the offload tier's slots (lab.kv_cache.offload), one budget; FP8 blocks travel as their bytes.
        host = dict(dtype=cache_dtype, pin_memory=self.device.type == "cuda")
        host_shape, host_layers = (num_host_blocks, *shape[1:]), self.num_layers if num_host_blocks else 0
        self.cpu_key_caches = [torch.zeros(host_shape, **host) for _ in range(host_layers)]
        self.cpu_value_caches = [torch.zeros(host_shape, **host) for _ in range(host_layers)]
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.layers = [merged_weights(layer) for layer in hf_model.model.layers]
        self.packed = self._pack_cpu_gemms()
        self.cos_sin_cache = rotary_table(hf_model, config.max_position_embeddings)
        self.static_decode = None  # a lab.worker.static_decode.StaticDecode: decode steps through fixed buffers
        self.block_size = block_size
        self.block_tables = DeviceBlockTables(self.device)  # decode block tables, updated incrementally

    @staticmethod
    def resolve_attention_backend(hf_model, attention_backend: str, kv_cache_dtype: str = "auto") -> str:
        """The backend ``attention_backend`` (``auto`` included) runs this model's decode attention with, on the
        model's device and dtype, over caches of ``kv_cache_dtype``. FP8 caches: ``auto`` means the torch backend
        here, although the kernels' own ``auto`` would pick the CuPy FP8 kernels on a GPU: those have not run on a
        GPU yet, and CUDA graphs (which come with the CuPy backend) would capture the scales before
        ``calculate_kv_scales`` sets them (docs/fp8.md)."""
        config, parameter = hf_model.config, next(hf_model.parameters())
        head_dim = head_dim_of(config)
        probe = torch.empty(0, device=parameter.device, dtype=parameter.dtype)
        quantized = paged_kernels.fp8.is_fp8(kv_cache_dtype)
        caches = (torch.empty(0, device=parameter.device, dtype=torch.uint8),) if quantized else ()
        if quantized and attention_backend == "auto":
            attention_backend = "torch"
        return paged_kernels.resolve_backend(attention_backend, probe, head_dim,
                                             config.num_attention_heads // config.num_key_value_heads, caches)

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one block's K and V over every layer: the model's dtype's elements, or one byte each (FP8)."""
        head_dim = head_dim_of(config)
        # one byte for FP8 (lab.kv_cache.precision.kv_element_bytes, which this room does not import)
        element = 1 if paged_kernels.fp8.is_fp8(kv_cache_dtype) else torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * head_dim * element

    def precision(self, layer: int) -> dict:
        """The keyword arguments of a ``paged_kernels`` call on layer ``layer``'s caches (none for ``auto``)."""
        if not self.quantized:
            return {}
        return dict(kv_cache_dtype=self.kv_cache_dtype, k_scale=self.k_scales[layer], v_scale=self.v_scales[layer])

    def calibrate_kv_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s ``k_scale`` / ``v_scale`` from the K/V of the first prefill, as vLLM's
        ``calculate_kv_scales`` did (``Attention.calc_kv_scales`` in vllm/attention/layer.py up to v0.10:
        ``amax(|K|) / K_SCALE_CONSTANT``, ``amax(|V|) / V_SCALE_CONSTANT``, 200 and 100 in vllm/envs.py): the largest
        key lands at 200 (of e4m3's 448), the largest value at 100, leaving headroom for later tokens. An all-zero
        tensor keeps 1.0."""
        for scales, x, constant in ((self.k_scales, k, K_SCALE_CONSTANT), (self.v_scales, v, V_SCALE_CONSTANT)):
            amax = float(x.abs().max()) if x.numel() else 0.0
            if amax > 0 and math.isfinite(amax):
                scales[layer] = amax / constant

    def copy_blocks(self, block_mapping: list[tuple[int, int]]) -> None:
        """Execute copy-on-write copies in every layer."""
        if not block_mapping:
            return
        for key_cache, value_cache in zip(self.key_caches, self.value_caches):
            paged_kernels.copy_blocks(key_cache, value_cache, block_mapping, backend=self.cache_backend, check=False)

    def swap(self, block_mapping: list[tuple[int, int]], to_host: bool) -> None:
        """Move blocks between the device pool and the host pool in every layer (``(src, dst)`` pairs)."""
        if not block_mapping:
            return
        backend = "torch" if self.cache_backend == "reference" else self.cache_backend
        for key, value, cpu_key, cpu_value in zip(self.key_caches, self.value_caches, self.cpu_key_caches,
                                                  self.cpu_value_caches):
            if to_host:
                paged_kernels.swap_blocks(key, value, cpu_key, cpu_value, block_mapping, backend=backend)
            else:
                paged_kernels.swap_blocks(cpu_key, cpu_value, key, value, block_mapping, backend=backend)

    def execute_copies(self, plan) -> None:
        """A step's block movements (a ``SchedulerOutput``'s), in this order: the offload tier's stores (a reused
        block's contents leave before anything overwrites it), swap-out, swap-in, copy-on-write, the tier's loads
        (into fresh blocks, before the forward reads them). A store into a host block that a swap-in of the same
        step frees (the tier borrows free host blocks) is staged on the device and lands after the swap-in read it."""
        reading = {cpu for cpu, _ in plan.blocks_to_swap_in}
        late = [(gpu, slot) for gpu, slot in plan.blocks_to_store if slot in reading]
        self.swap([pair for pair in plan.blocks_to_store if pair[1] not in reading], to_host=True)
        staged = self._stage(late)
        self.swap(plan.blocks_to_swap_out, to_host=True)
        self.swap(plan.blocks_to_swap_in, to_host=False)
        self.copy_blocks(plan.blocks_to_copy)
        self.swap(plan.blocks_to_load, to_host=False)
        self._unstage(staged, late)

    def _stage(self, stores: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the stored device blocks, per layer (read now, before the step writes the pool)."""
        if not stores:
            return []
        index = torch.tensor([gpu for gpu, _ in stores], device=self.device)
        return [(key.index_select(0, index), value.index_select(0, index))
                for key, value in zip(self.key_caches, self.value_caches)]

    def _unstage(self, staged, stores: list[tuple[int, int]]) -> None:
        """Write ``_stage``'s copies to their host slots."""
        mapping = [(row, slot) for row, (_, slot) in enumerate(stores)]
        backend = "torch" if self.cache_backend == "reference" else self.cache_backend
        for (key, value), cpu_key, cpu_value in zip(staged, self.cpu_key_caches, self.cpu_value_caches):
            paged_kernels.swap_blocks(key, value, cpu_key, cpu_value, mapping, backend=backend)

    def synchronize(self) -> None:
        """Wait until the device has run the work queued so far (nothing to wait for on a CPU)."""
        synchronize(self.device)

    def run(self, model_input: ModelInput, kv: KVView, eager: bool = False) -> torch.Tensor | None:
        """Logits (the model's dtype) of the rows that sample (``model_input.logit_rows``), or None when there is
        nothing to run. A decode-only step goes through the static decode buffers (a CUDA graph's replay) when they
        are on and ``eager`` is False."""
        if self.static_decode is not None and not eager and self.static_decode.takes(model_input):
            return self.static_decode.run(model_input, kv)
        batch, rows = self.prepare(model_input, kv)
        return self.forward(batch, rows) if batch is not None else None

    def prepare(self, model_input: ModelInput, kv: KVView) -> tuple[ForwardBatch | None, torch.Tensor]:
        """The device tensors of a step: prompt chunks first, then one token per decode sequence; ``kv`` gives the
        block tables and slots. The step's integers (ids, positions, slots, decode lengths, sampled rows) are built
        on the host as one tensor and uploaded once (pinned and asynchronous on CUDA). Returns the batch (None when
        there is nothing to run) and the rows whose logits are sampled."""
        step = model_input
        if not step.input_ids:
            return None, torch.empty(0, dtype=torch.long)
        num_tokens, num_decode = len(step.input_ids), len(step.decode_seq_ids)
        spans = step.prefill_spans
        slots = kv.get_slot_mapping(*spans[0]) if len(spans) == 1 else \
            [slot for span in spans for slot in kv.get_slot_mapping(*span)]
        batch_rows, updates = self.block_tables.plan(step.decode_seq_ids, kv) if num_decode else ([], [])
        if num_decode:
            slots += kv.get_decode_slots(step.decode_seq_ids, step.positions[num_tokens - num_decode:])
        seq_lens = [position + 1 for position in step.positions[num_tokens - num_decode:]]
        ints = self._upload(torch.tensor(step.input_ids + step.positions + slots + seq_lens + batch_rows + updates
                                         + step.logit_rows, dtype=torch.long))
        starts = [0, num_tokens, 2 * num_tokens, 3 * num_tokens, 3 * num_tokens + num_decode,
                  3 * num_tokens + 2 * num_decode, 3 * num_tokens + 2 * num_decode + len(updates)]
        block_tables = None
        if num_decode:
            self.block_tables.apply(ints[starts[5]:starts[6]])
            block_tables = self.block_tables.gather(ints[starts[4]:starts[5]], -(-step.max_seq_len // self.block_size))
        batch = ForwardBatch(ints[:starts[1]], ints[starts[1]:starts[2]], ints[starts[2]:starts[3]],
                             step.prefill_lens, step.prefill_cached, [], block_tables,
                             ints[starts[3]:starts[4]] if num_decode else None, step.max_seq_len)
        if step.prefill_seq_ids:
            self._prefill_tables(batch, step, kv)
        return batch, ints[starts[6]:]

    def _prefill_tables(self, batch: ForwardBatch, step: ModelInput, kv: KVView) -> None:
        """The prompt chunks' block tables (a row each, padded with block 0) and, on a CPU (what its in-place prefill
        attention reads), their row starts and cached lengths."""
        tables = [kv.get_block_table(seq_id) for seq_id in step.prefill_seq_ids]
        width = max(map(len, tables))
        rows = [table + [0] * (width - len(table)) for table in tables]
        batch.prefill_block_tables = torch.tensor(rows, dtype=torch.long).to(self.device)
        if self.device.type == "cpu":
            batch.prefill_start_loc = torch.tensor([0, *itertools.accumulate(step.prefill_lens)], dtype=torch.long)
            batch.prefill_context_lens = torch.tensor(step.prefill_cached, dtype=torch.long)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the runner's device: as is on a CPU; on CUDA from pinned memory, without waiting."""
        if self.device.type == "cpu":
            return host
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the model over the flat batch; return the logits (the model's dtype) of the rows ``logit_rows``."""
        head = self.hf.lm_head
        return self.linear(self.hidden_states(batch, logit_rows), head.weight, head.bias)

    def _pack_cpu_gemms(self) -> dict:
        """On a CPU, each GEMM's weight (the layers' and the LM head's) also in oneDNN's blocked layout, by the id of
        the matrix it copies: vLLM's CPU build multiplies by such weights (its ``onednn_mm``), 2-6 times faster than
        the row-major matrices for a decode step's few rows (``python -m lab bench vllm --profile``). The matrices
        stay (the HF model's parameters view them): this holds the weights twice. Empty elsewhere."""
        mkldnn = getattr(torch.ops, "mkldnn", None)
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16) or \
                not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_linear_pointwise"):
            return {}
        weights = [w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        weights.append(self.hf.lm_head.weight)
        with torch.inference_mode():  # the matrix itself is kept beside its copy, so its id stays its own
            return {id(w): (w, mkldnn._reorder_linear_weight(w.detach(), 16)) for w in weights}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``, by the weight's packed copy where there is one (``_pack_cpu_gemms``)."""
        packed = self.packed.get(id(weight))
        if packed is None or x.dim() != 2:
            return torch.nn.functional.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed[1], bias, "none", [], "")

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """The decoder's output (after the final norm) at the rows ``logit_rows``: what the LM head reads. A CUDA
        graph captures this; the LM head runs outside it."""
        model = self.hf.model
        hidden, residual = model.embed_tokens(batch.input_ids), None
        for index, layer in enumerate(self.layers):
            hidden, residual = self._layer(index, layer, hidden, residual, batch)
        return paged_kernels.rms_norm(hidden[logit_rows], model.norm.weight, self.eps, residual[logit_rows],
                                backend=self.cache_backend)[0]

    def _layer(self, index: int, layer: "LayerWeights", hidden, residual, batch: ForwardBatch):
        """One decoder layer: norm (with the residual add), one qkv GEMM, q/k norm + rotary + cache write in one
        op, attention, o projection, norm, one gate-up GEMM, SiLU-and-multiply, down projection. Returns the MLP's
        output and the residual stream (the next norm adds them)."""
        backend, tokens = self.cache_backend, hidden.shape[0]
        normed, residual = paged_kernels.rms_norm(hidden, layer.input_norm, self.eps, residual, backend=backend)
        qkv = self.linear(normed, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split(layer.qkv_sizes, dim=-1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = paged_kernels.qk_norm_rope_write(
            q.view(tokens, self.num_q_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim),
            v, layer.q_norm, layer.k_norm, self.cos_sin_cache,
            batch.positions, self.key_caches[index], self.value_caches[index], batch.slot_mapping, self.eps,
            backend=backend, check=False, **self.precision(index))
        if self.calculate_kv_scales and batch.prefill_lens:
            # the scales come from this first prefill's rotated keys and values, which are rewritten with them
            self.calibrate_kv_scales(index, k, v)
            paged_kernels.write_kv_cache(k, v, self.key_caches[index], self.value_caches[index], batch.slot_mapping,
                                         backend=backend, check=False, **self.precision(index))
            if index == self.num_layers - 1:
                self.calculate_kv_scales = False
        attn = self._attention(index, q, k, v, batch)
        hidden = self.linear(attn.reshape(tokens, -1), layer.o_proj)
        normed, residual = paged_kernels.rms_norm(hidden, layer.post_norm, self.eps, residual, backend=backend)
        gate_up = self.linear(normed, layer.gate_up)
        return self.linear(paged_kernels.silu_and_mul(gate_up, backend=backend), layer.down), residual

    def _attention(self, layer: int, q, k, v, batch: ForwardBatch) -> torch.Tensor:
        """Prompt chunks (their keys and values already in the pool) attend first, then the decode rows."""
        out = torch.empty_like(q)
        start = sum(batch.prefill_lens)
        if start and not paged_attention_prefill(
                q[:start], self.key_caches[layer], self.value_caches[layer], batch.prefill_block_tables,
                batch.prefill_start_loc, batch.prefill_context_lens, self.scale, out[:start],
                **self.precision(layer)):
            start = 0
            for length, cached, table in zip(batch.prefill_lens, batch.prefill_cached, batch.prefill_block_tables):
                end = start + length
                out[start:end] = self._prefill_attention(layer, q[start:end], k[start:end], v[start:end], cached,
                                                         table)
                start = end
        if batch.block_tables is not None:
            paged_kernels.paged_attention_decode(q[start:], self.key_caches[layer], self.value_caches[layer],
                                           batch.block_tables, batch.seq_lens, self.scale,
                                           backend=self.attention_backend, check=False, out=out[start:],
                                           max_seq_len=batch.max_seq_len,  # written in place: no copy per layer
                                           **self.precision(layer))
        return out

    def _prefill_attention(self, layer: int, q, k, v, cached: int, block_table) -> torch.Tensor:
        """Causal attention of a prompt's new tokens over its cached prefix (gathered from the paged cache) and
        themselves. A prefix shorter than the new tokens gets zero queries in its rows and the whole square runs as
        one causal attention, those rows' outputs dropped: the causal kernels skip the masked half, while an explicit
        mask makes SDPA compute and mask every pair (on a CPU, tiny model's shapes, 512 cached + 6,800 new tokens:
        227 ms a layer masked, 85 padded, so a Mooncake prompt's cache hit made its prefill twice as slow). A longer
        prefix keeps the mask, as padding would cost more than it saves (4,000 + 128: 2.0 ms masked, 29 padded), or on
        a CPU, for a chunk of ``SPLIT_ATTENTION_MIN_TOKENS`` or more, runs in two flash passes
        (``_split_prefill_attention``)."""
        length = q.shape[0]
        mask = None
        if self.quantized and not cached:  # attend over what the cache holds: the FP8 round trip of k and v
            k, v = (self._dequantized(quantize(x, scale, self.kv_cache_dtype), scale).to(q.dtype)
                    for x, scale in ((k, self.k_scales[layer]), (v, self.v_scales[layer])))
        if cached:
            num_blocks = -(-(cached + length) // self.key_caches[layer].shape[2])
            table = block_table[None, :num_blocks]
            k = gather_kv(self.key_caches[layer], table, num_blocks)[0, :, : cached + length].transpose(0, 1)
            v = gather_kv(self.value_caches[layer], table, num_blocks)[0, :, : cached + length].transpose(0, 1)
            if self.quantized:
                k = self._dequantized(k, self.k_scales[layer]).to(q.dtype)
                v = self._dequantized(v, self.v_scales[layer]).to(q.dtype)
            if cached < length:
                q = torch.cat([q.new_zeros(cached, *q.shape[1:]), q])
            elif length >= SPLIT_ATTENTION_MIN_TOKENS and q.device.type == "cpu" and _FLASH_ATTENTION_CPU is not None:
                return self._split_prefill_attention(q, k, v, cached)
            else:
                rows = torch.arange(length, device=q.device)[:, None] + cached
                mask = torch.arange(cached + length, device=q.device)[None, :] <= rows
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)[-length:]

    def _dequantized(self, codes: torch.Tensor, scale: float) -> torch.Tensor:
        return dequantize(codes, scale, self.kv_cache_dtype)

    def _split_prefill_attention(self, q, k, v, cached: int) -> torch.Tensor:
        """``_prefill_attention`` for a long chunk after a longer cached prefix, on a CPU: flash attention over the
        prefix (every pair visible) and causal flash attention over the chunk itself, merged by their log-sum-exps
        (see ``SPLIT_ATTENTION_MIN_TOKENS``). ``q``: ``[new, heads, head_dim]``; ``k``, ``v``: ``[cached + new,
        kv_heads, head_dim]``."""
        group = q.shape[1] // k.shape[1]
        query = q.transpose(0, 1)[None]
        key, value = (x.transpose(0, 1).repeat_interleave(group, dim=0)[None] for x in (k, v))
        prefix_out, prefix_lse = _FLASH_ATTENTION_CPU(query, key[:, :, :cached], value[:, :, :cached],
                                                      scale=self.scale)
        own_out, own_lse = _FLASH_ATTENTION_CPU(query, key[:, :, cached:], value[:, :, cached:], is_causal=True,
                                                scale=self.scale)
        lse = torch.logaddexp(prefix_lse, own_lse)
        out = (prefix_out.float() * (prefix_lse - lse).exp()[..., None]
               + own_out.float() * (own_lse - lse).exp()[..., None])
        return out.to(q.dtype)[0].transpose(0, 1)


# calculate_kv_scales: the first prefill's amax(|K|) maps to 200 and amax(|V|) to 100 in FP8 units, vLLM's
# K_SCALE_CONSTANT and V_SCALE_CONSTANT (vllm/envs.py, v0.6 to v0.10, read by Attention.calc_kv_scales)
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's weights as the runner's forward reads them: q, k and v projections merged into one matrix
    and gate and up into another (one GEMM each, as nano-vllm and vLLM load them); the HF modules' parameters become
    views into the merged ones, so the weights are held once and the HF model still runs."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: tuple[int, int, int]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def merged_weights(layer) -> LayerWeights:
    """``layer``'s ``LayerWeights``, merged once per model: a runner built later on the same model (a profile's
    engines, a benchmark's) finds the merged matrices its parameters already view."""
    attn, mlp = layer.self_attn, layer.mlp
    known = getattr(layer, "_minipaged_weights", None)
    if known is not None and attn.q_proj.weight.data_ptr() == known.qkv.data_ptr() and \
            mlp.gate_proj.weight.data_ptr() == known.gate_up.data_ptr():
        return known
    projections, gated = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
    qkv = _merge([p.weight for p in projections])
    biases = [p.bias for p in projections]
    qkv_bias = _merge(biases) if all(b is not None for b in biases) else None
    weights = LayerWeights(layer.input_layernorm.weight, qkv, qkv_bias,
                           tuple(p.weight.shape[0] for p in projections), attn.q_norm.weight, attn.k_norm.weight,
                           attn.o_proj.weight, layer.post_attention_layernorm.weight,
                           _merge([p.weight for p in gated]), mlp.down_proj.weight)
    layer._minipaged_weights = weights
    return weights


def _merge(parameters) -> torch.Tensor:
    """The parameters stacked along their first axis; each parameter then views its rows of the result."""
    merged = torch.cat([p.data for p in parameters])
    start = 0
    for p in parameters:
        p.data = merged[start:start + p.shape[0]]
        start += p.shape[0]
    return merged


def rotary_table(hf_model, max_position: int) -> torch.Tensor:
    """``[max_position, 2 * head_dim]``: the model's own rotary cos, then sin, for every position (computed by its
    rotary module, so a row equals what it returns for that position)."""
    rotary, parameter = hf_model.model.rotary_emb, next(hf_model.parameters())
    positions = torch.arange(max_position, device=parameter.device)[None]
    with torch.inference_mode():
        cos, sin = rotary(torch.empty(0, device=parameter.device, dtype=parameter.dtype), positions)
    return torch.cat([cos[0], sin[0]], dim=-1)

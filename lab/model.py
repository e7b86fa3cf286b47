"""Qwen3 weights (HF transformers) run by our own varlen forward over a paged KV cache.

Prefill writes K/V into the cache through ``slot_mapping`` (``kernels.write_kv_cache``); decode tokens attend with
``kernels.paged_attention_decode``; prefill tokens attend with torch SDPA over their own K/V, plus the cached prefix
gathered from the paged cache when the prefix cache served part of the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from kernels.torch_backend import gather_kv, synchronize

from .errors import InputError, LabError

# A chunk of at least this many new tokens after a longer cached prefix (chunked prefill) attends on a CPU in two
# flash passes, one over the prefix and one causal over itself, merged by their log-sum-exps, instead of under one
# explicit mask (which makes SDPA compute and mask every pair): tiny model's shapes, 4,000 cached + 1,024 new tokens
# took 15.0 ms a layer against 19.4 masked, 6,000 + 1,024 21.4 against 27.2; at 4,000 + 128 the two are even.
SPLIT_ATTENTION_MIN_TOKENS = 256
# torch's CPU flash attention with its log-sum-exp (a private op: where a torch lacks it, the mask serves)
_FLASH_ATTENTION_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

PRESETS = {
    # name: (layers, hidden, q heads, kv heads, head_dim, intermediate, vocab, tied)
    "tiny": (4, 128, 4, 2, 32, 256, 1024, True),
    "tiny-hd64": (2, 256, 4, 2, 64, 512, 1024, True),  # the smallest shape the CuPy attention kernel takes
    "qwen3-0.6b-random": (28, 1024, 16, 8, 128, 3072, 151936, True),
    "qwen3-0.6b-random-4l": (4, 1024, 16, 8, 128, 3072, 151936, True),  # its shapes, 4 of 28 layers (CPU benches)
    "qwen3-1.7b-random": (28, 2048, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b-random": (36, 2560, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b-random": (36, 4096, 32, 8, 128, 12288, 151936, False),
}


class CheckpointError(LabError):
    """A local checkpoint is missing, incomplete or not a Qwen3 model."""


def preset_config(name: str):
    """A ``Qwen3Config`` for a preset name."""
    from transformers import Qwen3Config

    if name not in PRESETS:
        raise InputError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} (or a local directory)")
    layers, hidden, heads, kv_heads, head_dim, inter, vocab, tied = PRESETS[name]
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=40960, rope_theta=1e6, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 1e6},
                       tie_word_embeddings=tied, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                       initializer_range=0.02 if not name.startswith("tiny") else 0.25)


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """``(hf_model, tokenizer_or_None)`` from a preset name (random weights, seeded) or a local checkpoint directory.
    Nothing is downloaded."""
    from transformers import Qwen3ForCausalLM

    if model in PRESETS:
        torch.manual_seed(seed)
        with torch.device(device):
            hf = Qwen3ForCausalLM(preset_config(model)).to(dtype)
        return hf.eval(), None
    path = Path(model)
    if not path.is_dir():
        raise CheckpointError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory")
    _check_checkpoint(path)
    try:
        hf = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
    except Exception as exc:  # corrupt or truncated weights surface as many library-specific types
        raise CheckpointError(f"{path}: the weights could not be loaded ({type(exc).__name__}: {exc})") from exc
    try:
        tokenizer = _load_tokenizer(path)
    except Exception as exc:
        raise CheckpointError(f"{path}: the tokenizer could not be loaded ({type(exc).__name__}: {exc})") from exc
    return hf.eval(), tokenizer


def _check_checkpoint(path: Path) -> None:
    import json

    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face Qwen3 checkpoint directory)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    if config.get("model_type") != "qwen3":
        raise CheckpointError(f"{config_file}: model_type is {config.get('model_type')!r}, expected 'qwen3'")
    if not list(path.glob("*.safetensors")) and not list(path.glob("*.bin")):
        raise CheckpointError(f"{path}: no weights (*.safetensors or *.bin)")


def _load_tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@dataclass(slots=True)
class ForwardBatch:
    """A flat batch: prefill sequences first (each a run of tokens), then one token per decode sequence.

    ``prefill_lens``/``prefill_cached`` give each prefill sequence's new-token count and how many tokens before them
    are already in the cache (prefix hits); ``prefill_block_tables`` their block tables. ``block_tables``/``seq_lens``
    describe the decode sequences (``seq_lens`` includes the token being decoded; ``max_seq_len`` is their longest,
    known on the host so that the decode kernels need not read it back from the device every layer).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefill_lens: list[int]
    prefill_cached: list[int]
    prefill_block_tables: list[torch.Tensor]
    block_tables: torch.Tensor | None
    seq_lens: torch.Tensor | None
    max_seq_len: int = 0


def head_dim_of(config) -> int:
    """A Qwen3 config's attention head size (``head_dim``, else hidden size / query heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class PagedQwen3:
    """The paged KV cache (one key and one value tensor ``[num_blocks, num_kv_heads, block_size, head_dim]`` per
    layer) and the forward pass over it, using an HF ``Qwen3ForCausalLM``'s modules as weights."""

    def __init__(self, hf_model, num_blocks: int, block_size: int, attention_backend: str = "auto",
                 num_cpu_blocks: int = 0):
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
        self.attention_backend = self.resolve_attention_backend(hf_model, attention_backend)
        self.cache_backend = "torch" if attention_backend == "reference" else kernels.resolve_backend(
            attention_backend, probe)
        shape = (num_blocks, self.num_kv_heads, block_size, self.head_dim)
        self.key_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        # The host pool for swap preemption (pinned on CUDA, so device<->host copies are asynchronous).
        host = dict(dtype=self.dtype, pin_memory=self.device.type == "cuda")
        cpu_shape, host_layers = (num_cpu_blocks, *shape[1:]), self.num_layers if num_cpu_blocks else 0
        self.cpu_key_caches = [torch.zeros(cpu_shape, **host) for _ in range(host_layers)]
        self.cpu_value_caches = [torch.zeros(cpu_shape, **host) for _ in range(host_layers)]
        self.scale = self.head_dim ** -0.5

    @staticmethod
    def resolve_attention_backend(hf_model, attention_backend: str) -> str:
        """The backend ``attention_backend`` (``auto`` included) runs this model's decode attention with, on the
        model's device and dtype."""
        config, parameter = hf_model.config, next(hf_model.parameters())
        head_dim = head_dim_of(config)
        probe = torch.empty(0, device=parameter.device, dtype=parameter.dtype)
        return kernels.resolve_backend(attention_backend, probe, head_dim,
                                       config.num_attention_heads // config.num_key_value_heads)

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        head_dim = head_dim_of(config)
        element = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * head_dim * element

    def copy_blocks(self, block_mapping: list[tuple[int, int]]) -> None:
        """Execute copy-on-write copies in every layer."""
        if not block_mapping:
            return
        for key_cache, value_cache in zip(self.key_caches, self.value_caches):
            kernels.copy_blocks(key_cache, value_cache, block_mapping, backend=self.cache_backend, check=False)

    def swap(self, block_mapping: list[tuple[int, int]], to_host: bool) -> None:
        """Move blocks between the device and host pools in every layer (``(src, dst)`` pairs)."""
        if not block_mapping:
            return
        backend = "torch" if self.cache_backend == "reference" else self.cache_backend
        pairs = zip(self.key_caches, self.value_caches, self.cpu_key_caches, self.cpu_value_caches)
        for key, value, cpu_key, cpu_value in pairs:
            if to_host:
                kernels.swap_blocks(key, value, cpu_key, cpu_value, block_mapping, backend=backend)
            else:
                kernels.swap_blocks(cpu_key, cpu_value, key, value, block_mapping, backend=backend)

    def execute_copies(self, swap_out, swap_in, copies) -> None:
        """A step's block movements, in the order the scheduler defines: swap-out, swap-in, copy-on-write."""
        self.swap(swap_out, to_host=True)
        self.swap(swap_in, to_host=False)
        self.copy_blocks(copies)

    def synchronize(self) -> None:
        """Wait until the device has run the work queued so far (nothing to wait for on a CPU)."""
        synchronize(self.device)

    def prepare(self, out, block_manager, kv_len) -> tuple[ForwardBatch | None, torch.Tensor, list[list]]:
        """Tensors for a scheduler step: prompt chunks first, then one token per decode sequence. Returns the batch
        (None when there is nothing to run), the rows whose logits are sampled, and for each such row the sequences
        that sample from it (a group's forks share their prompt's last row)."""
        input_ids, positions, spans, lens, cached, tables, rows, sampled = [], [], [], [], [], [], [], []
        for chunk in out.prefill_chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            input_ids += seq.data.token_ids[start:end]
            positions += range(start, end)
            spans.append((seq.seq_id, start, end))
            lens.append(chunk.num_tokens)
            cached.append(start)
            tables.append(torch.tensor(block_manager.get_block_table(seq.seq_id), dtype=torch.long,
                                       device=self.device))
            if chunk.samples:
                rows.append(len(input_ids) - 1)
                sampled.append(chunk.samples)
        block_tables = seq_lens = None
        max_seq_len = 0
        decode = out.decode_seqs or []
        if decode:
            first = len(input_ids)
            for seq in decode:
                position = kv_len(seq) - 1
                input_ids.append(seq.data.output[-1])
                positions.append(position)
                spans.append((seq.seq_id, position, position + 1))
                sampled.append([seq])
            rows += range(first, first + len(decode))
            seq_ids = [seq.seq_id for seq in decode]
            block_tables = block_manager.get_block_tables_tensor(seq_ids, self.device)
            seq_lens = block_manager.get_seq_lens_tensor(seq_ids, self.device)
            max_seq_len = max(positions[first:]) + 1
        if not input_ids:
            return None, torch.empty(0, dtype=torch.long), []
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        batch = ForwardBatch(as_tensor(input_ids), as_tensor(positions),
                             block_manager.get_slot_mapping_tensor(spans, self.device), lens, cached, tables,
                             block_tables, seq_lens, max_seq_len)
        return batch, as_tensor(rows), sampled

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the model over the flat batch; return float32 logits of the rows ``logit_rows``."""
        model = self.hf.model
        hidden = model.embed_tokens(batch.input_ids)
        cos, sin = model.rotary_emb(hidden, batch.positions[None])
        for index, layer in enumerate(model.layers):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            q, k, v = self._qkv(layer.self_attn, hidden, cos[0], sin[0])
            kernels.write_kv_cache(k, v, self.key_caches[index], self.value_caches[index], batch.slot_mapping,
                                   backend=self.cache_backend, check=False)
            attn = self._attention(index, q, k, v, batch)
            hidden = residual + layer.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = model.norm(hidden[logit_rows])
        return self.hf.lm_head(hidden).float()

    def _qkv(self, attn, hidden, cos, sin):
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        tokens = hidden.shape[0]
        q = attn.q_norm(attn.q_proj(hidden).view(tokens, self.num_q_heads, self.head_dim))
        k = attn.k_norm(attn.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim))
        v = attn.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v

    def _attention(self, layer: int, q, k, v, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for length, cached, table in zip(batch.prefill_lens, batch.prefill_cached, batch.prefill_block_tables):
            end = start + length
            out[start:end] = self._prefill_attention(layer, q[start:end], k[start:end], v[start:end], cached, table)
            start = end
        if batch.block_tables is not None:
            kernels.paged_attention_decode(q[start:], self.key_caches[layer], self.value_caches[layer],
                                           batch.block_tables, batch.seq_lens, self.scale,
                                           backend=self.attention_backend, check=False, out=out[start:],
                                           max_seq_len=batch.max_seq_len)  # written in place: no copy per layer
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
        if cached:
            num_blocks = -(-(cached + length) // self.key_caches[layer].shape[2])
            table = block_table[None, :num_blocks]
            k = gather_kv(self.key_caches[layer], table, num_blocks)[0, :, : cached + length].transpose(0, 1)
            v = gather_kv(self.value_caches[layer], table, num_blocks)[0, :, : cached + length].transpose(0, 1)
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

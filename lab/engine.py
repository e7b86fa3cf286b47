"""LLMEngine: continuous batching of Qwen3 over the paged KV cache.

Each ``step()`` is a prefill step (newly admitted prompts) when a prompt can be admitted, else a decode step (one
token for every running sequence). Blocks come from ``lab.block_manager.KVBlockManager``; when a decode step needs
more blocks than are free, the newest sequences are preempted and later recomputed.
"""
from __future__ import annotations

import itertools
import resource
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch

from .block_manager import KVBlockManager
from .model import ForwardBatch, PagedQwen3, load_hf_model


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens: greedy when ``temperature == 0``; else temperature, then top-k / top-p filtering."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        checks = [("max_tokens", self.max_tokens >= 1), ("temperature", self.temperature >= 0),
                  ("top_k", self.top_k >= 0), ("top_p", 0 < self.top_p <= 1), ("n", self.n >= 1)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is out of range")


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result: one entry per sample in ``outputs`` (``token_ids``/``text`` are sample 0's)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[list[int]]
    texts: list[str] | None
    arrival_s: float
    first_token_s: float
    finish_s: float

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0]

    @property
    def text(self) -> str | None:
        return self.texts[0] if self.texts else None


@dataclass(slots=True)
class StepStats:
    """What one ``step()`` did, for live dashboards."""

    step: int
    kind: str  # "prefill" or "decode"
    num_tokens: int
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    preemptions: int
    generated_tokens: int
    elapsed_s: float
    duration_s: float
    peak_memory_bytes: int = 0


@dataclass(slots=True)
class _Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    samples: list = field(default_factory=list)
    samples_left: int = 0


class _Seq:
    """One sample being generated."""

    __slots__ = ("seq_id", "request", "sample", "output", "generator", "logits")

    def __init__(self, seq_id: int, request: _Request, sample: int, device):
        self.seq_id, self.request, self.sample, self.output = seq_id, request, sample, []
        seed = request.params.seed
        self.generator = None
        if seed is not None and request.params.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(seed + sample)
        self.logits: list[torch.Tensor] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt + self.output


class LLMEngine:
    """A small serving engine: ``generate()`` for batch use, ``add_request()``/``step()`` for incremental use.

    Args:
        model: a preset (``"tiny"``, ``"qwen3-0.6b-random"``, ...), a local Qwen3 checkpoint directory, or a loaded
            ``Qwen3ForCausalLM`` (then ``tokenizer`` may come with it).
        block_size: token slots per KV block.
        num_blocks: KV pool size; None sizes it from ``kv_memory_bytes`` (CPU) or ``gpu_memory_utilization``.
        attention_backend: ``reference``, ``torch``, ``cupy`` or ``auto`` (cupy on GPU else torch).
        enable_prefix_caching: reuse cached full prompt blocks across requests.
        on_step: called with a ``StepStats`` after every step.
    """

    def __init__(self, model="tiny", block_size: int = 16, num_blocks: int | None = None,
                 attention_backend: str = "auto", enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, dtype: torch.dtype | None = None, device: str | None = None,
                 kv_memory_bytes: int = 256 << 20, gpu_memory_utilization: float = 0.5, seed: int = 0,
                 record_logits: bool = False, on_step: Callable[[StepStats], None] | None = None, tokenizer=None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if isinstance(model, str):
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
            self.hf_model, self.tokenizer = load_hf_model(model, dtype, self.device, seed)
        else:  # an already loaded Qwen3ForCausalLM (e.g. cached by the app)
            self.hf_model, self.tokenizer = model, tokenizer
            parameter = next(model.parameters())
            self.device, dtype = parameter.device, parameter.dtype
        config = self.hf_model.config
        if num_blocks is None:
            num_blocks = self._default_num_blocks(config, block_size, dtype, kv_memory_bytes, gpu_memory_utilization)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.runner = PagedQwen3(self.hf_model, num_blocks, block_size, attention_backend)
        self.block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size, self.max_num_seqs, self.max_num_batched_tokens = block_size, max_num_seqs, max_num_batched_tokens
        self.max_model_len = getattr(config, "max_position_embeddings", 1 << 30)
        eos = getattr(config, "eos_token_id", None)
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.record_logits, self.on_step = record_logits, on_step
        self.waiting: deque[_Seq | tuple[_Request, None]] = deque()
        self.running: list[_Seq] = []
        self.requests: dict[int, _Request] = {}
        self.finished: list[RequestOutput] = []
        self.recorded_logits: dict[int, list[torch.Tensor]] = {}  # request id -> per sample [steps, vocab]
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.num_steps = self.num_preemptions = self.generated_tokens = self.peak_used_blocks = 0
        self.last_step_kind, self.last_step_tokens = "", 0
        self.last_step_elapsed_s = self.last_step_duration_s = 0.0
        self.started_s = time.perf_counter()

    def _default_num_blocks(self, config, block_size, dtype, kv_memory_bytes, gpu_memory_utilization) -> int:
        per_block = PagedQwen3.kv_bytes_per_block(config, block_size, dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            kv_memory_bytes = int(free * gpu_memory_utilization)
        return max(1, kv_memory_bytes // per_block)

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None) -> int:
        """Queue a prompt (token ids, or a string when the model has a tokenizer); returns its request id."""
        params = params or SamplingParams()
        params.check()
        prompt_ids = self._encode(prompt)
        needed = self.block_manager.blocks_for_tokens(len(prompt_ids) + params.max_tokens) + params.n - 1
        if needed > self.block_manager.num_physical_blocks:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} needs {needed} "
                             f"KV blocks; the pool has {self.block_manager.num_physical_blocks}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens = {len(prompt_ids) + params.max_tokens} exceeds the model's "
                             f"max_position_embeddings {self.max_model_len}")
        request = _Request(next(self._ids), prompt_ids, params, time.perf_counter(), samples_left=params.n)
        self.requests[request.request_id] = request
        self.waiting.append((request, None))
        return request.request_id

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; this model has none (pass token ids)")
            prompt = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.hf_model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams] |
                 None = None, progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; one ``RequestOutput`` per prompt, in order."""
        many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, many)]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            for output in self.step():
                done[output.request_id] = output
                if bar:
                    bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]

    # ---- scheduling ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One prefill or decode step; returns the requests that finished in it."""
        started = time.perf_counter()
        finished_before = len(self.finished)
        admitted = self._admit()
        if admitted:
            kind, tokens = "prefill", self._prefill(admitted)
        elif self.running:
            kind, tokens = "decode", self._decode()
        elif self.waiting:  # add_request's size check makes this unreachable; never spin silently
            request = self.waiting[0][0]
            raise RuntimeError(f"request {request.request_id} cannot be scheduled into an idle pool of "
                               f"{self.block_manager.num_free_blocks} free blocks")
        else:
            return []
        self.num_steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        now = time.perf_counter()
        self.last_step_kind, self.last_step_tokens = kind, tokens
        self.last_step_elapsed_s, self.last_step_duration_s = now - self.started_s, now - started
        if self.on_step:
            self.on_step(self.last_step_stats())
        return self.finished[finished_before:]

    def last_step_stats(self) -> StepStats:
        """What the latest step did (see ``StepStats``)."""
        manager = self.block_manager
        return StepStats(self.num_steps, self.last_step_kind, self.last_step_tokens, len(self.running),
                         len(self.waiting), manager.num_used_blocks, manager.num_free_blocks, self.num_preemptions,
                         self.generated_tokens, self.last_step_elapsed_s, self.last_step_duration_s,
                         peak_memory_bytes(self.device))

    def _admit(self) -> list[tuple[_Request, _Seq | None, list[int]]]:
        """Take waiting prompts FCFS while the sequence cap, the token budget and free blocks allow."""
        admitted, tokens = [], 0
        while self.waiting:
            request, resumed = self.waiting[0]
            ids = resumed.token_ids if resumed is not None else request.prompt
            width = 1 if resumed is not None else request.params.n
            if len(self.running) + sum(1 if r else a.params.n for a, r, _ in admitted) + width > self.max_num_seqs:
                break
            if tokens and tokens + len(ids) > self.max_num_batched_tokens:
                break
            extra = width if len(ids) % self.block_size == 0 else width - 1
            if not self.block_manager.can_allocate(ids, extra_blocks=extra):
                break
            self.waiting.popleft()
            seq = resumed or _Seq(next(self._seq_ids), request, 0, self.device)
            cached = self.block_manager.create_sequence(seq.seq_id, ids)
            admitted.append((request, seq if resumed is None else resumed, [cached, len(ids)]))
            tokens += len(ids) - cached
        return admitted

    def _prefill(self, admitted) -> int:
        rows, input_ids, positions, spans, lens, cached_list, tables = [], [], [], [], [], [], []
        for _, seq, (cached, length) in admitted:
            ids = seq.token_ids
            input_ids += ids[cached:]
            positions += range(cached, length)
            spans.append((seq.seq_id, cached, length))
            lens.append(length - cached)
            cached_list.append(cached)
            tables.append(torch.tensor(self.block_manager.get_block_table(seq.seq_id), dtype=torch.long,
                                       device=self.device))
            rows.append(len(input_ids) - 1)
        batch = ForwardBatch(self._tensor(input_ids), self._tensor(positions),
                             self.block_manager.get_slot_mapping_tensor(spans, self.device), lens, cached_list, tables,
                             None, None)
        logits = self.runner.forward(batch, self._tensor(rows))
        now = time.perf_counter()
        for (request, seq, _), row_logits in zip(admitted, logits):
            family = self._fork_samples(request, seq) if not seq.output and not request.samples else [seq]
            for member in family:
                self.running.append(member)
                self._accept(member, row_logits, now)
        return len(input_ids)

    def _fork_samples(self, request: _Request, parent: _Seq) -> list[_Seq]:
        """Parallel sampling: the other samples share the prompt's blocks (copy-on-write on their first write)."""
        family = [parent]
        for sample in range(1, request.params.n):
            child = _Seq(next(self._seq_ids), request, sample, self.device)
            self.block_manager.fork_sequence(parent.seq_id, child.seq_id)
            family.append(child)
        request.samples = family
        return family

    def _decode(self) -> int:
        self._reserve_decode_blocks()
        slots = [self.block_manager.append_token(seq.seq_id, seq.output[-1]) for seq in self.running]
        self.runner.copy_blocks(self.block_manager.take_pending_copies())
        seq_ids = [seq.seq_id for seq in self.running]
        batch = ForwardBatch(self._tensor([seq.output[-1] for seq in self.running]),
                             self._tensor([len(seq.token_ids) - 1 for seq in self.running]), self._tensor(slots),
                             [], [], [], self.block_manager.get_block_tables_tensor(seq_ids, self.device),
                             self.block_manager.get_seq_lens_tensor(seq_ids, self.device))
        logits = self.runner.forward(batch, torch.arange(len(seq_ids), device=self.device))
        now = time.perf_counter()
        for seq, row_logits in zip(list(self.running), logits):
            self._accept(seq, row_logits, now)
        return len(seq_ids)

    def _reserve_decode_blocks(self) -> None:
        """Preempt the newest sequences until every running sequence can append one token."""
        while True:
            needed = sum(self.block_manager.num_blocks_to_append(seq.seq_id) for seq in self.running)
            if needed <= self.block_manager.num_free_blocks:
                return
            victim = self.running.pop()
            self.block_manager.release_sequence(victim.seq_id)
            self.num_preemptions += 1
            self.waiting.appendleft((victim.request, victim))

    def _accept(self, seq: _Seq, logits: torch.Tensor, now: float) -> None:
        """Sample the next token of ``seq`` from its logits; finish it on EOS, a stop token or max_tokens."""
        if self.record_logits:
            seq.logits = (seq.logits or []) + [logits.detach().cpu()]
        token = self._sample(logits, seq)
        seq.output.append(token)
        self.generated_tokens += 1
        request = seq.request
        if request.first_token_s != request.first_token_s:  # NaN: first token of the request
            request.first_token_s = now
        params = request.params
        stop = (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids
        if stop or len(seq.output) >= params.max_tokens:
            self._finish(seq, now)

    def _sample(self, logits: torch.Tensor, seq: _Seq) -> int:
        params = seq.request.params
        if params.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / params.temperature
        if params.top_k:
            kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            outside = torch.cumsum(sorted_probs, 0) - sorted_probs > params.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _finish(self, seq: _Seq, now: float) -> None:
        self.running.remove(seq)
        self.block_manager.release_sequence(seq.seq_id)
        request = seq.request
        request.samples_left -= 1
        if request.samples_left:
            return
        request.finish_s = now
        samples = sorted(request.samples or [seq], key=lambda s: s.sample)
        outputs = [s.output for s in samples]
        if self.record_logits:
            self.recorded_logits[request.request_id] = [torch.stack(s.logits) for s in samples]
        texts = [self.tokenizer.decode(o) for o in outputs] if self.tokenizer is not None else None
        self.finished.append(RequestOutput(request.request_id, request.prompt, outputs, texts, request.arrival_s,
                                           request.first_token_s, request.finish_s))

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # ---- metrics ------------------------------------------------------------------------------------------------
    def request_metrics(self) -> pd.DataFrame:
        """One row per finished request: prompt/output tokens, TTFT, TPOT and end-to-end latency (seconds)."""
        rows = []
        for out in self.finished:
            generated = max(len(o) for o in out.outputs)
            rows.append({"request_id": out.request_id, "prompt_tokens": len(out.prompt_token_ids),
                         "output_tokens": sum(len(o) for o in out.outputs),
                         "ttft_s": out.first_token_s - out.arrival_s,
                         "tpot_s": (out.finish_s - out.first_token_s) / max(generated - 1, 1),
                         "e2e_s": out.finish_s - out.arrival_s})
        return pd.DataFrame(rows)

    def run_metrics(self) -> dict:
        """Totals for the run so far."""
        elapsed = time.perf_counter() - self.started_s
        stats = self.block_manager.prefix_cache_stats
        table = self.request_metrics()
        median = (lambda c: float(table[c].median())) if len(table) else (lambda c: float("nan"))
        return {"requests_finished": len(self.finished), "output_tokens": self.generated_tokens,
                "elapsed_s": elapsed, "output_tok_s": self.generated_tokens / elapsed if elapsed > 0 else 0.0,
                "ttft_median_s": median("ttft_s"), "tpot_median_s": median("tpot_s"),
                "e2e_median_s": median("e2e_s"), "steps": self.num_steps, "preemptions": self.num_preemptions,
                "peak_kv_blocks": self.peak_used_blocks, "num_kv_blocks": self.block_manager.num_physical_blocks,
                "prefix_hit_rate": stats.hit_rate, "cow_copies": self.block_manager.num_cow_copies,
                "peak_memory_bytes": peak_memory_bytes(self.device)}


def peak_memory_bytes(device: torch.device) -> int:
    """Device peak allocation on CUDA; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

"""LLMEngine: continuous batching of Qwen3 over the paged KV cache.

Each ``step()`` is schedule -> run the model -> sample -> post-process. The schedule comes from
``lab.sched.scheduler.Scheduler`` (the same one the simulator runs with a clock): prefill-first or chunked steps,
recompute or swap preemption, all calls into the block manager. ``lab.worker.model_runner.ModelRunner`` turns the plan into
tensors and runs the forward; ``lab.engine.sampler.Sampler`` picks the tokens; the engine appends them and tells the
scheduler which sequences finished.
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
import resource
import time
from collections import abc
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
import torch

import paged_kernels

from .beam import BeamRanking, BeamSearchError, BeamSearchOutput, BeamSearchParams
from lab.errors import InputError, LabError
from lab.checks import check_bool, check_choice, check_int, check_real, entry_point
from lab.hardware import check_device
from lab.kv_cache.precision import KV_CACHE_DTYPES
from lab.latency import counted_tokens, request_latencies
from lab.sched.kv_policy import PagedPolicy, default_num_cpu_blocks
from lab.models.qwen3 import load_hf_model
from lab.worker.model_runner import ModelInput, ModelRunner
from .sampler import Sampler, SamplingParams, SamplingParamsError
from lab.worker.static_decode import MAX_GRAPH_CONTEXT, StaticDecode
from lab.worker.host_memory import retain_freed_memory
from lab.worker.threads import ThreadPolicy
from lab.sched.scheduler import (Scheduler, SchedulerConfig, SchedulingSettings, Sequence, SequenceGroup, SequenceStatus,
                        StepStats)


MAX_BLOCKS = 1 << 24  # a KV pool larger than this is a typo, not a GPU


class PromptError(LabError):
    """A prompt is not a non-empty string or sequence of token ids in the vocabulary; nothing was queued."""


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result: one entry per sample in ``outputs`` (``token_ids``/``text`` are sample 0's); for a beam
    search, one per beam, best first, with the scores and block sharing in ``beams``."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[list[int]]
    texts: list[str] | None
    arrival_s: float
    first_token_s: float
    finish_s: float
    beams: BeamSearchOutput | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0]

    @property
    def text(self) -> str | None:
        return self.texts[0] if self.texts else None


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


KV_MEMORY_BYTES = 256 << 20  # a CPU engine's default KV pool without num_blocks


@entry_point
@dataclass(slots=True)
class EngineConfig(SchedulingSettings):
    """Everything an ``LLMEngine`` is built from (one place for the runtime page, the CLI and the benchmarks).

    ``num_blocks`` None sizes the KV pool from ``kv_memory_bytes`` (CPU) or ``gpu_memory_utilization`` (GPU).
    ``preemption_mode="swap"`` moves preempted sequences to a host pool of ``num_cpu_blocks`` blocks (0: as many as
    the GPU pool, at most vLLM's default swap space of 4 GiB, or ``swap_space_bytes`` when given). ``max_model_len``
    None takes the model's ``max_position_embeddings``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0
    max_model_len: int | None = None
    dtype: torch.dtype | None = None
    device: str | None = None
    kv_memory_bytes: int = KV_MEMORY_BYTES
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    record_logits: bool = False
    cuda_graphs: bool = True  # on CUDA with the CuPy attention kernel: decode-only steps replay captured graphs
    kv_offload_blocks: int = 0  # host slots of the prefix cache's offload tier (lab.kv_cache.offload; 0: none)
    cpu_threads: int | None = None  # torch threads of CPU steps; None: the cores other processes leave idle
    # KV precision, vLLM's names: "auto" stores the model's dtype; "fp8"/"fp8_e4m3"/"fp8_e5m2" one byte an element
    # with a per-layer k_scale/v_scale, 1.0 (vLLM's default without checkpoint scales) unless calculate_kv_scales
    # derives them from the first prefill (lab.worker.model_runner.ModelRunner.calibrate_kv_scales)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False

    def check(self) -> None:
        """Raise ``EngineConfigError`` or ``SchedulerError`` (both ``ValueError``) naming the first field of a wrong
        type or out of range."""
        owner, error = "EngineConfig", EngineConfigError
        for name, low, high, optional in (("block_size", 1, 1 << 16, False), ("num_blocks", 1, MAX_BLOCKS, True),
                                          ("num_cpu_blocks", 0, MAX_BLOCKS, False), ("swap_space_bytes", 0, 1 << 50, False),
                                          ("kv_offload_blocks", 0, MAX_BLOCKS, False),
                                          ("max_model_len", 1, 1 << 31, True), ("kv_memory_bytes", 1, 1 << 50, False),
                                          ("cpu_threads", 1, 1 << 12, True),
                                          ("seed", 0, 2**63 - 1, False)):
            check_int(owner, name, getattr(self, name), low, high, optional, error)
        check_real(owner, "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True, error=error)
        for name in ("enable_prefix_caching", "record_logits", "cuda_graphs", "calculate_kv_scales"):
            check_bool(owner, name, getattr(self, name), error)
        check_choice(owner, "attention_backend", self.attention_backend, ("auto", *paged_kernels.BACKENDS), error)
        check_choice(owner, "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES, error)
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise EngineConfigError("EngineConfig.calculate_kv_scales=True would be ignored: kv_cache_dtype='auto' "
                                    "stores the model's dtype, unscaled")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "cupy":
            raise EngineConfigError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r} with attention_backend="
                                    f"'cupy': the engine does not run the CuPy FP8 kernels yet (never run on a "
                                    f"GPU; CUDA graphs would capture the scales before calibration); use 'auto' or "
                                    f"'torch'")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise EngineConfigError(f"EngineConfig.dtype={self.dtype!r}: expected None or one of "
                                    f"{', '.join(map(str, DTYPES))}")
        if self.device is not None:
            try:
                check_device(self.device)
            except ValueError as exc:
                raise EngineConfigError(f"EngineConfig.device: {exc}") from None
        SchedulerConfig.of(self).check()
        if self.kv_offload_blocks and not self.enable_prefix_caching:
            raise EngineConfigError(f"EngineConfig.kv_offload_blocks={self.kv_offload_blocks} would be ignored: the "
                                    f"offload tier keeps the prefix cache's blocks, and prefix caching is off")
        if self.swap_space_bytes and (self.preemption_mode != "swap" or self.num_cpu_blocks):
            raise EngineConfigError(f"EngineConfig.swap_space_bytes={self.swap_space_bytes} would be ignored: it sizes "
                                    f"the host pool of swap preemption when num_cpu_blocks does not")
        if self.num_blocks is not None and self.kv_memory_bytes != KV_MEMORY_BYTES:
            raise EngineConfigError(f"EngineConfig.kv_memory_bytes={self.kv_memory_bytes} would be ignored: "
                                    f"num_blocks={self.num_blocks} sizes the pool")


class EngineConfigError(LabError):
    """An ``EngineConfig`` field has a wrong type or value."""


@dataclass(slots=True)
class _Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams | BeamSearchParams
    arrival_s: float
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    samples: list = field(default_factory=list)
    samples_left: int = 0
    beam: BeamRanking | None = None


class _SeqState:
    """The engine's side of one sample: what it generated, its sampler, its recorded logits."""

    __slots__ = ("request", "params", "sample", "output", "generator", "logits")

    def __init__(self, request: _Request, sample: int, device):
        self.request, self.params, self.sample, self.output = request, request.params, sample, []
        params, self.generator = self.params, None
        if isinstance(params, SamplingParams) and params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device).manual_seed((params.seed + sample) % (1 << 63))
        self.logits: list[torch.Tensor] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt + self.output


@entry_point
def load_model(model: str, config: EngineConfig):
    """``(hf_model, tokenizer_or_None)`` for a preset or checkpoint directory on ``config``'s device and dtype
    (default: CUDA in bf16 when there is one, else the CPU in fp32): what ``LLMEngine(model, config)`` loads, for
    callers that build several engines on one model."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = config.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return load_hf_model(model, dtype, device, config.seed)


@entry_point(forwards=EngineConfig)
class LLMEngine:
    """A small serving engine: ``generate()`` for batch use, ``add_request()``/``step()`` for incremental use.

    Args:
        model: a preset (``"tiny"``, ``"qwen3-0.6b-random"``, ...), a local Qwen3 checkpoint directory, or a loaded
            ``Qwen3ForCausalLM`` (then ``tokenizer`` may come with it).
        config: an ``EngineConfig``; keyword arguments override its fields (``LLMEngine("tiny", block_size=8)``).
        on_step: called with a ``StepStats`` after every step.
    """

    def __init__(self, model="tiny", config: EngineConfig | None = None, *, on_step: Callable[[StepStats], None] |
                 None = None, tokenizer=None, **overrides):
        # the keywords and the types of config and on_step are checked by entry_point
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        config.check()
        self.config = config
        if isinstance(model, (str, Path)):
            model, tokenizer = load_model(str(model), config)
        elif not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise EngineConfigError(f"model must be a preset name, a checkpoint directory or a loaded Qwen3 model; "
                                    f"got {type(model).__name__} {model!r:.60}")
        # else an already loaded Qwen3ForCausalLM (e.g. cached by the app, or shared by a profile's engines)
        self.hf_model, self.tokenizer = model, tokenizer
        parameter = next(model.parameters())
        self.device, dtype = parameter.device, parameter.dtype
        hf_config = self.hf_model.config
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = self._default_num_blocks(hf_config, config, dtype)
        if num_blocks < 1:
            raise InputError(f"num_blocks must be >= 1, got {num_blocks}")
        num_cpu_blocks = self._num_cpu_blocks(hf_config, config, dtype, num_blocks)
        self.policy = PagedPolicy(num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks,
                                  config.kv_offload_blocks)
        self.runner = ModelRunner(self.hf_model, num_blocks, config.block_size, config.attention_backend,
                                 self.policy.num_host_blocks, kv_cache_dtype=config.kv_cache_dtype,
                                 calculate_kv_scales=config.calculate_kv_scales)
        self.block_manager = self.policy.manager
        positions = getattr(hf_config, "max_position_embeddings", 1 << 30)
        if config.max_model_len is not None and config.max_model_len > positions:
            raise EngineConfigError(f"EngineConfig.max_model_len={config.max_model_len} exceeds the model's "
                                    f"max_position_embeddings ({positions}); vLLM refuses it too")
        self.max_model_len = config.max_model_len or positions
        if config.cuda_graphs and self.device.type == "cuda" and self.runner.attention_backend == "cupy":
            self.runner.static_decode = StaticDecode(self.runner, config.max_num_seqs,
                                                     min(self.max_model_len, MAX_GRAPH_CONTEXT), graphs=True)
            self.runner.static_decode.capture_all()  # now, before any step (and any clock) starts
        self.scheduler = Scheduler(SchedulerConfig.of(config, max_model_len=self.max_model_len, sync_every_step=True),
                                   self.policy)
        self.scheduler.step_rows = []
        self.block_size = config.block_size
        self.threads = ThreadPolicy(config.cpu_threads) if self.device.type == "cpu" else None
        if self.device.type == "cpu":
            retain_freed_memory()  # a step's activations reuse the last step's pages (lab/worker/host_memory.py)
        eos = getattr(hf_config, "eos_token_id", None)
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.record_logits, self.on_step = config.record_logits, on_step
        self._undelivered: list[RequestOutput] = []  # finished, not yet returned by step() (a callback raised)
        self._last_plan_ran = False
        self.requests: dict[int, _Request] = {}
        self.finished: list[RequestOutput] = []
        self.recorded_logits: dict[int, list[torch.Tensor]] = {}  # request id -> per sample [steps, vocab]
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.generated_tokens = self.peak_used_blocks = 0
        self.scheduler_s = 0.0  # time spent in the scheduler (benchmarks report its share)
        self._last_stats: StepStats | None = None
        self.sampler = Sampler()
        self._accepted: set[int] = set()  # the seeded generators whose draw this step has accepted (ids)
        self.started_s = time.perf_counter()

    def _default_num_blocks(self, hf_config, config: EngineConfig, dtype) -> int:
        per_block = ModelRunner.kv_bytes_per_block(hf_config, config.block_size, dtype, config.kv_cache_dtype)
        budget = config.kv_memory_bytes
        on_gpu = self.device.type == "cuda"
        moot = ("gpu_memory_utilization", 0.5, "it sizes a GPU's pool") if not on_gpu else \
            ("kv_memory_bytes", KV_MEMORY_BYTES, "a GPU's pool is sized by gpu_memory_utilization")
        if getattr(config, moot[0]) != moot[1]:
            raise EngineConfigError(f"EngineConfig.{moot[0]}={getattr(config, moot[0])} would be ignored on "
                                    f"{self.device}: {moot[2]}")
        if on_gpu:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * config.gpu_memory_utilization)
        if budget < per_block:
            raise EngineConfigError(f"a KV budget of {budget:,} bytes holds no block of {per_block:,} bytes")
        return budget // per_block

    @staticmethod
    def _num_cpu_blocks(hf_config, config: EngineConfig, dtype, num_blocks: int) -> int:
        if config.preemption_mode != "swap":
            return config.num_cpu_blocks
        if config.num_cpu_blocks:
            return config.num_cpu_blocks
        if config.swap_space_bytes:
            return max(1, config.swap_space_bytes // ModelRunner.kv_bytes_per_block(hf_config, config.block_size,
                                                                                    dtype, config.kv_cache_dtype))
        return default_num_cpu_blocks(num_blocks, ModelRunner.kv_bytes_per_block(hf_config, config.block_size, dtype,
                                                                                 config.kv_cache_dtype))

    # ---- compatibility views -----------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self.scheduler.num_steps

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt: abc.Sequence[int] | str, params: SamplingParams | None = None,
                    arrival_s: float | None = None) -> int:
        """Queue a prompt (token ids, or a string when the model has a tokenizer); returns its request id. Raises
        ``ValueError`` (nothing queued) for bad parameters or a request that could never be scheduled.
        ``arrival_s`` (``time.perf_counter`` clock, not in the future): when the request really arrived, if it is
        queued later (a replayed trace); latencies count from it."""
        request = self._make_request(prompt, params)
        if arrival_s is not None:
            check_real("add_request", "arrival_s", arrival_s, 0.0, request.arrival_s)
            request.arrival_s = float(arrival_s)
        self._queue(request)
        return request.request_id

    def _make_request(self, prompt, params) -> _Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise SamplingParamsError(f"params must be a SamplingParams or BeamSearchParams (or None), got "
                                      f"{params!r}")
        params.check()
        stops = getattr(params, "stop_token_ids", ())
        vocab = self.hf_model.config.vocab_size
        if stops and (min(stops) < 0 or max(stops) >= vocab):
            raise SamplingParamsError(f"SamplingParams.stop_token_ids={tuple(stops)!r:.60}: a stop token outside the "
                                      f"vocabulary [0, {vocab}) can never be sampled")
        prompt_ids = self._encode(prompt)
        if isinstance(params, BeamSearchParams):
            self.scheduler.check_request(len(prompt_ids), params.max_tokens, params.beam_width, beams=True)
            return _Request(-1, prompt_ids, params, time.perf_counter(), samples_left=1,
                            beam=BeamRanking(params, self.eos_token_ids))
        self.scheduler.check_request(len(prompt_ids), params.max_tokens, params.n)
        return _Request(-1, prompt_ids, params, time.perf_counter(), samples_left=params.n)

    def _queue(self, request: _Request) -> None:
        request.request_id = next(self._ids)
        self.requests[request.request_id] = request
        group = self._group(request)
        final_len = len(request.prompt) + request.params.max_tokens - 1
        for sample in range(num_sequences(request.params)):
            state = _SeqState(request, sample, self.device)
            group.seqs.append(Sequence(next(self._seq_ids), group, sample, len(request.prompt), final_len, state))
        request.samples = group.seqs
        self.scheduler.add(group)

    def _group(self, request: _Request) -> SequenceGroup:
        """An empty group for ``request``'s sequences, with its stop tokens."""
        return SequenceGroup(request.request_id, [], self._token_ids, request, beam=request.beam,
                             stop_token_ids=self._stop_token_ids(request.params))

    def _stop_token_ids(self, params: SamplingParams | BeamSearchParams) -> frozenset:
        """A sample's stop tokens: EOS unless ignored, and its own (a beam search ranks EOS itself: none)."""
        if not isinstance(params, SamplingParams):
            return frozenset()
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))

    @staticmethod
    def _token_ids(seq: Sequence, length: int) -> list[int]:
        return seq.data.token_ids[:length]

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("string prompts need a tokenizer; this model has none (pass token ids)")
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            prompt = prompt.tolist()
        if isinstance(prompt, (bytes, dict, set)) or not isinstance(prompt, abc.Sequence):
            raise PromptError(f"a prompt must be a string or a sequence of token ids, got {prompt!r:.80}")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in prompt):
            raise PromptError(f"prompt token ids must be integers, got {list(prompt)!r:.80}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError("prompt is empty")
        vocab = self.hf_model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts: abc.Sequence[abc.Sequence[int] | str],
                 params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; one ``RequestOutput`` per prompt, in order. Every prompt is checked before
        any is queued.

        Requests queued before with ``add_request`` run alongside (they share the steps) but are not returned here:
        ``generate`` returns only its own prompts' outputs, and stops once they are done. Another request that
        finished meanwhile is returned by the next ``step()``, one still running goes on in the next steps, as if
        ``generate`` had not been called."""
        if isinstance(prompts, (str, bytes, dict, set)) or not isinstance(prompts, abc.Sequence):
            raise PromptError(f"prompts must be a list of prompts, got {prompts!r:.80}")
        if not (params is None or isinstance(params, (SamplingParams, BeamSearchParams, list, tuple))):
            raise SamplingParamsError(f"params must be a SamplingParams or BeamSearchParams, a list of them or None, "
                                      f"got {params!r:.80}")
        many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(many) != len(prompts):
            raise InputError(f"got {len(prompts)} prompts but {len(many)} SamplingParams")
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, many)]
        for request in requests:
            self._queue(request)
        ids = [r.request_id for r in requests]
        mine, bar = set(ids), None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        done: dict[int, RequestOutput] = {}
        others: list[RequestOutput] = []  # add_request's requests that finished here: the next step() returns them
        try:
            while len(done) < len(ids) and self.has_unfinished():
                for output in self.step():
                    if output.request_id in mine:
                        done[output.request_id] = output
                        if bar:
                            bar.update(1)
                    else:
                        others.append(output)
        except BaseException:
            self._recover(abort=set(ids) - set(done))  # the caller sees the error; its requests leave no trace
            raise
        finally:
            self._undelivered[:0] = others
            if bar:
                bar.close()
            if self.threads is not None:
                self.threads.restore()
        return [done[i] for i in ids]

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of each prompt, best first (``generate`` with
        ``BeamSearchParams``: the beams are batched with whatever else is queued, and share KV blocks through forks
        and copy-on-write)."""
        if not isinstance(params, BeamSearchParams):
            raise BeamSearchError(f"params must be a BeamSearchParams, got {params!r:.80}")
        return [output.beams for output in self.generate(prompts, params)]

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns the requests that finished in this step. A step that raises
        (an error in the model or the sampler, an interrupt, out of memory) leaves the engine as if every unfinished
        request had been preempted by recompute just before it (see ``_recover``), then re-raises: the next step
        continues each request from the tokens it had accepted, with the tokens an undisturbed run would give."""
        self._undelivered += self._step_or_recover()
        self._notify_step()
        finished, self._undelivered = self._undelivered, []
        return finished

    def _step_or_recover(self) -> list[RequestOutput]:
        """``_step``; if it raises, every unfinished request is put back as if preempted (``_recover``)."""
        self.sampler.drawn, self._accepted = [], set()
        try:
            return self._step()
        except BaseException:
            # a sample whose token was accepted keeps it, so its generator keeps the draw too
            self._recover(generators=[(g, state) for g, state in self.sampler.drawn if id(g) not in self._accepted])
            raise

    def _notify_step(self) -> None:
        """The ``on_step`` callback, after a step that ran a plan. The step stands whatever the callback does: if it
        raises, the requests that finished are returned by the next ``step()`` instead of being lost."""
        if self.on_step and self._last_plan_ran:
            self.on_step(self._last_stats)

    def _step(self) -> list[RequestOutput]:
        """schedule -> run -> sample -> postprocess, as nano-vllm's step."""
        started, finished_before = time.perf_counter(), len(self.finished)
        plan = self._schedule()
        if plan is None:
            return []
        step, logits = self._run(plan)
        self._postprocess(step, logits, *self._sample(step, logits))
        self._end_step(started)
        return self.finished[finished_before:]

    def _run(self, plan) -> tuple[ModelInput, torch.Tensor | None]:
        """The plan's copies and swaps, then the model on its tokens: the step's input and its sampling rows' logits
        (with the thread count the policy picks now, on the CPU)."""
        if self.threads is not None:
            self.threads.apply()
        self.runner.execute_copies(plan)
        step = ModelInput.from_plan(plan, self.scheduler.kv_len)
        eager = self.record_logits or bool(self.scheduler.beam_groups)
        return step, self.runner.run(step, self.block_manager, eager=eager)

    def _schedule(self):
        """The step's plan (``SchedulerOutput``), or None when there is nothing to run."""
        started = time.perf_counter()
        plan = self.last_plan = self.scheduler.schedule()
        self.scheduler_s += time.perf_counter() - started
        self._last_plan_ran = not plan.is_empty
        if not plan.is_empty:
            return plan
        head = self.scheduler.drop_unschedulable_head()
        if head is not None:  # check_request makes this unreachable; never spin silently
            raise RuntimeError(f"request {head.request_id} cannot be scheduled into an idle pool")
        return None

    def _sample(self, step: ModelInput, logits: torch.Tensor | None) -> tuple[list, dict]:
        """The sampled rows' ``(row, sequence, token)`` and the beam searches' rows (ranking -> [(row,
        sequences)]): beam rows are ranked, not sampled."""
        rows = step.samplers
        if not self.scheduler.beam_groups:
            tokens = self.sampler.sample(logits, rows)
            return list(zip(((row, seq) for row, seqs in enumerate(rows) for seq in seqs), tokens)), {}
        sampled, ranked = [], {}
        for row, seqs in enumerate(rows):
            beam = seqs[0].group.beam
            if beam is None:
                sampled.append(row)
            else:
                ranked.setdefault(beam, []).append((row, seqs))
        tokens = self.sampler.sample(logits[sampled] if sampled else None, [rows[row] for row in sampled])
        return list(zip(((row, seq) for row in sampled for seq in rows[row]), tokens)), ranked

    def _postprocess(self, step: ModelInput, logits: torch.Tensor | None, sampled: list, ranked: dict) -> None:
        """Append each sampled token to its sequence (``_accept``); rank each beam search's continuations
        (``_rank``)."""
        if not (sampled or ranked):  # nothing read back (a prompt chunk that samples nothing, swaps only): wait for
            self.runner.synchronize()  # the device, or the step's times would end before its work does
        now = time.perf_counter()
        for (row, seq), token in sampled:
            self._accept(seq, logits[row] if self.record_logits else None, token, now)
        for seq in self.scheduler.postprocess([(seq, token) for (_, seq), token in sampled]):
            self._finish(seq, now)
        for ranking, rows in ranked.items():
            self._rank(ranking, logits, rows, now)

    def _rank(self, ranking: BeamRanking, logits: torch.Tensor, rows: list, now: float) -> None:
        """One ranking of a beam search; when it is done its live beams finish and the request returns."""
        seqs = [seq for _, row_seqs in rows for seq in row_seqs]
        ids = [seq.seq_id for seq in seqs]
        manager = self.block_manager
        ranking.block_usage.append((manager.num_distinct_blocks(ids),
                                    sum(len(manager.get_block_table(i)) for i in ids)))
        request = seqs[0].data.request
        if request.first_token_s != request.first_token_s:
            request.first_token_s = now
        if not ranking.rank(logits, rows):
            return
        for seq in request.samples:
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.finish(seq)
        request.samples_left, request.finish_s = 0, now
        beams = BeamSearchOutput(request.prompt, ranking.sequences, ranking.block_usage)
        outputs = [beam.token_ids for beam in beams.sequences]
        self.generated_tokens += sum(map(len, outputs))
        self._output(request, outputs, beams)

    def _end_step(self, started: float) -> None:
        """Close the step's record in the scheduler (its times, tokens, memory) and report it."""
        post = time.perf_counter()
        self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        memory = peak_memory_bytes(self.device)
        ended = time.perf_counter()
        self._last_stats = self.scheduler.end_step(ended - started, ended - self.started_s, self.generated_tokens,
                                                   memory)
        self.scheduler_s += time.perf_counter() - post

    def _recover(self, generators: list = (), abort: set = frozenset()) -> None:
        """Bring the engine back to a consistent state after a failure part-way through a step (or a beam search).
        The plan may have been half applied (blocks allocated, prefix-cache entries registered for KV never written,
        copies done), so nothing of it is trusted: the block pool and the scheduler start afresh, and every
        unfinished request except those in ``abort`` is queued again, first come first served, each sample with the
        tokens it has accepted (a recompute preemption: its next prefill recomputes that KV). Seeded samplers get
        back the state they had before the step. Requests in ``abort`` are dropped."""
        for generator, state in generators:
            generator.set_state(state)
        old = self.scheduler
        self.policy = PagedPolicy(self.block_manager.num_physical_blocks, self.block_size,
                                  self.config.enable_prefix_caching, self.policy.num_swap_blocks,
                                  self.config.kv_offload_blocks)
        self.block_manager = self.policy.manager
        self.scheduler = Scheduler(old.config, self.policy)
        self.scheduler.step_rows, self.scheduler.num_steps = old.step_rows, old.num_steps
        self.scheduler.num_swaps_out = old.num_swaps_out
        self.scheduler.num_preemptions = old.num_preemptions + len(old.running) + len(old.swapped)
        for request_id in abort:
            self.requests.pop(request_id, None)
        for request in sorted(self.requests.values(), key=lambda r: r.request_id):
            if request.samples_left:
                self._requeue(request)
        self.last_plan = None

    def _requeue(self, request: _Request) -> None:
        """Queue ``request``'s unfinished samples again: those with no token yet as one group (they share the
        prompt's prefill), each other one alone with its prompt and accepted tokens as the prompt. A sample whose
        accepted tokens already end it (the fault came between accepting its token and the scheduler's stop check)
        finishes instead."""
        final_len = len(request.prompt) + request.params.max_tokens - 1
        if request.beam is not None:  # a beam search starts again from its prompt (see lab.engine.beam)
            group = self._group(request)
            group.seqs = [Sequence(seq.seq_id, group, seq.sample, len(request.prompt), final_len, seq.data)
                          for seq in request.samples]
            request.samples = group.seqs
            request.beam.restart(group.seqs)
            self.scheduler.add(group)
            return
        fresh, started, stops = [], [], self._stop_token_ids(request.params)
        for index, seq in enumerate(request.samples):
            if seq.status is SequenceStatus.FINISHED:
                continue
            state = seq.data
            if state.output and (len(state.output) >= request.params.max_tokens or state.output[-1] in stops):
                seq.status = SequenceStatus.FINISHED
                self._finish(seq, time.perf_counter())
                continue
            group = self._group(request)
            new = Sequence(seq.seq_id, group, seq.sample, len(state.token_ids), final_len, state)
            request.samples[index] = new
            (started if state.output else fresh).append(new)
        if fresh:
            group = fresh[0].group
            for seq in fresh:
                seq.group = group
            group.seqs.extend(fresh)
            self.scheduler.add(group)
        for seq in started:
            seq.group.seqs.append(seq)
            self.scheduler.add(seq.group)

    last_plan = None  # the latest step's SchedulerOutput (what lab.profiling.profile reads the step's features from)

    def last_step_stats(self) -> StepStats | None:
        """What the latest step did (see ``StepStats``)."""
        return self._last_stats

    def pool_snapshot(self):
        """The device block pool (``PoolSnapshot``), with ``host_pool`` set when swapping is on."""
        self.scheduler.sync_all()
        return self.policy.pool_snapshot()

    def step_log(self) -> pd.DataFrame:
        """One row per step with ``lab.sched.scheduler.STEP_LOG_COLUMNS`` (the simulator's ``SimResult.steps`` has the
        same columns)."""
        return self.scheduler.step_log_frame()

    def _accept(self, seq: Sequence, logits: torch.Tensor | None, token: int, now: float) -> None:
        """Append ``token`` (from the sampler) to ``seq`` (the scheduler's ``postprocess`` then checks stops).
        ``logits``: its row's, given (and kept) when ``record_logits`` is on."""
        state = seq.data
        if self.record_logits:
            state.logits = (state.logits or []) + [logits.detach().float().cpu()]
        state.output.append(token)
        if state.generator is not None:
            self._accepted.add(id(state.generator))
        self.generated_tokens += 1
        request = state.request
        if request.first_token_s != request.first_token_s:  # NaN: first token of the request
            request.first_token_s = now

    def _finish(self, seq: Sequence, now: float) -> None:
        """``seq`` finished (the scheduler freed it): when it was its request's last, the request's output."""
        request = seq.data.request
        request.samples_left -= 1
        if request.samples_left:
            return
        request.finish_s = now
        samples = sorted(request.samples, key=lambda s: s.sample)
        outputs = [s.data.output for s in samples]
        if self.record_logits:
            self.recorded_logits[request.request_id] = [torch.stack(s.data.logits) for s in samples]
        self._output(request, outputs)

    def _output(self, request: _Request, outputs: list[list[int]], beams: BeamSearchOutput | None = None) -> None:
        """The finished request's ``RequestOutput`` (its texts decoded when there is a tokenizer)."""
        texts = [self.tokenizer.decode(o) for o in outputs] if self.tokenizer is not None else None
        self.finished.append(RequestOutput(request.request_id, request.prompt, outputs, texts, request.arrival_s,
                                           request.first_token_s, request.finish_s, beams))

    # ---- metrics ------------------------------------------------------------------------------------------------
    def request_metrics(self) -> pd.DataFrame:
        """One row per finished request (``request_table``)."""
        return request_table(self.finished)

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
                "swap_outs": self.scheduler.num_swaps_out,
                "peak_kv_blocks": self.peak_used_blocks, "num_kv_blocks": self.block_manager.num_physical_blocks,
                "prefix_hit_rate": stats.hit_rate, "cow_copies": self.block_manager.num_cow_copies,
                "peak_memory_bytes": peak_memory_bytes(self.device)}


def request_table(outputs: list[RequestOutput]) -> pd.DataFrame:
    """One row per request of ``outputs``: prompt tokens, output tokens (every sample's), TTFT, TPOT and end-to-end
    latency (seconds), as ``lab.latency`` defines them (for ``n > 1``: the longest sample's tokens count)."""
    if not outputs:
        return pd.DataFrame(columns=["request_id", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s"])
    times = request_latencies([o.arrival_s for o in outputs], [o.first_token_s for o in outputs],
                              [o.finish_s for o in outputs], counted_tokens([[len(s) for s in o.outputs]
                                                                            for o in outputs]))
    return pd.DataFrame({"request_id": [o.request_id for o in outputs],
                         "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
                         "output_tokens": [sum(len(s) for s in o.outputs) for o in outputs],
                         **{name: times[name].to_numpy() for name in ("ttft_s", "tpot_s", "e2e_s")}})


def num_sequences(params: SamplingParams | BeamSearchParams) -> int:
    """The sequences a request runs: its samples, or its beams."""
    return params.beam_width if isinstance(params, BeamSearchParams) else params.n


def peak_memory_bytes(device: torch.device) -> int:
    """Device peak allocation on CUDA; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

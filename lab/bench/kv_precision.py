"""KV precision, measured: the engine with an FP8 KV cache against the same engine with a full-precision one.

For each model, a baseline run with ``kv_cache_dtype="auto"`` (the model's dtype: float32 or bfloat16) generates
greedily and records, per step, every layer's attention output and the logits. Each FP8 run (``fp8_e4m3`` and
``fp8_e5m2``, each with vLLM's default scale of 1.0 and with ``calculate_kv_scales``) is teacher-forced along the
baseline's tokens (its sampler emits them), on the same number of blocks, so every step sees the same batch and
the same history and the two can be compared step by step:

* ``attn_rel_err_layer0``: layer 0's attention output, ``||fp8 - base|| / ||base||`` over all steps: its query and
  the keys' and values' inputs are the same in both runs, so this is the cache's quantization error alone;
* ``attn_rel_err``: the same over every layer (the error propagated through the model);
* ``logits_rel_err``: the logits, likewise, over every generated position;
* ``top1_agreement``: positions whose argmax equals the baseline's; ``top1_agreement_clear``: the same over the
  positions whose baseline top-2 logit margin is at least ``tie_margin`` (near ties, which any perturbation flips,
  excluded; ``clear_positions`` says how many stay);

Speed is not measured here (the taps copy every layer's output): the runtime page and ``bench vllm`` time it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd
import torch

from lab.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams, load_model
from lab.engine.sampler import Sampler
from lab.errors import InputError
from lab.kv_cache.precision import KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class KVPrecisionBenchConfig:
    models: tuple[str, ...] = ("tiny", "qwen3-0.6b-random")
    dtype: str = "float32"  # the model's and the baseline cache's dtype
    kv_cache_dtypes: tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2")
    num_prompts: int = 4
    prompt_len: int = 48
    max_tokens: int = 16
    block_size: int = 16
    tie_margin: float = 0.1  # logits: a baseline top-2 margin below this is a near tie
    seed: int = 0

    def check(self) -> None:
        """An ``InputError`` naming the first bad field."""
        if not self.models:
            raise InputError("KVPrecisionBenchConfig.models: give at least one model")
        if self.dtype not in DTYPES:
            raise InputError(f"KVPrecisionBenchConfig.dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        bad = [d for d in self.kv_cache_dtypes if d not in KV_CACHE_DTYPES or d == "auto"]
        if bad or not self.kv_cache_dtypes:
            raise InputError(f"KVPrecisionBenchConfig.kv_cache_dtypes={self.kv_cache_dtypes!r}: expected FP8 ones of "
                             f"{', '.join(KV_CACHE_DTYPES[1:])}")
        for name in ("num_prompts", "prompt_len", "max_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"KVPrecisionBenchConfig.{name}={value!r}: expected an integer >= 1")
        if not isinstance(self.tie_margin, (int, float)) or not self.tie_margin >= 0:
            raise InputError(f"KVPrecisionBenchConfig.tie_margin={self.tie_margin!r}: expected a number >= 0")


class _ForcedSampler(Sampler):
    """Emits the baseline's tokens (teacher forcing): each sequence's next token is ``forced[request][position]``."""

    def __init__(self, forced: dict[int, list[int]]):
        super().__init__()
        self.forced = forced

    def sample(self, logits, rows):
        self.drawn = []
        return [self.forced[seq.data.request.request_id][len(seq.data.output)] for row in rows for seq in row]


class _AttentionTap:
    """Every layer's attention output of every step, as the runner computes it."""

    def __init__(self, runner):
        self.outputs: list[torch.Tensor] = []
        inner = runner._attention

        def tapped(layer, q, k, v, batch):
            out = inner(layer, q, k, v, batch)
            self.outputs.append(out.detach().float().clone())
            return out

        runner._attention = tapped


def _prompts(config: KVPrecisionBenchConfig, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(config.seed)
    return [torch.randint(0, vocab, (config.prompt_len,), generator=generator).tolist()
            for _ in range(config.num_prompts)]


def _run(hf_model, base: EngineConfig, prompts, params, forced=None, **fields) -> dict:
    engine = LLMEngine(hf_model, base, record_logits=True, **fields)
    if forced is not None:
        engine.sampler = _ForcedSampler(forced)
    tap = _AttentionTap(engine.runner)
    outputs = engine.generate(prompts, params)
    logits = [engine.recorded_logits[o.request_id][0].float() for o in outputs]
    return {"tokens": [o.token_ids for o in outputs], "logits": logits, "attention": tap.outputs,
            "layers": engine.runner.num_layers,
            "k_scales": list(engine.runner.k_scales), "v_scales": list(engine.runner.v_scales)}


def _relative(pairs) -> float:
    pairs = list(pairs)
    diff = sum(float((b - a).double().pow(2).sum()) for a, b in pairs)
    norm = sum(float(a.double().pow(2).sum()) for a, _ in pairs)
    return (diff / norm) ** 0.5 if norm else float("nan")


def compare(base: dict, run: dict, tie_margin: float) -> dict:
    """The error and agreement columns of one FP8 run against the baseline (both dicts from ``_run``)."""
    if len(base["attention"]) != len(run["attention"]):
        raise RuntimeError("the teacher-forced run took other steps than the baseline")
    layers = base["layers"]
    pairs = list(zip(base["attention"], run["attention"]))
    base_logits, run_logits = torch.cat(base["logits"]), torch.cat(run["logits"])
    top2 = base_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= tie_margin
    agree = base_logits.argmax(-1) == run_logits.argmax(-1)
    return {"attn_rel_err_layer0": _relative(pairs[0::layers]), "attn_rel_err": _relative(pairs),
            "logits_rel_err": _relative(zip(base["logits"], run["logits"])),
            "top1_agreement": float(agree.float().mean()),
            "top1_agreement_clear": float(agree[clear].float().mean()) if clear.any() else float("nan"),
            "positions": int(agree.numel()), "clear_positions": int(clear.sum())}


def run_kv_precision_bench(config: KVPrecisionBenchConfig,
                           on_row: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """One row per (model, kv_cache_dtype, scales): the baseline's own row first (errors 0 by definition), then
    each FP8 run's errors and agreement against it. ``on_row(rows so far)`` after each row."""
    config.check()
    rows = []
    for model in config.models:
        base = EngineConfig(device="cpu", dtype=DTYPES[config.dtype], block_size=config.block_size,
                            max_num_seqs=config.num_prompts, seed=config.seed)
        hf_model, _ = load_model(model, base)
        prompts = _prompts(config, hf_model.config.vocab_size)
        params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
        blocks = config.num_prompts * -(-(config.prompt_len + config.max_tokens) // config.block_size) + 1
        baseline = _run(hf_model, base, prompts, params, num_blocks=blocks)
        forced = {i: tokens for i, tokens in enumerate(baseline["tokens"])}
        common = {"model": model, "dtype": config.dtype, "blocks": blocks}
        rows.append({**common, "kv_cache_dtype": "auto", "scales": "-",
                     **compare(baseline, baseline, config.tie_margin),
                     "k_scale_mean": float("nan"), "v_scale_mean": float("nan")})
        if on_row is not None:
            on_row(pd.DataFrame(rows))
        for kv_cache_dtype in config.kv_cache_dtypes:
            for calculated in (False, True):
                run = _run(hf_model, base, prompts, params, forced=forced, num_blocks=blocks,
                           kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculated)
                rows.append({**common, "kv_cache_dtype": kv_cache_dtype,
                             "scales": "calculated" if calculated else "1.0",
                             **compare(baseline, run, config.tie_margin),
                             "k_scale_mean": sum(run["k_scales"]) / len(run["k_scales"]),
                             "v_scale_mean": sum(run["v_scales"]) / len(run["v_scales"])})
                if on_row is not None:
                    on_row(pd.DataFrame(rows))
        del hf_model
    return pd.DataFrame(rows)

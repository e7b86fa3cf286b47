"""The engine against HF transformers on one device: greedy tokens in fp32 with CUDA graphs off and on, and the
first step's logits in bf16 (relative error, top-1 agreement). What a GPU loan checks first (``scripts/gpu_check.sh``):
a wrong graph or kernel shows here as a token or a logit, before any speed is measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd
import torch

from lab.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams, load_model


@dataclass(slots=True)
class ParityConfig:
    model: str = "qwen3-0.6b-random"
    device: str = "cpu"
    attention_backend: str = "auto"
    num_prompts: int = 8
    max_tokens: int = 32
    min_prompt: int = 16
    max_prompt: int = 96
    seed: int = 0


def _prompts(config: ParityConfig, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(config.seed)
    lengths = torch.randint(config.min_prompt, config.max_prompt + 1, (config.num_prompts,), generator=generator)
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    device = next(hf_model.parameters()).device
    out = hf_model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def _engine_config(config: ParityConfig, dtype: torch.dtype, **fields) -> EngineConfig:
    return EngineConfig(device=config.device, dtype=dtype, attention_backend=config.attention_backend,
                        max_num_seqs=config.num_prompts, **fields)


def greedy_rows(config: ParityConfig, prompts: list[list[int]], hf_model, tokenizer) -> list[dict]:
    """fp32 (``hf_model`` loaded so): our greedy tokens against HF's, graphs off then on (``cuda_graphs``: whether
    decode steps replayed graphs; off on a CPU whatever was asked)."""
    base = _engine_config(config, torch.float32)
    expected = [_hf_greedy(hf_model, prompt, config.max_tokens) for prompt in prompts]
    rows = []
    for graphs in (False, True):
        engine = LLMEngine(hf_model, base, tokenizer=tokenizer, cuda_graphs=graphs)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=config.max_tokens, ignore_eos=True))
        got = [output.token_ids for output in outputs]
        static = engine.runner.static_decode
        equal = sum(a == b for ours, theirs in zip(got, expected) for a, b in zip(ours, theirs))
        rows.append({"check": "greedy_tokens", "dtype": "float32", "cuda_graphs_asked": graphs,
                     "cuda_graphs": bool(graphs and static is not None and static.use_graphs),
                     "sequences_equal": sum(ours == theirs for ours, theirs in zip(got, expected)) / len(prompts),
                     "tokens_equal": equal / sum(map(len, expected)), "max_rel_err": float("nan"),
                     "top1_agreement": float("nan")})
    return rows


def logits_row(config: ParityConfig, prompts: list[list[int]]) -> dict:
    """bf16: the first step's logits (the prompt's last position) against HF's forward of the same weights."""
    base = _engine_config(config, torch.bfloat16, record_logits=True)
    hf_model, tokenizer = load_model(config.model, base)
    engine = LLMEngine(hf_model, base, tokenizer=tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    errors, agree = [], 0
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            ours = engine.recorded_logits[output.request_id][0][0].double().cpu()
            ids = torch.tensor([prompt], device=next(hf_model.parameters()).device)
            theirs = hf_model(ids).logits[0, -1].double().cpu()
            errors.append(float((ours - theirs).norm() / theirs.norm()))
            agree += int(ours.argmax() == theirs.argmax())
    return {"check": "first_step_logits", "dtype": "bfloat16", "cuda_graphs_asked": False, "cuda_graphs": False,
            "sequences_equal": float("nan"), "tokens_equal": float("nan"), "max_rel_err": max(errors),
            "top1_agreement": agree / len(prompts)}


def run_parity(config: ParityConfig, on_row: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """Greedy fp32 (graphs off, on) and bf16 first-step logits; ``on_row(rows so far)`` after each check."""
    hf_model, tokenizer = load_model(config.model, _engine_config(config, torch.float32))
    prompts = _prompts(config, hf_model.config.vocab_size)
    rows: list[dict] = []
    for check in (lambda: greedy_rows(config, prompts, hf_model, tokenizer), lambda: [logits_row(config, prompts)]):
        rows += [{"model": config.model, "device": config.device, **row} for row in check()]
        if on_row is not None:
            on_row(pd.DataFrame(rows))
    return pd.DataFrame(rows)

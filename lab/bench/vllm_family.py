"""``lab bench vllm --workload random``: our engine against vLLM's CPU build on seeded workloads the bench did not
choose. Each workload of a family draws its requests (8-64), prompt lengths (16-1,000 tokens, from a range drawn
too), output lengths (16-256), arrivals (all at once or staggered by engine steps), block size, scheduler budgets and
prefix caching (with a shared system prompt when on); both engines get the same checkpoint, pool (in tokens, the
same for every block size), budgets and requests, and run alternating. The table gives each workload's ratio and,
per dtype, the family's median and worst ratio: a speed claim holds on the worst, not the chosen case.

vLLM's CPU attention takes block sizes that are multiples of 32 only (``CPUAttentionBackend.
get_supported_kernel_block_sizes`` returns ``MultipleOf(32)``, vllm/v1/attention/backends/cpu_attn.py), so the
family draws 32, 64 and 128 where the GPU lab would draw 16 too."""
from __future__ import annotations

import random
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from lab.bench.vllm import _ours, _theirs
from lab.engine import LLMEngine
from lab.engine.live import random_requests
from lab.models.qwen3 import PRESETS, save_checkpoint
from lab.peer.client import PeerSettings, VLLMPeer

BLOCK_SIZES = (32, 64, 128)
POOL_TOKENS = 16_384  # every workload's KV pool, whatever its block size


@dataclass(slots=True)
class FamilyWorkload:
    """One drawn workload: what both engines serve and how they are set up for it."""

    seed: int
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    staggered: bool  # requests join over the first steps (else all before the first)
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    shared_prefix_tokens: int
    prompts: list = field(default_factory=list, repr=False)
    max_tokens: list = field(default_factory=list, repr=False)
    arrival_steps: list | None = field(default=None, repr=False)

    @property
    def num_blocks(self) -> int:
        """vLLM's count (ours gets one fewer: vLLM keeps block 0 as its null block)."""
        return POOL_TOKENS // self.block_size

    def describe(self) -> dict:
        """The workload's settings as table columns."""
        row = asdict(self)
        for name in ("prompts", "max_tokens", "arrival_steps"):
            row.pop(name)
        row["prompt_range"], row["output_range"] = (f"{low}-{high}" for low, high in (self.prompt_range,
                                                                                        self.output_range))
        return row


def random_family(seed: int, count: int, vocab_size: int) -> list[FamilyWorkload]:
    """``count`` workloads drawn from ``seed`` (the same seed, the same family)."""
    family = []
    for index in range(count):
        rng = random.Random(seed * 1_000_003 + index)
        low = rng.randint(16, 600)
        high = rng.randint(low, 1000)
        out_low = rng.randint(16, 160)
        caching = rng.random() < 0.5
        workload = FamilyWorkload(seed * 1_000_003 + index, rng.randint(8, 64), (low, high),
                                  (out_low, rng.randint(out_low, 256)), rng.random() < 0.5, rng.choice(BLOCK_SIZES),
                                  rng.choice((16, 32, 64)), rng.choice((512, 1024, 2048)), caching,
                                  rng.randint(32, 512) if caching else 0)
        prefix = workload.shared_prefix_tokens
        workload.prompts, workload.max_tokens = random_requests(
            workload.num_requests, (max(1, low - prefix), max(1, high - prefix)), workload.output_range, vocab_size,
            workload.seed, shared_prefix_tokens=prefix)
        if workload.staggered:
            gaps = [rng.randint(0, 4) for _ in range(workload.num_requests)]
            workload.arrival_steps = [sum(gaps[:i + 1]) for i in range(workload.num_requests)]
        family.append(workload)
    return family


def _peer_settings(checkpoint: str, dtype: str, workload: FamilyWorkload) -> PeerSettings:
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    return PeerSettings(checkpoint, dtype, workload.block_size, workload.num_blocks, workload.max_num_seqs,
                        workload.max_num_batched_tokens, max_model_len=longest,
                        enable_prefix_caching=workload.enable_prefix_caching)


def _engine(checkpoint: str, dtype: str, workload: FamilyWorkload, longest: int) -> LLMEngine:
    return LLMEngine(checkpoint, block_size=workload.block_size, num_blocks=workload.num_blocks - 1,
                     max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=workload.max_num_batched_tokens,
                     scheduling="vllm", enable_prefix_caching=workload.enable_prefix_caching,
                     max_model_len=longest, dtype=getattr(torch, dtype))


def run_family_bench(model: str, dtypes: tuple[str, ...], seed: int, count: int, repeats: int,
                     progress=None) -> pd.DataFrame:
    """Per (dtype, workload): both engines' median output tok/s over ``repeats`` alternating runs and the ratio ours /
    vLLM; then per dtype a ``family median`` and a ``family worst`` row."""
    if model not in PRESETS:
        raise ValueError(f"model must be a preset ({', '.join(PRESETS)}); got {model!r}")
    rows, done, total = [], 0, len(dtypes) * count * repeats * 2
    with tempfile.TemporaryDirectory() as folder:
        for dtype in dtypes:
            checkpoint = str(save_checkpoint(model, Path(folder) / f"{model}-{dtype}", getattr(torch, dtype), seed))
            family = random_family(seed, count, PRESETS[model][6])
            ratios = []
            for workload in family:
                settings = _peer_settings(checkpoint, dtype, workload)
                engine = _engine(checkpoint, dtype, workload, settings.max_model_len)
                runs = {"ours": [], "vllm": []}
                with VLLMPeer(settings) as peer:
                    warm = workload.prompts[:2], [4, 4]
                    _ours(engine, *warm), _theirs(peer, *warm)
                    for repeat in range(repeats):
                        order = (("ours", "vllm") if repeat % 2 == 0 else ("vllm", "ours"))
                        for system in order:
                            run = (_ours(engine, workload.prompts, workload.max_tokens, workload.arrival_steps)
                                   if system == "ours" else
                                   _theirs(peer, workload.prompts, workload.max_tokens, workload.arrival_steps))
                            runs[system].append(run)
                            done += 1
                            if progress:
                                progress(done, total)
                ours, theirs = (statistics.median(r["output_tok_s"] for r in runs[s]) for s in ("ours", "vllm"))
                same = sum(a[:1] == b[:1] for a, b in zip(runs["ours"][0]["outputs"], runs["vllm"][0]["outputs"]))
                ratios.append(ours / theirs)
                rows.append({"dtype": dtype, "workload": workload.seed, "ours_tok_s": ours, "vllm_tok_s": theirs,
                             "ratio": ours / theirs,
                             "ours_min_max": _spread(runs["ours"]), "vllm_min_max": _spread(runs["vllm"]),
                             "ours_preemptions": runs["ours"][0]["preemptions"],
                             "vllm_preemptions": runs["vllm"][0]["preemptions"],
                             "first_token_agreement": same / workload.num_requests, **workload.describe()})
            rows.append({"dtype": dtype, "workload": "family median", "ratio": statistics.median(ratios)})
            rows.append({"dtype": dtype, "workload": "family worst", "ratio": min(ratios)})
    table = pd.DataFrame(rows)
    table["model"], table["family_seed"], table["repeats"] = model, seed, repeats
    return table


def _spread(runs: list[dict]) -> str:
    values = [r["output_tok_s"] for r in runs]
    return f"{min(values):,.0f}-{max(values):,.0f}"

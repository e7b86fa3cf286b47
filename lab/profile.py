"""Profile the real engine and fit a step-time model the simulator can run on (the digital twin's clock).

``profile_engine`` runs designed workloads through ``LLMEngine`` — single prefills of several lengths with and
without a cached prefix, decode batches of several sizes x context lengths, chunked steps that mix the two, and
copy-on-write of parallel samples — and records every step's plan features and measured duration. After warm-up,
steps with identical features are repeats; their median is one sample. A non-negative least-squares fit of
``duration = sum(coefficient x feature)`` gives the ``StepTimeModel``; its error is reported on held-out samples.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

FEATURES = ("constant", "prefill_seqs", "prefill_tokens", "decode_seqs", "prefill_attention_pairs",
            "decode_kv_tokens", "copied_blocks")
PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file is malformed, or does not match the model or block size it is used with."""


def step_features(out) -> list[float]:
    """The features of one step's plan (``lab.scheduler.SchedulerOutput``), in ``FEATURES`` order."""
    copies = len(out.blocks_to_copy) + len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
    return [1.0, float(len(out.prefill_chunks)), float(out.num_prefill_tokens), float(out.num_decode_seqs),
            float(out.prefill_attention_pairs), float(out.decode_kv_tokens), float(copies)]


@dataclass(slots=True)
class Profile:
    """A fitted step-time model with where it was measured. ``samples`` are ``{"features": [...], "duration_s":
    median, "repeats": n, "holdout": bool}``."""

    model: str
    device: str
    dtype: str
    block_size: int
    backend: str
    coefficients: dict[str, float]
    samples: list[dict] = field(default_factory=list)
    holdout_median_rel_error: float = math.nan
    holdout_max_rel_error: float = math.nan
    version: int = PROFILE_VERSION

    def step_time(self, out) -> float:
        """Predicted seconds of the step planned in ``out``."""
        features = step_features(out)
        return sum(self.coefficients[name] * value for name, value in zip(FEATURES, features))

    def check_matches(self, model: str | None = None, block_size: int | None = None) -> None:
        """Raise ``ProfileError`` when the profile was measured for another model or block size."""
        if model is not None and str(model) != self.model:
            raise ProfileError(f"the profile was measured on model {self.model!r}, not {str(model)!r}")
        if block_size is not None and block_size != self.block_size:
            raise ProfileError(f"the profile was measured with block_size {self.block_size}, not {block_size}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read and check a profile file; ``ProfileError`` names what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path}: not a JSON profile ({exc})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data, name: str = "profile") -> "Profile":
        if not isinstance(data, dict):
            raise ProfileError(f"{name}: expected a JSON object")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{name}: profile version {data.get('version')!r}, this lab reads {PROFILE_VERSION}")
        for key, kind in (("model", str), ("device", str), ("dtype", str), ("backend", str), ("block_size", int),
                          ("coefficients", dict), ("samples", list)):
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise ProfileError(f"{name}: field {key!r} must be a {kind.__name__}, got {data.get(key)!r:.60}")
        coefficients = data["coefficients"]
        if set(coefficients) != set(FEATURES) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in coefficients.values()):
            raise ProfileError(f"{name}: coefficients must be finite numbers >= 0 for exactly {', '.join(FEATURES)}")
        if data["block_size"] < 1:
            raise ProfileError(f"{name}: block_size must be >= 1")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def fit(samples: list[dict], holdout_fraction: float = 0.2, seed: int = 0) -> tuple[dict[str, float], float, float]:
    """Non-negative least squares, each row weighted by 1 / sqrt(its duration) (short steps count, long steps,
    which dominate a run's time, count more than under relative error); returns the
    coefficients fitted on every sample and the median and max relative error on a held-out fraction (fitted
    without it)."""
    from scipy.optimize import nnls

    features = np.array([s["features"] for s in samples], dtype=np.float64)
    durations = np.array([s["duration_s"] for s in samples], dtype=np.float64)
    rng = np.random.default_rng(seed)
    holdout = rng.random(len(samples)) < holdout_fraction
    if holdout.all() or not holdout.any():
        holdout = np.zeros(len(samples), dtype=bool)
        holdout[rng.integers(len(samples))] = True
    for sample, held in zip(samples, holdout):
        sample["holdout"] = bool(held)

    def solve(rows):
        scale = features[rows].max(axis=0)
        scale[scale == 0] = 1.0
        weights = 1.0 / np.sqrt(durations[rows])  # between relative (1/d) and absolute (1) error
        solution, _ = nnls(features[rows] / scale * weights[:, None], durations[rows] * weights)
        return solution / scale

    trained = solve(~holdout)
    errors = np.abs(features[holdout] @ trained - durations[holdout]) / durations[holdout]
    coefficients = solve(np.ones(len(samples), dtype=bool))
    return dict(zip(FEATURES, map(float, coefficients))), float(np.median(errors)), float(errors.max())


# ---- measuring the engine -----------------------------------------------------------------------------------------
def _scenarios(block_size: int, quick: bool) -> list[tuple[str, dict, list[tuple[int, int, int]]]]:
    """(name, engine settings, requests as (prompt length, output tokens, samples n)); ``quick``: a small subset
    (for tests)."""
    if quick:
        return [("decode 4x32", {}, [(32, 4, 1)] * 4), ("prefill 64", {}, [(64, 1, 1)]),
                ("chunked", {"scheduling": "chunked", "max_num_batched_tokens": 48}, [(40, 4, 1)] * 2 + [(100, 2, 1)]),
                ("forks", {}, [(block_size + 1, 3, 2)])]
    decode = [(f"decode {batch}x{context}", {}, [(context, 6, 1)] * batch)
              for batch in (1, 4, 16, 32, 64) for context in (32, 128, 384)]
    prefill = [(f"prefill {length}", {}, [(length, 1, 1)]) for length in (16, 48, 128, 256, 512)]
    prefill += [(f"prefill {count} x {length}", {}, [(length, 1, 1)] * count) for count in (8, 32)
                for length in (32, 128)]
    cached = [(f"prefill {length} after a cached prefix", {"cached_prefix": 256}, [(length, 1, 1)])
              for length in (32, 128)]
    chunked = [(f"chunked {batch} decodes + prompt", {"scheduling": "chunked", "max_num_batched_tokens": 96},
                [(64, 8, 1)] * batch + [(400, 2, 1)]) for batch in (4, 16)]
    forks = [("parallel samples (copy-on-write)", {}, [(block_size * 3 + 1, 5, 4)] * 2)]
    return decode + prefill + cached + chunked + forks


def profile_engine(model="tiny", device: str | None = None, block_size: int = 16, backend: str = "auto",
                   repeats: int = 3, seed: int = 0, quick: bool = False,
                   progress: Callable[[int, int], None] | None = None) -> Profile:
    """Measure the engine on the designed scenarios (each run once unmeasured to warm up, then ``repeats`` times)
    and fit the step-time model."""
    import torch

    from .engine import EngineConfig, LLMEngine, SamplingParams

    scenarios = _scenarios(block_size, quick)
    groups: dict[tuple, list[float]] = {}
    dtype = backend_name = device_name = ""
    for index, (name, settings, requests) in enumerate(scenarios):
        cached_prefix = settings.get("cached_prefix", 0)
        config = EngineConfig(block_size=block_size, device=device, attention_backend=backend, seed=seed,
                              max_num_seqs=64, **{k: v for k, v in settings.items() if k != "cached_prefix"})
        engine = LLMEngine(model, config)
        dtype, device_name = str(engine.runner.dtype), str(engine.device)
        backend_name = engine.runner.attention_backend
        vocab = engine.hf_model.config.vocab_size
        generator = torch.Generator().manual_seed(seed + index)
        for round_ in range(repeats + 1):  # round 0 warms this engine up
            prefix = torch.randint(0, vocab, (cached_prefix,), generator=generator).tolist()
            if cached_prefix:
                engine.generate([prefix + [1]], SamplingParams(max_tokens=1, ignore_eos=True))
            for length, outputs, n in requests:
                prompt = prefix + torch.randint(0, vocab, (length,), generator=generator).tolist()
                engine.add_request(prompt, SamplingParams(max_tokens=outputs, n=n, ignore_eos=True,
                                                          temperature=0.8 if n > 1 else 0.0, seed=seed))
            steps = 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
                if round_:
                    key = tuple(step_features(engine.last_plan))
                    groups.setdefault(key, []).append(engine.last_step_stats().duration_s)
        if progress is not None:
            progress(index + 1, len(scenarios))
    samples = [{"features": list(key), "duration_s": statistics.median(times), "repeats": len(times)}
               for key, times in groups.items()]
    coefficients, median_error, max_error = fit(samples, seed=seed)
    return Profile(str(model), device_name, dtype, block_size, backend_name, coefficients, samples, median_error,
                   max_error)


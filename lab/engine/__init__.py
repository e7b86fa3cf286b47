"""The engine: ``LLMEngine`` = the scheduler (``lab.sched``) + the model runner (``lab.worker``) + the sampler, with
sampling parameters, beam search and live runs for dashboards.

    from lab.engine import LLMEngine, SamplingParams
    outputs = LLMEngine("tiny").generate([[1, 2, 3]], SamplingParams(max_tokens=8))

May import: ``lab`` (errors, checks, hardware), ``lab.kv_cache``, ``lab.sched``, ``lab.models``, ``lab.worker``,
``paged_kernels``."""
from .beam import BeamSearchOutput, BeamSearchParams
from .llm_engine import EngineConfig, LLMEngine, RequestOutput, StepStats, load_model
from .sampler import SamplingParams

__all__ = ["LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "StepStats", "BeamSearchParams",
           "BeamSearchOutput", "load_model"]

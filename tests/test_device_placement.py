"""What a GPU would catch, caught on a CPU: every step's forward also runs on a copy of the model on PyTorch's meta
device (shapes without data), which raises where a CPU tensor meets device tensors, and where anything is read back
to the host (``item``, ``int`` of a tensor, a 0-d tensor used as an index): on a GPU the first is an error and the
second a sync that waits for all queued work, once per layer in a forward."""
import copy

import pytest

from lab.engine.beam import BeamSearchParams
from lab.engine import LLMEngine, SamplingParams
from lab.worker.model_runner import ModelRunner


class MetaMirror:
    """The engine's model runner, each step's ``prepare``, ``forward`` and copy-on-write copies repeated on a meta
    copy of the model and cache (the CPU run's results are returned, so the engine goes on as usual)."""

    def __init__(self, runner, meta_runner):
        self.runner, self.meta_runner, self.steps = runner, meta_runner, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, model_input, kv, eager=False):
        batch, rows = self.runner.prepare(model_input, kv)
        self.meta_batch = self.meta_runner.prepare(model_input, kv)
        return self.forward(batch, rows) if batch is not None else None

    def forward(self, batch, logit_rows):
        meta_batch, meta_rows = self.meta_batch
        logits = self.meta_runner.forward(meta_batch, meta_rows)
        assert logits.device.type == "meta" and logits.argmax(dim=-1).device.type == "meta"
        self.steps += 1
        return self.runner.forward(batch, logit_rows)

    def execute_copies(self, plan):
        self.meta_runner.copy_blocks(plan.blocks_to_copy)  # (swaps copy to the host, which a meta tensor cannot)
        self.runner.execute_copies(plan)


@pytest.mark.parametrize("settings", [{}, {"scheduling": "chunked", "max_num_batched_tokens": 13},
                                      {"enable_prefix_caching": True}], ids=["prefill-first", "chunked", "caching"])
def test_the_forward_keeps_to_its_device_and_reads_nothing_back(settings):
    """Prompt chunks after cached context, decode batches, copy-on-write forks and beam search, with the torch
    backend (the cupy one needs a GPU): the same steps as the CPU run, on the meta device."""
    engine = LLMEngine("tiny", num_blocks=128, block_size=4, attention_backend="torch", **settings)
    meta_model = copy.deepcopy(engine.hf_model).to("meta")
    engine.runner = MetaMirror(engine.runner, ModelRunner(meta_model, 128, 4, "torch"))
    prefix = list(range(1, 30))
    engine.generate([prefix + [40, 41], [7, 8, 9]], SamplingParams(max_tokens=5, ignore_eos=True))
    # with caching, a prefix cached past the new tokens (an attention mask) and one shorter than them (zero queries)
    engine.generate([prefix + [50], prefix[:8] + list(range(200, 230))],
                    [SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1, ignore_eos=True),
                     SamplingParams(max_tokens=3, ignore_eos=True)])
    assert engine.runner.steps == engine.num_steps >= 8
    before = engine.num_steps
    engine.beam_search([[5, 6, 7, 8, 9]], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    assert engine.runner.steps == engine.num_steps == before + 4  # beam search's steps are engine steps
    if settings.get("enable_prefix_caching"):
        assert engine.block_manager.prefix_cache_stats.hit_tokens >= 28 + 8

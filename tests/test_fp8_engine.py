"""The engine with an FP8 KV cache (issue 71): ``EngineConfig.kv_cache_dtype`` / ``calculate_kv_scales``, the pool
it buys, the calibrated scales, and swap, the offload tier and prefix caching carrying FP8 blocks as they are."""
import pytest
import torch

from lab.engine.llm_engine import EngineConfigError, LLMEngine
from lab.engine.sampler import SamplingParams
from lab.worker.model_runner import K_SCALE_CONSTANT, V_SCALE_CONSTANT
from paged_kernels import fp8
from tests.test_shared_scheduler import make_prompts


@pytest.mark.parametrize("settings, message", [
    (dict(kv_cache_dtype="fp8_e3m4"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8", attention_backend="cupy"), "does not run the CuPy FP8 kernels"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales=True would be ignored"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=1), "calculate_kv_scales"),
])
def test_bad_precision_settings_are_named(settings, message):
    with pytest.raises(EngineConfigError, match=message):
        LLMEngine("tiny", num_blocks=8, **settings)


def test_an_fp8_pool_holds_one_byte_an_element_and_more_blocks_for_the_same_budget():
    """The tiny preset runs in float32: the same KV budget buys four times the blocks in FP8."""
    full, quantized = LLMEngine("tiny"), LLMEngine("tiny", kv_cache_dtype="fp8_e4m3")
    assert quantized.runner.key_caches[0].dtype == torch.uint8 and full.runner.key_caches[0].dtype == torch.float32
    assert quantized.runner.key_caches[0].shape[0] == 4 * full.runner.key_caches[0].shape[0]
    assert quantized.runner.k_scales == [1.0] * len(quantized.runner.key_caches)  # vLLM's default


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_engine_stays_close_to_the_full_precision_one(kv_cache_dtype):
    """The first token's logits (the prefill's, read back dequantized) within FP8's error of the float32 cache's,
    and not equal to them (the cache really is quantized)."""
    prompts = make_prompts([30, 41, 17], seed=3)
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    def first_logits(**settings):
        engine = LLMEngine("tiny", num_blocks=64, record_logits=True, **settings)
        return [engine.recorded_logits[o.request_id][0][0] for o in engine.generate(prompts, params)]

    for full, quantized in zip(first_logits(), first_logits(kv_cache_dtype=kv_cache_dtype)):
        error = float((quantized - full).norm() / full.norm())
        assert 1e-4 < error < 0.3, error


def test_calculated_scales_put_the_first_prefill_s_largest_key_at_200():
    """``calculate_kv_scales``: each layer's scales from the first prefill (vLLM's amax / 200 for K, / 100 for V);
    that prefill's largest stored key then reads 200 in FP8 units (e4m3 rounds it to 192 or 208), and later steps
    keep the scales."""
    engine = LLMEngine("tiny", num_blocks=64, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    prompt = make_prompts([40], seed=1)[0]
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    runner = engine.runner
    scales = list(runner.k_scales), list(runner.v_scales)
    assert all(s != 1.0 for s in scales[0] + scales[1]) and not runner.calculate_kv_scales
    table = fp8.decode_table("fp8_e4m3")
    for key_cache, value_cache in zip(runner.key_caches, runner.value_caches):
        assert float(abs(table[key_cache.numpy()]).max()) in (192.0, 208.0)
        assert float(abs(table[value_cache.numpy()]).max()) in (96.0, 104.0)
    engine.generate(make_prompts([25], seed=2), SamplingParams(max_tokens=3, ignore_eos=True))
    assert (list(runner.k_scales), list(runner.v_scales)) == scales
    assert K_SCALE_CONSTANT == 200 and V_SCALE_CONSTANT == 100


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_swap_and_the_offload_tier_carry_fp8_blocks_as_they_are(kv_cache_dtype):
    """Swap preemption and prefix-cache hits through the offload tier (device <-> host FP8 bytes) give the tokens
    of the same FP8 engine run without preemption or tier."""
    lengths, outputs = [9, 23, 5, 17, 30, 12, 21, 8], [7, 12, 9, 5, 10, 8, 6, 11]
    prompts = make_prompts(lengths, shared_prefix=8, seed=5)
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outputs]
    common = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=3, kv_cache_dtype=kv_cache_dtype)
    plain = LLMEngine("tiny", num_blocks=256, preemption_mode="recompute", **common)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    swapping = LLMEngine("tiny", num_blocks=14, preemption_mode="swap", num_cpu_blocks=16, **common)
    assert [o.token_ids for o in swapping.generate(prompts, params)] == expected
    assert swapping.num_preemptions > 0
    tier = LLMEngine("tiny", num_blocks=14, preemption_mode="recompute", kv_offload_blocks=8, **common)
    assert [o.token_ids for o in tier.generate(prompts, params)] == expected
    assert tier.block_manager.offload.stats.loaded_blocks > 0
    runner = swapping.runner
    assert runner.cpu_key_caches[0].dtype == torch.uint8
    before = [cache[3].clone() for cache in runner.key_caches + runner.value_caches]
    runner.swap([(3, 5)], to_host=True)
    runner.swap([(5, 9)], to_host=False)
    assert all(torch.equal(cache[9], old) for cache, old in zip(runner.key_caches + runner.value_caches, before))


def test_the_float64_reference_decode_gives_the_fp8_engine_s_tokens():
    """``attention_backend="reference"`` (the float64 NumPy walk over the dequantized FP8 cache) and the torch
    backend (the C++ in-place decode) generate the same greedy tokens from an FP8 cache."""
    prompts = make_prompts([30, 41, 17], seed=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = [[o.token_ids for o in LLMEngine("tiny", num_blocks=64, kv_cache_dtype="fp8",
                                              attention_backend=backend).generate(prompts, params)]
              for backend in ("reference", "torch")]
    assert tokens[0] == tokens[1]

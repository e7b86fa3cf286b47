"""The Qwen3 paged runtime against HF transformers (CPU, fp32), plus prefix caching, forks, preemption, errors."""
import json
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import lab.engine.llm_engine
import lab.worker.model_runner
import lab.engine.sampler
from lab.engine import LLMEngine, SamplingParams
from lab.models.qwen3 import CheckpointError

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 1024, (n,), generator=generator).tolist() for n in (1, 5, 16, 17, 40, 71)]


@pytest.fixture(scope="module")
def hf_reference(prompts):
    engine = LLMEngine("tiny", num_blocks=64)
    return [engine.hf_model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                     do_sample=False)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_hf_generate_in_one_continuous_batch(prompts, hf_reference, block_size, prefix_caching):
    engine = LLMEngine("tiny", block_size=block_size, num_blocks=4096 // block_size + 8,
                       enable_prefix_caching=prefix_caching)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == hf_reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_physical_blocks


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_preemption_in_a_tiny_pool_still_matches(prompts, hf_reference, backend):
    engine = LLMEngine("tiny", block_size=4, num_blocks=24, attention_backend=backend)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert engine.num_preemptions > 0
    assert [o.token_ids for o in outputs] == hf_reference


def test_per_step_logits_match_hf_forward(prompts):
    engine = LLMEngine("tiny", block_size=3, num_blocks=512, record_logits=True)
    prompt = prompts[4]
    engine.add_request(prompt, SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    seq = engine.finished[0]
    full = torch.tensor([prompt + seq.token_ids[:-1]])
    with torch.no_grad():
        reference = engine.hf_model(full).logits[0, len(prompt) - 1:].float()
    ours = engine.recorded_logits[seq.request_id][0]
    assert torch.allclose(ours, reference, atol=1e-4, rtol=1e-4)


def test_prefix_caching_saves_blocks_and_keeps_outputs():
    generator = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 1024, (64,), generator=generator).tolist()
    prompts = [shared + [1, 2, 3], shared + [4, 5]]
    results = {}
    for caching in (True, False):
        engine = LLMEngine("tiny", block_size=16, num_blocks=64, enable_prefix_caching=caching, max_num_seqs=8)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=8))
        results[caching] = ([o.token_ids for o in outputs], engine.peak_used_blocks,
                            engine.block_manager.prefix_cache_stats.hit_blocks)
    assert results[True][0] == results[False][0]
    assert results[True][2] == 4 and results[False][2] == 0
    assert results[True][1] == results[False][1] - 4


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
@pytest.mark.parametrize("block_size", [1, 3, 7, 16])
@pytest.mark.parametrize("shared_len,tail_len", [(16, 40), (64, 3)], ids=["short-prefix", "long-prefix"])
def test_prefills_after_a_prefix_cache_hit_match_hf_forward(block_size, shared_len, tail_len, in_place, monkeypatch):
    """A prompt whose prefix is cached attends to it from the paged cache: in place on a CPU, or gathered (with a
    prefix shorter than the new tokens the prefix's rows are padded with zero queries and run causally, with a
    longer one under an explicit mask); each gives HF's logits."""
    monkeypatch.setattr("paged_kernels.torch_backend.IN_PLACE_PREFILL_CPU", in_place)
    generator = torch.Generator().manual_seed(block_size * 100 + shared_len)
    shared = torch.randint(0, 1024, (shared_len,), generator=generator).tolist()
    engine = LLMEngine("tiny", block_size=block_size, num_blocks=512, record_logits=True)
    engine.generate([shared + [5]], SamplingParams(max_tokens=1))
    prompt = shared + torch.randint(0, 1024, (tail_len,), generator=generator).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=4))
    cached = engine.block_manager.prefix_cache_stats.hit_blocks * block_size
    assert cached == shared_len // block_size * block_size and (cached < len(prompt) - cached) == (shared_len == 16)
    seq = engine.finished[-1]
    with torch.no_grad():
        reference = engine.hf_model(torch.tensor([prompt + seq.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
    assert torch.allclose(engine.recorded_logits[seq.request_id][0], reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (16, 8, 128), (8, 8, 64)])
@pytest.mark.parametrize("cached,new", [(300, 256), (1000, 257), (513, 300)])
def test_split_prefill_attention_matches_a_float64_reference(dtype, tolerance, heads, kv_heads, head_dim, cached,
                                                             new):
    """A long chunk after a longer cached prefix, on a CPU: two flash passes merged by their log-sum-exps give the
    masked causal attention, by relative error against float64."""
    import types

    from lab.worker.model_runner import _FLASH_ATTENTION_CPU, ModelRunner

    if _FLASH_ATTENTION_CPU is None:
        pytest.skip("this torch has no CPU flash attention with a log-sum-exp; the engine uses the mask")
    q = torch.randn(new, heads, head_dim).to(dtype)
    k, v = (torch.randn(cached + new, kv_heads, head_dim).to(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    out = ModelRunner._split_prefill_attention(types.SimpleNamespace(scale=scale), q, k, v, cached)
    mask = torch.arange(cached + new)[None, :] <= torch.arange(new)[:, None] + cached
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert out.shape == q.shape and out.dtype == dtype
    assert ((out.double() - reference).norm() / reference.norm()).item() < tolerance


def test_chunked_prefill_in_split_attention_matches_hf(monkeypatch, prompts, hf_reference):
    """With every cached chunk sent through the two flash passes (where the in-place CPU prefill attention is not
    built), chunked prefill still gives HF's greedy tokens and per-step logits."""
    import lab.worker.model_runner
    import paged_kernels.torch_backend

    monkeypatch.setattr(paged_kernels.torch_backend, "IN_PLACE_PREFILL_CPU", False)
    monkeypatch.setattr(lab.worker.model_runner, "SPLIT_ATTENTION_MIN_TOKENS", 1)
    calls = []
    split = lab.worker.model_runner.ModelRunner._split_prefill_attention
    monkeypatch.setattr(lab.worker.model_runner.ModelRunner, "_split_prefill_attention",
                        lambda self, *args: calls.append(1) or split(self, *args))
    engine = LLMEngine("tiny", block_size=3, num_blocks=2048, scheduling="chunked", max_num_batched_tokens=13,
                       record_logits=True)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == hf_reference and calls
    seq = next(s for s in engine.finished if len(s.prompt_token_ids) == 71)
    with torch.no_grad():
        full = torch.tensor([seq.prompt_token_ids + seq.token_ids[:-1]])
        reference = engine.hf_model(full).logits[0, len(seq.prompt_token_ids) - 1:].float()
    assert torch.allclose(engine.recorded_logits[seq.request_id][0], reference, atol=1e-4, rtol=1e-4)


def test_parallel_sampling_shares_prompt_blocks_and_copies_on_write():
    engine = LLMEngine("tiny", block_size=8, num_blocks=64)
    prompt = list(range(20))  # 2 full blocks + a partial block of 4
    seen = []
    engine.on_step = lambda stats: seen.append((stats.num_prefill_tokens, stats.blocks_in_use))
    outputs = engine.generate([prompt], SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=5))
    assert len(outputs[0].outputs) == 3
    assert seen[0] == (20, 3)  # the three samples share the prompt's 3 blocks
    assert engine.block_manager.num_cow_copies == 2  # the shared partial block is copied for 2 of the 3 samples
    again = LLMEngine("tiny", block_size=8, num_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=5))
    assert again[0].outputs == outputs[0].outputs
    assert len({tuple(o) for o in outputs[0].outputs}) > 1


def test_sampling_options_and_stop_tokens():
    engine = LLMEngine("tiny", num_blocks=64)
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8))[0].token_ids
    stop = greedy[3]
    stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0].token_ids
    assert stopped == greedy[:greedy.index(stop) + 1]
    top1 = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=3))[0]
    assert top1.token_ids == greedy
    nucleus = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=3))[0]
    assert nucleus.token_ids == greedy


def test_save_pretrained_roundtrip(tmp_path, prompts, hf_reference):
    engine = LLMEngine("tiny", num_blocks=256)
    engine.hf_model.save_pretrained(tmp_path)
    loaded = LLMEngine(str(tmp_path), num_blocks=256)
    outputs = loaded.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == hf_reference
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: corrupt
    with pytest.raises(CheckpointError, match="weights could not be loaded"):
        LLMEngine(str(tmp_path), num_blocks=256)


def test_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="neither a preset"):
        LLMEngine(str(tmp_path / "absent"))
    with pytest.raises(CheckpointError, match="no config.json"):
        LLMEngine(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="expected 'qwen3'"):
        LLMEngine(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        LLMEngine(str(tmp_path))
    engine = LLMEngine("tiny", block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="34 KV tokens does not fit the KV pool of 32 token slots"):
        engine.add_request(list(range(30)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("hello")
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([5000])
    assert not engine.has_unfinished()


def test_metrics_export(prompts):
    engine = LLMEngine("tiny", num_blocks=256)
    engine.generate(prompts, SamplingParams(max_tokens=4))
    table = engine.request_metrics()
    assert list(table.columns) == ["request_id", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s"]
    assert len(table) == len(prompts) and (table["ttft_s"] > 0).all()
    summary = engine.run_metrics()
    assert summary["output_tokens"] == 4 * len(prompts) and summary["peak_kv_blocks"] > 0
    assert summary["peak_memory_bytes"] > 0


GPU_MODES = [dict(), dict(scheduling="chunked", max_num_batched_tokens=13),
             dict(preemption_mode="swap", num_blocks=24, block_size=4),
             dict(preemption_mode="swap", num_blocks=24, block_size=4, num_cpu_blocks=16, kv_offload_blocks=8)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto", "cupy"])
@pytest.mark.parametrize("modes", GPU_MODES, ids=["plain", "chunked", "swap", "swap-tier"])
def test_gpu_greedy_parity_fp32(prompts, backend, modes):
    """On CUDA, fp32: greedy tokens equal HF generate, also under chunked prefill and swap preemption (device <->
    pinned host). ``cupy`` needs head_dim 64+, so it runs the tiny-hd64 preset; ``auto`` on the tiny preset uses
    CuPy for cache writes and torch for attention."""
    import paged_kernels

    if backend == "cupy" and "cupy" not in paged_kernels.available_backends():
        pytest.skip("cupy backend unavailable")
    model = "tiny-hd64" if backend == "cupy" else "tiny"
    settings = {"block_size": 16, "num_blocks": 512, **modes}
    engine = LLMEngine(model, device="cuda", dtype=torch.float32, attention_backend=backend, **settings)
    expected = [engine.hf_model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                                         min_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    if modes.get("preemption_mode") == "swap":
        assert engine.scheduler.num_swaps_out > 0
    if modes.get("kv_offload_blocks"):  # one pinned host pool for swapped sequences and the tier's stores
        assert engine.block_manager.offload.stats.stored_blocks > 0


@pytest.mark.gpu
def test_gpu_seeded_sampling(prompts):
    """On CUDA, requests with temperature, top-k, top-p and parallel samples (copy-on-write forks) draw from each
    sample's own CUDA generator: the same seeds give the same tokens on a second engine, every token in the vocab."""
    params = [SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, top_k=20, top_p=0.9, seed=1, ignore_eos=True)]
    runs = []
    for _ in range(2):
        engine = LLMEngine("tiny", device="cuda", dtype=torch.float32, num_blocks=256, block_size=4)
        outputs = engine.generate(prompts[:2], params)
        runs.append([o.outputs for o in outputs])
        assert engine.block_manager.num_free_blocks == 256 and engine.block_manager.num_cow_copies > 0
    assert runs[0] == runs[1]
    vocab = engine.hf_model.config.vocab_size
    assert all(0 <= token < vocab for samples in runs[0] for tokens in samples for token in tokens)
    assert len(runs[0][0]) == 3 and all(len(tokens) == 6 for tokens in runs[0][0])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_gpu_bf16_logits_close(prompts, backend):
    import paged_kernels

    if backend not in paged_kernels.available_backends():
        pytest.skip(f"{backend} backend unavailable")
    model = "tiny-hd64" if backend == "cupy" else "tiny"  # the cupy attention kernel needs head_dim 64+
    engine = LLMEngine(model, device="cuda", dtype=torch.bfloat16, attention_backend=backend, num_blocks=512,
                       record_logits=True)
    prompt = prompts[4]
    engine.generate([prompt], SamplingParams(max_tokens=4))
    seq = engine.finished[0]
    with torch.no_grad():
        reference = engine.hf_model(torch.tensor([prompt + seq.token_ids[:-1]], device="cuda")).logits[0].float()
    ours = engine.recorded_logits[seq.request_id][0].cuda()
    error = (ours - reference[len(prompt) - 1:]).abs().max() / reference.abs().max()
    assert error < 5e-2


@pytest.fixture(scope="module")
def greedy_reference():
    """HF greedy continuations, memoised by prompt."""
    engine = LLMEngine("tiny", num_blocks=8)
    cache = {}

    def reference(prompt, max_tokens):
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = engine.hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                                  min_new_tokens=max_tokens, do_sample=False)[0, len(prompt):].tolist()
        return cache[key]
    return reference


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block_size=st.sampled_from([1, 2, 3, 5, 16]), caching=st.booleans(), n=st.integers(1, 2),
       pool_slack=st.integers(0, 30), data=st.data())
def test_fuzzed_schedules_match_hf_and_free_everything(greedy_reference, block_size, caching, n, pool_slack, data):
    shared = data.draw(st.lists(st.integers(0, 1023), min_size=0, max_size=20))
    tails = data.draw(st.lists(st.lists(st.integers(0, 1023), min_size=1, max_size=15), min_size=1, max_size=4))
    prompts = [shared + tail for tail in tails]
    max_tokens = 6
    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = -(-longest // block_size) + n + pool_slack  # at least one request always fits
    engine = LLMEngine("tiny", block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, n=n))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs == [greedy_reference(prompt, max_tokens)] * n
    manager = engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_physical_blocks and not manager.sequences


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_chunked_prefill_matches_hf(prompts, hf_reference, block_size):
    """A 13-token budget spreads the longer prompts over several steps, each chunk attending to the earlier
    chunks' K/V in the paged cache."""
    engine = LLMEngine("tiny", block_size=block_size, num_blocks=4096 // block_size + 8, scheduling="chunked",
                       max_num_batched_tokens=13)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == hf_reference
    steps = engine.step_log()
    assert ((steps["num_prefill_tokens"] > 0) & (steps["num_decode_seqs"] > 0)).any()  # mixed steps
    assert steps["num_prefill_tokens"].max() <= 13


def test_chunked_prefill_logits_match_hf_forward(prompts):
    engine = LLMEngine("tiny", block_size=3, num_blocks=512, record_logits=True, scheduling="chunked",
                       max_num_batched_tokens=7)
    prompt = prompts[4]
    engine.generate([prompt], SamplingParams(max_tokens=6))
    seq = engine.finished[0]
    with torch.no_grad():
        reference = engine.hf_model(torch.tensor([prompt + seq.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
    assert torch.allclose(engine.recorded_logits[seq.request_id][0], reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheduling", ["prefill-first", "chunked"])
def test_swap_preemption_in_a_tiny_pool_matches_hf(prompts, hf_reference, scheduling):
    engine = LLMEngine("tiny", block_size=4, num_blocks=24, preemption_mode="swap", scheduling=scheduling,
                       max_num_batched_tokens=32)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert engine.scheduler.num_swaps_out > 0 and engine.step_log()["num_swapped_in"].sum() > 0
    assert [o.token_ids for o in outputs] == hf_reference
    policy = engine.policy
    assert policy.manager.num_free_blocks == policy.manager.num_physical_blocks
    assert policy.cpu_manager.num_free_blocks == policy.cpu_manager.num_physical_blocks
    policy.manager.check_invariants()
    policy.cpu_manager.check_invariants()


def test_engine_kernel_calls_pass_the_checks_they_skip(monkeypatch, prompts):
    """The engine calls the kernels with check=False: the block manager must never hand one slot to two tokens of a
    step, and the decode calls' host-side max_seq_len must be their seq_lens' maximum (run here with the checks)."""
    import paged_kernels

    real_write, real_decode, decode_calls = paged_kernels.write_kv_cache, paged_kernels.paged_attention_decode, []

    def checked_write(key, value, key_cache, value_cache, slot_mapping, backend="auto", check=True):
        used = slot_mapping[slot_mapping >= 0]
        assert used.unique().numel() == used.numel()
        return real_write(key, value, key_cache, value_cache, slot_mapping, backend=backend, check=check)

    def checked_decode(*args, check=True, **named):
        decode_calls.append(named["max_seq_len"])
        return real_decode(*args, check=True, **named)

    monkeypatch.setattr(paged_kernels, "write_kv_cache", checked_write)
    monkeypatch.setattr(paged_kernels, "paged_attention_decode", checked_decode)
    engine = LLMEngine("tiny", block_size=3, num_blocks=40, scheduling="chunked", max_num_batched_tokens=16)
    engine.generate(prompts + prompts[:2], SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=1))
    assert engine.num_preemptions > 0 and decode_calls and min(decode_calls) > 0


@pytest.mark.parametrize("settings,message", [
    (dict(block_size=0), "block_size=0"), (dict(block_size=2.5), "block_size=2.5"),
    (dict(num_blocks=-3), "num_blocks=-3"), (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization"), (dict(blocksize=16), "unknown"),
    (dict(scheduling="greedy"), "scheduling must be one of"), (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(max_num_seqs=0), "max_num_seqs"),
])
def test_engine_settings_are_checked_before_anything_loads(settings, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine("tiny", **settings)


@pytest.mark.parametrize("params,message", [
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(top_k=2.5), "top_k"), (dict(n=2.0), "n=2.0"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens="8"), "max_tokens"),
])
def test_bad_sampling_params_change_nothing_and_the_engine_still_works(params, message):
    engine = LLMEngine("tiny", num_blocks=64)
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2, 3], [4, 5]], [SamplingParams(), SamplingParams(**params)])
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == 64
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate([[1, 2, 3], [4, 5]], [SamplingParams()])
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_a_step_that_reads_nothing_back_waits_for_the_device(monkeypatch):
    """On a GPU a step's work is queued, and it is done when something is read back: the next tokens. A step that
    reads nothing back (a prompt chunk that samples nothing) must wait for the device before it takes its times, or
    its duration and a first token's time would end before its work did; a step of sampled rows reads them back."""
    waits = []
    engine = LLMEngine("tiny", num_blocks=64, scheduling="chunked", max_num_batched_tokens=8)
    monkeypatch.setattr(engine.runner, "synchronize", lambda: waits.append(time.perf_counter()))
    engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=2, ignore_eos=True))  # chunks of 8, 8 and 4
    engine.step(), engine.step()
    assert len(waits) == 2, "the middle chunks sample nothing"
    engine.step()
    assert len(waits) == 2, "the last chunk reads its greedy token back"
    sampled = LLMEngine("tiny", num_blocks=64)
    monkeypatch.setattr(sampled.runner, "synchronize", lambda: waits.append(time.perf_counter()))
    sampled.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0.8, seed=0))
    assert len(waits) == 2


def test_a_step_reads_its_tokens_back_once(monkeypatch):
    """Every read of a device tensor waits for the GPU: a step with greedy rows, sampled rows and parallel samples
    reads all its next tokens with one ``tolist`` and no ``int``/``item`` (counted where the engine, its sampler and its runner read; the CPU
    kernels' own reads of host tensors are theirs), and draws the same tokens as reading each one back would (each
    sample's own seeded generator, in row order)."""
    engine = LLMEngine("tiny", num_blocks=128)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=7),
              SamplingParams(max_tokens=4, temperature=0.7, top_k=50, top_p=0.9, seed=2)]
    for prompt, sampling in zip(prompts, params):
        engine.add_request(prompt, sampling)
    reads = []
    STEP_FILES = {module.__file__ for module in (lab.engine.llm_engine, lab.engine.sampler, lab.worker.model_runner)}

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args):
            if sys._getframe(1).f_code.co_filename in STEP_FILES:
                reads.append(name)
            return original(self, *args)
        return read
    for name in ("tolist", "item", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    while engine.has_unfinished():
        reads.clear()
        engine.step()
        assert reads == ["tolist"], reads
    monkeypatch.undo()
    outputs = sorted(engine.finished, key=lambda output: output.request_id)
    for output, prompt, sampling in zip(outputs, prompts, params):
        seeds = range(sampling.n) if sampling.temperature else [None]
        for sample, tokens in zip(seeds, output.outputs):
            assert tokens == draw_one_by_one(engine, prompt, sampling, sample)


def draw_one_by_one(engine, prompt, params, sample):
    """The tokens of one sample drawn as before the single read-back: the full forward, then ``int`` of each pick."""
    generator = torch.Generator().manual_seed(params.seed + sample) if sample is not None else None
    tokens = []
    for _ in range(params.max_tokens):
        logits = engine.hf_model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        if generator is None:
            tokens.append(int(logits.argmax()))
            continue
        logits = logits / params.temperature
        if params.top_k:
            logits = logits.masked_fill(logits < torch.topk(logits, params.top_k).values[-1], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1:
            ordered, order = torch.sort(probs, descending=True)
            probs = probs.scatter(0, order, ordered.masked_fill(torch.cumsum(ordered, 0) - ordered > params.top_p, 0))
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens

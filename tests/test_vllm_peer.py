"""vLLM itself beside the lab: the shared checkpoint loads in our engine, HF and vLLM; greedy tokens agree in fp32;
vLLM V1's own step log (recorded from its scheduler) against our scheduler's, step by step. vLLM is started twice
per module (two pool sizes); without the peer (``bash scripts/vllm_peer.sh``) the vLLM tests skip with that command
as the reason."""
import random

import pytest
import torch

from lab.engine import LLMEngine
from lab.model import save_checkpoint
from lab.peer import (PeerError, PeerSettings, VLLMPeer, compare_step_logs, missing_reason, our_step_table, serve,
                      vllm_step_table)

needs_peer = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
BLOCK_SIZE, BUDGET, MAX_SEQS = 32, 512, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "checkpoint", torch.float32)


def workload(seed: int = 0, count: int = 12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(20, 200))] for _ in range(count)]
    return prompts, [rng.randint(10, 60) for _ in prompts]


def shared_prefix_workload(count: int = 12):
    """Prompts that share a 100-token system prompt (3 full blocks of 32, then a partial one)."""
    rng = random.Random(1)
    prefix = [rng.randrange(1024) for _ in range(100)]
    prompts = [prefix + [rng.randrange(1024) for _ in range(rng.randint(20, 120))] for _ in range(count)]
    return prompts, [rng.randint(10, 40) for _ in prompts]


def test_the_shared_checkpoint_is_the_preset(checkpoint):
    """Saved, it loads in our engine and in HF transformers with the preset's weights and a tokenizer of its own."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    prompt = [[7, 8, 9, 10, 11]]
    preset = LLMEngine("tiny", block_size=BLOCK_SIZE).generate(prompt)[0].outputs
    saved = LLMEngine(str(checkpoint), block_size=BLOCK_SIZE)
    assert saved.generate(prompt)[0].outputs == preset
    hf = Qwen3ForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    greedy = hf.generate(torch.tensor(prompt), max_new_tokens=len(preset[0]), do_sample=False)[0, 5:].tolist()
    assert [greedy] == preset
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    assert tokenizer("t7 t8 t9")["input_ids"] == [7, 8, 9] and tokenizer.decode([3, 4]) == "t3 t4"


def test_a_missing_peer_is_named_with_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIPAGED_VLLM_VENV", str(tmp_path / "nowhere"))
    assert "scripts/vllm_peer.sh" in missing_reason()
    with pytest.raises(PeerError, match="vllm_peer.sh"):
        VLLMPeer(PeerSettings(str(tmp_path)))


@pytest.fixture(scope="module")
def vllm_runs(checkpoint):
    """vLLM on the tiny checkpoint (fp32), prefix caching on, each run on a cold cache: random prompts all at once and
    staggered, shared prefixes all at once and staggered on a large pool; random prompts on a pool small enough to
    preempt, prefix caching off (with it on, a request resumed after preemption hits one cached block more in vLLM
    than in ours: docs/vllm.md). Two vLLM starts for the module (a pool's size is fixed when vLLM starts)."""
    prompts, max_tokens = workload()
    runs = {}
    with VLLMPeer(PeerSettings(str(checkpoint), num_blocks=256, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET,
                               enable_prefix_caching=True)) as peer:
        runs["all at once"] = peer.run(prompts, max_tokens)
        runs["staggered"] = peer.run(prompts, max_tokens, [3 * i for i in range(len(prompts))])
        runs["shared prefix"] = peer.run(*shared_prefix_workload())
        runs["shared prefix, staggered"] = peer.run(*shared_prefix_workload(), [4 * i for i in range(12)])
    with VLLMPeer(PeerSettings(str(checkpoint), num_blocks=12, max_model_len=256, max_num_seqs=MAX_SEQS,
                               max_num_batched_tokens=BUDGET, enable_prefix_caching=False)) as peer:
        runs["small pool"] = peer.run(prompts, max_tokens)
    return runs


def ours(checkpoint, num_blocks: int, arrival_steps=None, max_model_len=None, scheduling="vllm"):
    """Our engine with the peer's settings: the vllm policy, prefix caching as the peer of that pool size has it, and
    one block fewer than vLLM's count (vLLM's block pool keeps block 0 as its null block: ``BlockPool.__init__``,
    vllm/v1/core/block_pool.py)."""
    caching = num_blocks > 12  # the small pool's peer runs without prefix caching
    engine = LLMEngine(str(checkpoint), block_size=BLOCK_SIZE, num_blocks=num_blocks - 1, max_num_seqs=MAX_SEQS,
                       max_num_batched_tokens=BUDGET, scheduling=scheduling, enable_prefix_caching=caching,
                       max_model_len=max_model_len)
    prompts, max_tokens = workload()
    return engine, serve(engine, prompts, max_tokens, arrival_steps)


@needs_peer
@pytest.mark.parametrize("case, blocks, arrivals, max_model_len", [
    ("all at once", 256, None, None), ("staggered", 256, [3 * i for i in range(12)], None),
    ("small pool", 12, None, 256)])
def test_greedy_tokens_agree_with_vllm_in_fp32(checkpoint, vllm_runs, case, blocks, arrivals, max_model_len):
    _, run = ours(checkpoint, blocks, arrivals, max_model_len)
    theirs = vllm_runs[case]["outputs"]
    agree = sum(a == b for x, y in zip(run["outputs"], theirs) for a, b in zip(x, y))
    total = sum(len(y) for y in theirs)
    print(f"{case}: {agree} of {total} greedy tokens agree")
    assert agree == total  # fp32, the same weights: equal but for near-ties, and this workload has none


@needs_peer
@pytest.mark.parametrize("case, blocks, arrivals, max_model_len", [
    ("all at once", 256, None, None), ("staggered", 256, [3 * i for i in range(12)], None),
    ("small pool", 12, None, 256)])
def test_vllm_s_step_log_is_ours_step_for_step(checkpoint, vllm_runs, case, blocks, arrivals, max_model_len):
    """Tokens scheduled, running and waiting requests, finishes and preemptions of every step equal vLLM V1's own
    (the vllm policy: decodes first, then prompt chunks in the token budget, a prompt admitted when its blocks fit,
    as vllm/v1/core/sched/scheduler.py), a pool small enough to preempt included."""
    engine, _ = ours(checkpoint, blocks, arrivals, max_model_len)
    table = compare_step_logs(our_step_table(engine.step_log()), vllm_step_table(vllm_runs[case]["steps"]))
    assert table["same"].all(), table[~table["same"]].head().to_string()
    if case == "small pool":
        assert table["preempted_ours"].sum() > 0


@needs_peer
@pytest.mark.parametrize("case, arrivals", [("shared prefix", None),
                                            ("shared prefix, staggered", [4 * i for i in range(12)])])
def test_with_prefix_caching_the_step_logs_and_tokens_agree(checkpoint, vllm_runs, case, arrivals):
    """Shared prefixes with prefix caching on in both: vLLM schedules only the tokens its cache misses, so equal
    scheduled tokens per step mean equal cache hits."""
    engine = LLMEngine(str(checkpoint), block_size=BLOCK_SIZE, num_blocks=255, max_num_seqs=MAX_SEQS,
                       max_num_batched_tokens=BUDGET, scheduling="vllm", enable_prefix_caching=True)
    run = serve(engine, *shared_prefix_workload(), arrivals)
    assert run["outputs"] == vllm_runs[case]["outputs"]
    table = compare_step_logs(our_step_table(engine.step_log()), vllm_step_table(vllm_runs[case]["steps"]))
    assert table["same"].all(), table[~table["same"]].head().to_string()
    assert engine.run_metrics()["prefix_hit_rate"] > 0


@needs_peer
def test_the_chunked_policy_parts_from_vllm_only_under_memory_pressure(checkpoint, vllm_runs):
    """Our chunked policy also reserves a prompt's first decode block when it admits it: identical to vLLM on a large
    pool, it keeps a request waiting that vLLM admits (and later preempts for) on a small one."""
    for case, blocks, max_model_len, identical in (("all at once", 256, None, True), ("small pool", 12, 256, False)):
        engine, _ = ours(checkpoint, blocks, None, max_model_len, scheduling="chunked")
        table = compare_step_logs(our_step_table(engine.step_log()), vllm_step_table(vllm_runs[case]["steps"]))
        assert table["same"].all() == identical

"""vLLM itself beside the lab: the shared checkpoint loads in our engine, HF and vLLM; greedy tokens agree in fp32;
vLLM V1's own step log (recorded from its scheduler) against our scheduler's, step by step. vLLM is started once
per test session (one pool; prefix caching on); without the peer (``bash scripts/vllm_peer.sh``) the vLLM tests skip with that command
as the reason."""
import random
from pathlib import Path

import pandas as pd
import pytest
import torch

from lab.engine import LLMEngine
from lab.models.qwen3 import save_checkpoint
from lab.peer.client import (STEP_FIELDS, PeerError, PeerSettings, VLLMPeer, compare_step_logs, count_requests,
                             first_divergence, missing_reason, our_step_table, serve, vllm_step_table)
from lab.peer.fuzz import Differential, load_cases, random_workload

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


NUM_BLOCKS = 96  # vLLM's count: 95 usable (block 0 is its null block), 3,040 token slots


def preempting_workload():
    """16 prompts whose KV outgrows the pool together (16 x ~280 tokens against 3,040 slots): preemptions."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(150, 250))] for _ in range(16)]
    return prompts, [rng.randint(60, 100) for _ in prompts]


# name -> (prompts and max_tokens, arrival steps, long-prefill threshold)
CASES = {"all at once": (workload(), None, None),
         "staggered": (workload(), [3 * i for i in range(12)], None),
         "shared prefix": (shared_prefix_workload(), None, None),
         "shared prefix, staggered": (shared_prefix_workload(), [4 * i for i in range(12)], None),
         "preempting": (preempting_workload(), None, None),
         "long prefills capped": (workload(), [2 * i for i in range(12)], 48)}


@pytest.fixture(scope="module")
def vllm_runs(checkpoint):
    """vLLM on the tiny checkpoint (fp32), prefix caching on, started once: every case of ``CASES`` on a cold cache
    (the driver resets it per run), the long-prefill threshold set per run."""
    with VLLMPeer(PeerSettings(str(checkpoint), num_blocks=NUM_BLOCKS, max_num_seqs=MAX_SEQS,
                               max_num_batched_tokens=BUDGET, enable_prefix_caching=True)) as peer:
        return {case: peer.run(*requests, arrivals, long_prefill_token_threshold=threshold)
                for case, (requests, arrivals, threshold) in CASES.items()}


def ours(checkpoint, case: str, scheduling: str = "vllm"):
    """Our engine on ``case`` with the peer's settings: prefix caching on, one block fewer than vLLM's count
    (vLLM's block pool keeps block 0 as its null block: ``BlockPool.__init__``, vllm/v1/core/block_pool.py); its
    run and step table."""
    requests, arrivals, threshold = CASES[case]
    engine = LLMEngine(str(checkpoint), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS - 1, max_num_seqs=MAX_SEQS,
                       max_num_batched_tokens=BUDGET, scheduling=scheduling, enable_prefix_caching=True,
                       long_prefill_token_threshold=threshold or 0)
    run = serve(engine, *requests, arrivals)
    return run, our_step_table(engine.step_log(), run["steps"])


@needs_peer
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_agree_with_vllm_in_fp32(checkpoint, vllm_runs, case):
    run, _ = ours(checkpoint, case)
    theirs = vllm_runs[case]["outputs"]
    agree = sum(a == b for x, y in zip(run["outputs"], theirs) for a, b in zip(x, y))
    total = sum(len(y) for y in theirs)
    print(f"{case}: {agree} of {total} greedy tokens agree")
    assert agree == total  # fp32, the same weights: equal but for near-ties, and these workloads have none


@needs_peer
@pytest.mark.parametrize("case", list(CASES))
def test_vllm_s_step_log_is_ours_step_for_step(checkpoint, vllm_runs, case):
    """Tokens scheduled (per request), running and waiting requests, finishes, preemptions and blocks in use of
    every step equal vLLM V1's own (the vllm policy: decodes first, then prompt chunks in the token budget, a prompt
    admitted when its blocks fit, as vllm/v1/core/sched/scheduler.py), with prefix caching on: vLLM schedules only
    the tokens its cache misses, so equal scheduled tokens mean equal hits, a request's own blocks after its
    preemption included."""
    _, table = ours(checkpoint, case)
    table = compare_step_logs(table, vllm_step_table(vllm_runs[case]["steps"], NUM_BLOCKS))
    print(f"{case}: {table['same'].sum()} of {len(table)} steps identical, "
          f"{count_requests(table['preempted_ours'])} preemptions")
    assert table["same"].all(), first_divergence(table)
    assert (count_requests(table["preempted_ours"]) > 0) == (case == "preempting")


@needs_peer
@pytest.mark.parametrize("case", ["all at once", "preempting"])
def test_the_chunked_policy_takes_a_prompt_s_blocks_up_front(checkpoint, vllm_runs, case):
    """Our chunked policy allocates a prompt's blocks (and its first decode's) when it admits it, vLLM a chunk's as
    it schedules it: on these workloads the same schedule as vLLM's, with more blocks in use while a prompt is
    partly prefilled (and never fewer)."""
    _, table = ours(checkpoint, case, scheduling="chunked")
    table = compare_step_logs(table, vllm_step_table(vllm_runs[case]["steps"], NUM_BLOCKS))
    for field in STEP_FIELDS:
        if field != "blocks_in_use":
            assert (table[f"{field}_ours"] == table[f"{field}_vllm"]).all(), field
    assert (table["blocks_in_use_ours"] >= table["blocks_in_use_vllm"]).all()
    assert (table["blocks_in_use_ours"] > table["blocks_in_use_vllm"]).any()


@needs_peer
@pytest.mark.parametrize("case", list(CASES))
def test_vllm_s_step_quantities_are_our_plans(checkpoint, vllm_runs, case):
    """What the vLLM profile reads from vLLM's step record (``lab.peer.profiling.step_quantities``: prefill tokens and
    chunks, decode batch, KV tokens read, attention pairs, logit rows) equals what our profile reads from our plan of
    the same step (``plan_quantities``), preemptions and prefix hits included; the idle time and the previous step's
    prefill are the caller's, compared apart."""
    from lab.peer.profiling import run_quantities
    from lab.profiling.profile import QUANTITIES

    run, _ = ours(checkpoint, case)
    requests = CASES[case][0][0]
    theirs = run_quantities(vllm_runs[case]["steps"], [len(prompt) for prompt in requests], BLOCK_SIZE)
    mine = [run["steps"][step]["quantities"] for step in sorted(run["steps"])]
    assert len(theirs) == len(mine)
    skip = {QUANTITIES.index("idle_s"), QUANTITIES.index("previous_prefill_tokens")}
    for index, ((quantities, seconds), expected) in enumerate(zip(theirs, mine)):
        assert seconds > 0
        assert [q for i, q in enumerate(quantities) if i not in skip] == \
            [q for i, q in enumerate(expected) if i not in skip], f"step {index + 1}"
    previous = [q[QUANTITIES.index("previous_prefill_tokens")] for q, _ in theirs]
    assert previous[1:] == [q[QUANTITIES.index("prefill_tokens")] for q, _ in theirs][:-1] and previous[0] == 0


PRESSURE_CASES = load_cases(Path(__file__).parent / "data" / "vllm_pressure_cases.json")
PRESSURE_SHAPE = next(iter(PRESSURE_CASES.values()))[0]  # one pool shape: one more vLLM start
CI_FUZZ_RUNS = 8  # seeded random workloads per test session (``python -m lab peer fuzz --runs N`` for more)


@pytest.fixture(scope="module")
def pressure(checkpoint):
    """Both engines on a short pool (23 usable blocks of 32: a 700-token prompt fills a third of it)."""
    with Differential(str(checkpoint), PRESSURE_SHAPE) as differential:
        yield differential


@needs_peer
@pytest.mark.parametrize("case", list(PRESSURE_CASES))
def test_a_named_case_under_pressure_is_vllm_s_step_for_step(pressure, case):
    """Each difference the differential fuzz found, shrunk to the fewest requests and tokens that differed (its
    ``why`` in tests/data/vllm_pressure_cases.json): now every step is vLLM's, which requests were admitted,
    preempted and finished included, and every greedy token."""
    shape, workload = PRESSURE_CASES[case]
    assert shape == PRESSURE_SHAPE
    verdict = pressure.run(workload)
    assert verdict.same, verdict.first_difference


@needs_peer
def test_random_workloads_under_pressure_are_vllm_s_step_for_step(pressure):
    """Seeded random workloads on the short pool (``lab.peer.fuzz.random_workload``): every step identical, and
    the family does press the pool (preemptions happen)."""
    verdicts = [pressure.run(random_workload(PRESSURE_SHAPE, seed)) for seed in range(CI_FUZZ_RUNS)]
    differing = [(seed, v.first_difference) for seed, v in enumerate(verdicts) if not v.same]
    print(f"{len(verdicts)} workloads, {sum(v.steps for v in verdicts)} steps, "
          f"{sum(v.preemptions for v in verdicts)} preemptions")
    assert not differing, differing
    assert sum(v.preemptions for v in verdicts) > 0


def test_the_step_comparison_names_the_first_differing_field():
    ours = pd.DataFrame({"step": [1, 2], "scheduled_tokens": [5, 1], "per_request": ["0:5", "0:1"],
                         "running": [1, 1], "waiting": [0, 0], "admitted": ["0", ""], "preempted": ["", "0"],
                         "finished": ["", ""], "blocks_in_use": [1, 1]})
    theirs = ours.assign(preempted=["", "1"])
    table = compare_step_logs(ours, theirs)
    assert list(table["same"]) == [True, False] and table.loc[1, "first_difference"] == "preempted"
    assert first_divergence(table) == "step 2: preempted differs (ours '0', vLLM '1')"
    assert first_divergence(compare_step_logs(ours, ours)) is None

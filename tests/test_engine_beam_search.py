"""Beam search on the paged engine: HF parity (fp32, block sizes 1, 3, 16; on CUDA too), shared blocks freed at the
end."""
import pytest
import torch

from lab.engine.beam import BeamRanking, BeamSearchParams
from lab.engine import LLMEngine
from lab.engine.sampler import SamplingParams

PROMPTS = [[5, 17, 300, 2, 9, 41, 8], list(range(100, 119)), [7]]


def hf_beams(engine, prompt, width, max_tokens, **options):
    out = engine.hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                   do_sample=False, max_new_tokens=max_tokens, output_scores=True,
                                   return_dict_in_generate=True, **options)
    return [row[len(prompt):].tolist() for row in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("width", [2, 4])
def test_beams_match_hf_without_eos(block_size, width):
    engine = LLMEngine("tiny", num_blocks=256, block_size=block_size)
    results = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        expected, scores = hf_beams(engine, prompt, width, 8, min_new_tokens=8)
        assert [s.token_ids for s in result.sequences] == expected
        assert [s.score for s in result.sequences] == pytest.approx(scores, abs=1e-3)
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_physical_blocks and not manager.sequences
    assert manager.num_cow_copies > 0 or block_size == 1  # forked beams copied their shared partial block
    manager.check_invariants()


def test_candidates_are_ranked_on_the_logits_device():
    """The ranking builds its tensors where the logits live: a CPU tensor of beam scores added to a GPU's logits
    raises. The meta device stands in for a GPU here (the same device check, no data)."""
    from lab.engine.beam import top_candidates

    for count in (1, 2):  # one beam: HF's first step pads the rest at -1e9
        values, indices = top_candidates([0.0] * count, torch.empty(count, 50, device="meta"), width=2, count=4)
        assert values.device.type == indices.device.type == "meta" and values.shape == (4,)


@pytest.mark.gpu
def test_gpu_beams_match_hf():
    engine = LLMEngine("tiny", device="cuda", dtype=torch.float32, num_blocks=256, block_size=3)
    results = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        out = engine.hf_model.generate(torch.tensor([prompt], device="cuda"), num_beams=3, num_return_sequences=3,
                                       do_sample=False, max_new_tokens=6, min_new_tokens=6)
        assert [s.token_ids for s in result.sequences] == [row[len(prompt):].tolist() for row in out]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_physical_blocks


def test_best_beam_matches_hf_with_eos_and_early_stopping():
    engine = LLMEngine("tiny", num_blocks=256, block_size=4)
    prompt = PROMPTS[0]
    greedy = engine.hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
    eos = int(greedy[2])  # a token the search meets early
    engine.eos_token_ids = {eos}
    result = engine.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10))[0]
    expected, _ = hf_beams(engine, prompt, 3, 10, eos_token_id=eos, pad_token_id=eos, early_stopping=True)
    best = expected[0]
    best = best[:best.index(eos) + 1] if eos in best else best
    assert result.sequences[0].token_ids == best
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_physical_blocks


@pytest.mark.parametrize("params,message", [(BeamSearchParams(0, 4), "beam_width"),
                                            (BeamSearchParams(2, 0), "max_tokens"),
                                            (BeamSearchParams(2, 4, length_penalty=float("nan")), "length_penalty"),
                                            (BeamSearchParams(64, 40), "fit the KV pool .* together")])
def test_bad_beam_search_requests_run_nothing(params, message):
    engine = LLMEngine("tiny", num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match=message):
        engine.beam_search([[1, 2, 3]], params)
    assert engine.block_manager.num_free_blocks == 32


def test_beams_report_their_block_sharing():
    from lab.engine.beam import memory_saving

    engine = LLMEngine("tiny", num_blocks=256, block_size=4)
    result = engine.beam_search([list(range(40))], BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))[0]
    assert len(result.block_usage) == 12
    assert all(shared <= copies for shared, copies in result.block_usage)
    assert 0.5 < memory_saving(result.block_usage) < 1  # the 40-token prompt's 10 blocks are held once, not 4 times


MIXED = [(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=7, ignore_eos=True)),
         (PROMPTS[1], SamplingParams(max_tokens=9, ignore_eos=True)),
         (PROMPTS[2], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)),
         (list(range(40, 71)), SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=3, ignore_eos=True)),
         ([9, 8, 7, 6], BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))]


def outputs_of(results):
    """Each request's tokens, and its beams' scores (batching changes fp32 sums in their last bits)."""
    return [(o.outputs, [round(b.score, 4) for b in o.beams.sequences] if o.beams else None) for o in results]


@pytest.mark.parametrize("modes", [dict(), dict(scheduling="chunked", max_num_batched_tokens=24),
                                   dict(num_blocks=24), dict(num_blocks=24, preemption_mode="swap"),
                                   dict(num_blocks=18, scheduling="chunked", max_num_batched_tokens=16)],
                         ids=["prefill-first", "chunked", "recompute", "swap", "chunked-recompute"])
def test_beam_and_sampling_requests_share_batches(modes, monkeypatch):
    """Beam searches are requests of the shared scheduler: batched with sampling requests (one step decodes both),
    preempted like them (a recomputed search restarts from its prompt, a swapped one resumes), each request's result
    equal to its solo run, the beams to HF's."""
    options = dict(block_size=3, num_blocks=256) | modes
    solo_engine = LLMEngine("tiny", block_size=3, num_blocks=256)
    solo = [outputs_of(solo_engine.generate([prompt], [params]))[0] for prompt, params in MIXED]
    engine = LLMEngine("tiny", **options)
    seen = set()

    def kinds(_stats):
        plan = engine.last_plan
        seqs = list(plan.decode_seqs or ()) + [chunk.seq for chunk in plan.prefill_chunks]
        if len({seq.group.beam is None for seq in seqs}) == 2:
            seen.add(plan.step)

    engine.on_step = kinds
    restarts = []
    original = BeamRanking.restart
    monkeypatch.setattr(BeamRanking, "restart", lambda self, seqs: (restarts.append(len(seqs)), original(self, seqs)))
    assert outputs_of(engine.generate([p for p, _ in MIXED], [sp for _, sp in MIXED])) == solo
    assert len(seen) >= 3  # steps that ran beams and samples together
    if "num_blocks" in modes:
        assert engine.num_preemptions > 0
        swap = modes.get("preemption_mode") == "swap"
        assert engine.scheduler.num_swaps_out > 0 if swap else restarts  # a recomputed search restarts
    for (prompt, params), (outputs, scores) in zip(MIXED, solo):
        if scores is not None:
            expected, hf_scores = hf_beams(engine, prompt, params.beam_width, params.max_tokens,
                                           min_new_tokens=params.max_tokens)
            assert outputs == expected and scores == pytest.approx(hf_scores, abs=1e-3)
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_physical_blocks
    manager.check_invariants()

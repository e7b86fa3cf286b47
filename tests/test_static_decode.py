"""Decode steps through the static buffers a CUDA graph replays: on a CPU, run eagerly against the plain forward
while the batch shrinks and under preemption; on the meta device with the CuPy path recorded, nothing is read back
(a read-back cannot be captured); on CUDA (``gpu``), a replay equals the eager forward and HF."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lab.engine import LLMEngine, SamplingParams
from lab.worker.static_decode import StaticDecode


def _requests(count=24, seed=7):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 1024, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 40, (count,), generator=generator)]
    # outputs of 1..count tokens: the decode batch shrinks one sequence at a time down to 1
    return prompts, [SamplingParams(max_tokens=index + 1, ignore_eos=True) for index in range(count)]


def _static(engine: LLMEngine, max_batch: int) -> list[int]:
    """Route the engine's decode steps through eager static buffers; returns the buckets the steps used."""
    engine.runner.static_decode = StaticDecode(engine.runner, max_batch, 512, graphs=False)
    buckets, run = [], engine.runner.static_decode.run

    def counted(step, kv):
        buckets.append(engine.runner.static_decode.bucket(len(step.decode_seq_ids)))
        return run(step, kv)

    engine.runner.static_decode.run = counted
    return buckets


@pytest.mark.parametrize("settings", [dict(), dict(num_blocks=40, preemption_mode="recompute"),
                                      dict(num_blocks=40, preemption_mode="swap"),
                                      dict(scheduling="chunked", max_num_batched_tokens=32)],
                         ids=["plain", "recompute", "swap", "chunked"])
def test_the_padded_path_gives_the_plain_forward_s_tokens(settings):
    prompts, params = _requests()
    plain = LLMEngine("tiny", block_size=3, **{"num_blocks": 512, **settings})
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = LLMEngine(plain.hf_model, block_size=3, **{"num_blocks": 512, **settings})
    buckets = _static(engine, 32)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert {1, 2, 4, 8, 16, 32} & set(buckets) and len(buckets) >= 20  # padded buckets, down to one sequence
    if "preemption_mode" in settings:
        assert engine.num_preemptions > 0


def test_the_static_path_reads_nothing_back_on_the_cuda_code_path():
    """The forward a graph captures, on meta tensors with the CuPy launches recorded: any read of a device value
    (``item``, ``int`` of a tensor) would be an error during capture."""
    from lab.bench.launches import LedgerConfig, _Counter, _meta_runner, _recorded_cupy

    class NoReadBack(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert "_local_scalar_dense" not in func.__name__, f"{func} reads a device value back"
            return func(*args, **(kwargs or {}))

    runner = _meta_runner(LedgerConfig(model="qwen3-0.6b-random"), 600)
    static = StaticDecode(runner, 16, 1024, graphs=False)
    with _recorded_cupy(_Counter()), NoReadBack():
        hidden = static._eager(16, static.max_context)
    assert hidden.shape == (16, runner.hf.config.hidden_size) and hidden.device.type == "meta"


def test_steps_the_buffers_cannot_hold_run_the_plain_forward():
    engine = LLMEngine("tiny", num_blocks=256, block_size=4)
    static = StaticDecode(engine.runner, 4, 16, graphs=False)
    assert static.buckets == [1, 2, 4] and static.bucket(3) == 4
    from lab.worker.model_runner import ModelInput

    step = ModelInput(decode_seq_ids=[0, 1, 2], max_seq_len=16)
    assert static.takes(step)
    assert not static.takes(ModelInput(decode_seq_ids=list(range(5)), max_seq_len=8))  # more sequences
    assert not static.takes(ModelInput(decode_seq_ids=[0], max_seq_len=17))  # a longer context
    assert not static.takes(ModelInput(prefill_seq_ids=[3], decode_seq_ids=[0], max_seq_len=8))  # a prefill


@pytest.fixture
def liveness_checked(monkeypatch):
    """torch's own check (where it has one) that every input of a capture outlives it."""
    monkeypatch.setattr(StaticDecode, "check_liveness", True)


def _cuda_engine(model, graphs: bool, dtype=torch.float32, hf_model=None, **settings) -> LLMEngine:
    return LLMEngine(hf_model or model, **{"block_size": 16, "num_blocks": 2048, "device": "cuda", "dtype": dtype,
                                           "cuda_graphs": graphs, "attention_backend": "cupy", **settings})


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen3-0.6b-random-4l"])
def test_graph_replays_give_the_eager_engine_s_and_hf_s_greedy_tokens_on_cuda(model, liveness_checked):
    """fp32. Not wrapped in inference mode: steps that grow tables in a graph step and eager steps after them must
    both work as a user calls them."""
    prompts, params = _requests(20)
    eager = _cuda_engine(model, graphs=False)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    hf = [eager.hf_model.generate(torch.tensor([p], device="cuda"), max_new_tokens=s.max_tokens,
                                  min_new_tokens=s.max_tokens, do_sample=False)[0, len(p):].tolist()
          for p, s in zip(prompts[-4:], params[-4:])]
    graphs = _cuda_engine(model, graphs=True, hf_model=eager.hf_model)
    static = graphs.runner.static_decode
    assert static is not None and len(static.graphs) == len(static.buckets)  # all captured with the engine
    outputs = [o.token_ids for o in graphs.generate(prompts, params)]
    assert static.use_graphs, "the self-check turned the graphs off"
    assert outputs == expected
    assert outputs[-4:] == hf


@pytest.mark.gpu
def test_bf16_graph_replays_give_the_eager_engine_s_tokens_on_cuda(liveness_checked):
    prompts, params = _requests(12)
    eager = _cuda_engine("qwen3-0.6b-random-4l", graphs=False, dtype=torch.bfloat16)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    graphs = _cuda_engine(None, graphs=True, dtype=torch.bfloat16, hf_model=eager.hf_model)
    assert [o.token_ids for o in graphs.generate(prompts, params)] == expected
    assert graphs.runner.static_decode.use_graphs


def _long_run(engine: LLMEngine, prompts: list, late: list) -> list:
    """80 long prompts decoding (tables past 64 rows and 64 columns grow inside graph steps), then a late request
    whose chunked prefill runs eagerly beside the decodes (writing the tables outside inference mode) between graph
    steps."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    for _ in range(12):
        engine.step()
    engine.add_request(late, SamplingParams(max_tokens=8, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return sorted((o.request_id, o.token_ids) for o in outputs)


@pytest.mark.gpu
def test_graph_steps_past_64_sequences_and_1024_tokens_then_an_eager_step_on_cuda(liveness_checked):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1024, (1100 + i,), generator=generator).tolist() for i in range(80)]
    late = torch.randint(0, 1024, (300,), generator=generator).tolist()
    settings = dict(num_blocks=80 * 72 + 64, max_num_seqs=96, max_num_batched_tokens=1 << 17, scheduling="chunked")
    eager = _cuda_engine("tiny-hd64", graphs=False, **settings)
    expected = _long_run(eager, prompts, late)
    graphs = _cuda_engine(None, graphs=True, hf_model=eager.hf_model, **settings)
    assert _long_run(graphs, prompts, late) == expected
    assert graphs.runner.static_decode.use_graphs and graphs.runner.block_tables.tables.shape[1] > 64

"""The CUDA-graph decode path's defects found by review, each checked on the CPU where it is not CUDA-specific, and
structurally where it is: what a graph reads is owned by its replayer, a dropped engine frees its KV pool at once,
block tables grown in inference mode stay writable, no step captures a graph, the launch ledger counts the engine's
own decode configuration, and the decode benchmark times the engine the rest of the lab runs and keeps its rows."""
import gc
import weakref

import pandas as pd
import pytest
import torch

from lab.bench.decode import DecodeBenchConfig, run_decode_bench
from lab.bench.launches import LedgerConfig, count_launches, per_layer
from lab.engine import LLMEngine, SamplingParams
from lab.worker.block_tables import DeviceBlockTables
from lab.worker.static_decode import StaticDecode


def _attached(engine: LLMEngine, max_batch: int = 8, max_context: int = 64) -> StaticDecode:
    """The static decode buffers as the engine attaches them on a GPU (eager here)."""
    engine.runner.static_decode = StaticDecode(engine.runner, max_batch, max_context, graphs=False)
    return engine.runner.static_decode


def test_every_tensor_a_graph_reads_is_a_buffer_of_its_owner():
    static = _attached(LLMEngine("tiny", num_blocks=64))
    batch, rows = static.graph_inputs(4, 64)
    static.check_owned(batch, rows)  # the row indices included: a tensor made for the capture would be freed after
    with pytest.raises(RuntimeError, match="rows"):
        static.check_owned(batch, torch.arange(4))
    assert batch.seq_lens.dtype == torch.int32  # the kernels' dtype: no cast kernel per layer inside the graph


def test_a_dropped_engine_frees_its_kv_pool_without_a_garbage_collection():
    """The runner owns its static decode; a reference back from it made a cycle that kept the KV pool alive until
    a collection, while the next engine allocated its own (e2e builds an engine per run: out of memory on a GPU)."""
    engine = LLMEngine("tiny", num_blocks=64)
    _attached(engine)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    pool = weakref.ref(engine.runner.key_caches[0])
    gc.collect()
    gc.disable()
    try:
        del engine
        assert pool() is None
    finally:
        gc.enable()


class _Tables:
    """A KV view with one sequence whose table is as long as asked."""

    def __init__(self, blocks: int):
        self.table = list(range(blocks))

    def block_table_view(self, seq_id):
        return self.table


def test_block_tables_grown_inside_inference_mode_stay_writable_outside_it():
    """A graph decode step (inference mode) grows the table; the next eager step (chunked prefill, beam search,
    recorded logits) writes it outside inference mode."""
    tables = DeviceBlockTables(torch.device("cpu"), num_rows=2, num_cols=2)
    kv = _Tables(5)
    with torch.inference_mode():
        _, updates = tables.plan([0], kv)
        tables.apply(torch.tensor(updates, dtype=torch.long))
    assert not tables.tables.is_inference()
    kv.table.append(9)
    _, updates = tables.plan([0], kv)
    tables.apply(torch.tensor(updates, dtype=torch.long))  # raised "Inplace update to inference tensor"
    assert tables.gather(torch.tensor([0]), 6).tolist() == [[0, 1, 2, 3, 4, 9]]


def test_no_step_captures_a_graph(monkeypatch):
    """Graphs are captured with the engine (``capture_all``), before any clock starts: a step whose bucket has no
    graph runs eagerly instead of capturing inside a timed step."""
    engine = LLMEngine("tiny", num_blocks=128)
    static = _attached(engine)
    static.use_graphs = True  # as on a GPU whose capture has not happened

    def capture(bucket):
        raise AssertionError(f"a step captured bucket {bucket}")

    monkeypatch.setattr(static, "_capture", capture)
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [4, 4]


def test_capture_all_captures_every_bucket_on_padding_after_a_collection(monkeypatch):
    static = _attached(LLMEngine("tiny", num_blocks=64), max_batch=8)
    captured, collected = [], []
    monkeypatch.setattr(static, "_capture", captured.append)
    monkeypatch.setattr(gc, "collect", lambda: collected.append(True))
    static.capture_all()
    assert captured == [] and not collected  # graphs off: nothing
    static.use_graphs = True
    static.capture_all()
    assert captured == [1, 2, 4, 8] and collected == [True]
    assert static.vectors[2].tolist() == [-1] * 8 and static.seq_lens.tolist() == [0] * 8  # padding: no writes


def test_the_ledger_counts_the_decode_step_the_engine_runs():
    """Graphs on (the engine's default): int32 lengths from the static buffers (no cast per layer) and attention
    partitioned for the graph context, so the split-K reduction is counted even for a 512-token batch."""
    ledger = count_launches(LedgerConfig())
    layer = ledger[(ledger["step"] == "decode") & (ledger["layer"] == 0)].set_index("kind")["launches"]
    assert "cupy.reduce_partitions_kernel" in layer and not any("to_copy" in kind for kind in layer.index)
    eager = per_layer(count_launches(LedgerConfig(cuda_graphs=False))).set_index("step")["per_layer"]
    graphs = per_layer(ledger).set_index("step")["per_layer"]
    assert graphs["decode"] == eager["decode"] + 1  # the reduction of the graph context's partitions


def test_the_decode_bench_times_the_default_engine_and_keeps_each_row_as_measured(monkeypatch):
    made, saved = [], []
    original = LLMEngine.__init__

    def recording(self, *args, **kwargs):
        made.append(kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", recording)
    config = DecodeBenchConfig(batches=(1, 2), contexts=(8,), steps=3)
    table = run_decode_bench(config, on_row=lambda rows: saved.append(len(rows)))
    assert made and all("max_model_len" not in kwargs for kwargs in made)  # graphs partition as e2e's and the app's
    assert saved == [1, 2] and len(table) == 2
    assert not table["cuda_graphs"].any()  # none replayed on a CPU, whatever was asked


def test_a_decode_bench_case_that_crashes_loses_only_itself(tmp_path, monkeypatch):
    from lab.bench import decode
    from lab.cli.main import main

    calls = []
    original = decode._time_decode

    def crashing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return original(*args)

    monkeypatch.setattr(decode, "_time_decode", crashing)
    out = tmp_path / "decode.csv"
    with pytest.raises(RuntimeError, match="device lost"):
        main(["bench", "decode", "--model", "tiny", "--batch", "1,2", "--context", "8", "--steps", "3",
              "--out", str(out)])
    assert pd.read_csv(out)["batch"].tolist() == [1]

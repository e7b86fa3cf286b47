"""The launch ledger: the CUDA path's kernels per decoder layer, counted on the meta device without a GPU."""
import pandas as pd

from lab.bench.launches import LedgerConfig, count_launches, per_layer

MAX_DECODE_LAUNCHES_PER_LAYER = 12  # nano-vllm's recipe lands at about 11


def test_a_decode_layer_launches_at_most_twelve_kernels():
    config = LedgerConfig(model="qwen3-0.6b-random", batch=8, context=64)
    ledger = count_launches(config)
    summary = per_layer(ledger).set_index("step")
    assert summary.loc["decode", "per_layer"] <= MAX_DECODE_LAUNCHES_PER_LAYER
    layer = ledger[(ledger["step"] == "decode") & (ledger["layer"] == 3)].set_index("kind")["launches"]
    # the fused ops and the four GEMMs, each once, and the split-K reduction of a graph captured for the engine's
    # default context (8,192 tokens: 16 partitions); nothing else (no cast of the lengths)
    assert layer.to_dict() == {"aten.linear": 4, "cupy.paged_attention_kernel": 1, "cupy.qk_norm_rope_write_kernel": 1,
                               "cupy.reduce_partitions_kernel": 1, "cupy.rms_norm_kernel": 2,
                               "cupy.silu_and_mul_kernel": 1}
    every_layer = ledger[(ledger["step"] == "decode") & (ledger["layer"] >= 0)].groupby("layer")["launches"].sum()
    assert len(every_layer) == 28 and every_layer.nunique() == 1


def test_the_ledger_counts_what_eager_torch_would_launch():
    """The counter itself, under inference mode as the runner's forward runs: views and allocations launch nothing,
    a dtype conversion launches one."""
    import torch

    from lab.bench.launches import _Counter

    counter = _Counter()
    x = torch.empty(4, 8, device="meta", dtype=torch.bfloat16)
    with torch.inference_mode(), counter:
        y = x.view(8, 4).t().contiguous()  # a view, a transpose, then one copy
        x.to(torch.bfloat16)  # the same dtype: no kernel
        x.to(torch.float32)  # a conversion
        torch.empty(3, device="meta")
        y + 1
    counts = pd.Series({kind: n for (_, kind), n in counter.counts.items()})
    assert counts.to_dict() == {"aten.contiguous": 1, "aten.to": 1, "aten.add": 1}

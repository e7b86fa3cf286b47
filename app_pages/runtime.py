import dataclasses
import time

import pandas as pd
import streamlit as st

from lab.bench.e2e import E2EConfig, run_e2e_bench_detached
from lab.report.charts import (engine_live_figure, format_bytes, latency_histograms, request_timeline_figure,
                               serving_gauges_figure, static_batching_note, system_comparison_figure)
from lab.engine import EngineConfig
from lab.engine.live import RuntimeRunConfig, compare_kv_precision_detached, run_runtime_detached, throttled
from lab.engine.serving_metrics import serving_metrics
from lab.report.results import settings_of
from lab.errors import user_errors
from lab.models.qwen3 import PRESETS
from app_pages._ui import chart, csv_download, data_table, results_store, scheduling_radio, setting, show_error


@st.cache_resource(show_spinner=False)
def opening_runs() -> dict:
    """Per preset configuration, the run its page opened with first on this server (result, settings, time): the page
    opened again (a reload, another tab) shows it at once instead of serving the same default mix once more."""
    return {}


st.title("Qwen3 runtime")
st.caption("The paged engine serving a request mix: continuous batching, prefix caching, preemption, live. Runs "
           "and comparisons run in a process of their own, as `python -m lab` does, not inside this app's server "
           "(docs/app.md says why).")


with st.sidebar:
    model = setting(st.text_input, "Model (preset or local checkpoint directory)", key="runtime_model", value="tiny")
    num_requests = setting(st.slider, "Requests", key="runtime_requests", value=16, min_value=1, max_value=128)
    prompt_range = setting(st.slider, "Prompt lengths", key="runtime_prompts", value=(16, 128), min_value=1,
                           max_value=1024)
    output_range = setting(st.slider, "Max new tokens", key="runtime_outputs", value=(16, 64), min_value=1,
                           max_value=512)
    shared_prefix = setting(st.slider, "Shared prompt prefix (tokens)", key="runtime_prefix", value=0, min_value=0,
                            max_value=512, step=16)
    block_size = setting(st.select_slider, "Block size", key="runtime_block_size", value=16,
                         options=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    num_blocks = setting(st.number_input, "KV pool (blocks)", key="runtime_num_blocks", value=256, min_value=1,
                         max_value=1_000_000)
    prefix_caching = setting(st.toggle, "Prefix caching", key="runtime_prefix_caching", value=True)
    n = setting(st.slider, "Parallel samples n", key="runtime_n", value=1, min_value=1, max_value=8)
    temperature = setting(st.slider, "Temperature", key="runtime_temperature", value=0.0, min_value=0.0, max_value=2.0)
    backend = setting(st.selectbox, "Attention backend", key="runtime_backend", value="auto",
                      options=["auto", "torch", "reference", "cupy"])
    scheduling = scheduling_radio("vllm", key="runtime_scheduling")
    max_num_seqs = setting(st.number_input, "Max running sequences (max_num_seqs)", key="runtime_max_num_seqs",
                           value=32, min_value=1, max_value=1024,
                           help="continuous batching's cap on the sequences a step decodes")
    budget = setting(st.number_input, "Token budget per step (max_num_batched_tokens)", key="runtime_budget",
                     value=4096, min_value=1, max_value=65_536)
    preemption = setting(st.radio, "Preemption", key="runtime_preemption", value="recompute",
                         options=["recompute", "swap"], horizontal=True,
                         help="swap: preempted sequences move to a host KV pool and come back later")
    run = st.button("Run", type="primary", key="run")

engine_config = EngineConfig(block_size=block_size, num_blocks=int(num_blocks), enable_prefix_caching=prefix_caching,
                             attention_backend=backend, max_num_seqs=int(max_num_seqs), scheduling=scheduling,
                             max_num_batched_tokens=int(budget), preemption_mode=preemption)
config = RuntimeRunConfig(model=model, num_requests=num_requests, prompt_len_range=prompt_range,
                          max_tokens_range=output_range, shared_prefix_tokens=shared_prefix, n=n,
                          temperature=temperature, engine=engine_config)
# One slot for the live view and the finished run: a new run replaces the last one's tiles instead of drawing its
# own above them.
slot = st.empty()
opening, opening_key = opening_runs(), repr(config) if model in PRESETS else None
if not run and "runtime_run" not in st.session_state and opening_key in opening:
    result, settings, when = opening[opening_key]
    st.session_state.update(runtime_run=result, runtime_settings=settings, runtime_opened_at=when)
elif run or "runtime_run" not in st.session_state:
    st.session_state.pop("runtime_opened_at", None)
    # Two children, as the finished view below has (tiles, chart): each replaces its counterpart; a third written
    # during the run would outlive the swap.
    live = slot.container(border=True)
    tile_rows = live.container()
    tiles = [col.empty() for row in range(2) for col in tile_rows.columns(4)][:7]
    plot = live.empty()
    history = []

    def draw(stats):
        elapsed = max(stats.elapsed_s, 1e-9)
        preempted = sum(s.num_preempted + s.num_swapped_out for s in history)
        for tile, (label, value) in zip(tiles, [("Output tokens/s", f"{stats.generated_tokens / elapsed:,.0f}"),
                                                ("Running", stats.num_running), ("Waiting", stats.num_waiting),
                                                ("KV blocks used", stats.blocks_in_use), ("Preemptions", preempted),
                                                ("Step", stats.step),
                                                ("Peak memory", format_bytes(stats.peak_memory_bytes))]):
            tile.metric(label, value)
        plot.plotly_chart(engine_live_figure(pd.DataFrame([dataclasses.asdict(s) for s in history])))

    # Once a second, from the run's first second on: each redraw costs the browser and the server CPU time the engine
    # then loses (in a browser on 2 vCPUs, drawing from the first step on left the page's run at 0.6 x a script's)
    redraw = throttled(draw, 1.0)

    def on_step(stats):
        history.append(stats)
        if stats.elapsed_s >= 1.0:
            redraw(stats)

    try:
        result = run_runtime_detached(config, on_step=on_step)
        st.session_state.update(runtime_run=result, runtime_settings=settings_of(config))
        if not run and opening_key is not None:
            opening[opening_key] = (result, st.session_state["runtime_settings"], time.strftime("%H:%M:%S"))
        results_store().add("runtime", f"runtime: {model}, {num_requests} requests, B={block_size}",
                            pd.DataFrame([result.summary]), st.session_state["runtime_settings"])
    except user_errors() as exc:
        slot.empty()
        show_error(exc)
        st.stop()

result = st.session_state["runtime_run"]
summary = result.summary
run_settings = st.session_state["runtime_settings"]
with slot.container():
    st.caption(f"{run_settings['model']}: {len(result.requests):,} requests, block size {run_settings['block_size']}, "
               f"{summary['num_kv_blocks']:,} KV blocks, {run_settings['scheduling']} scheduling, "
               f"{summary['steps']:,} steps")
    if "runtime_opened_at" in st.session_state:
        st.caption(f"The run this page opened with on this server at {st.session_state['runtime_opened_at']}, with "
                   "these settings; press Run to serve the mix again and watch it live.")
    cols = st.columns(5)
    cols[0].metric("Output tokens/s", f"{summary['output_tok_s']:,.0f}")
    cols[1].metric("Peak KV blocks", f"{summary['peak_kv_blocks']} / {summary['num_kv_blocks']}")
    cols[2].metric("Prefix-cache hit rate", f"{summary['prefix_hit_rate']:.0%}")
    cols[3].metric("Preemptions", summary["preemptions"])
    cols[4].metric("Peak memory", format_bytes(summary["peak_memory_bytes"]),
                   help="the device's peak allocation on a GPU; the process's peak resident memory on the CPU")
    chart(engine_live_figure(result.steps), "engine_state")
metrics = serving_metrics(result)
st.subheader("vLLM's metrics")
st.caption("Named as vLLM's Prometheus metrics (`vllm:kv_cache_usage_perc`, `vllm:num_requests_running` …), "
           "computed from the engine's steps and tokens by `lab.engine.serving_metrics`.")
chart(serving_gauges_figure(metrics.gauges), "vllm_gauges")
if len(result.requests):
    chart(latency_histograms(metrics.latencies), "latency_hist")
    chart(request_timeline_figure(metrics.timeline), "request_timeline")
data_table(result.requests.drop(columns=["arrival_s", "scheduled_s", "first_token_s", "finish_s"], errors="ignore"))
csv_download(result.requests, "runtime-requests", run_settings, "dl_requests", "Download per-request CSV")
csv_download(pd.DataFrame([summary]), "runtime-summary", run_settings, "dl_runtime_summary",
             "Download run summary CSV")

st.subheader("Against HF generation")
st.caption("The README's serving benchmark (`python -m lab bench e2e`): the paged engine against HF transformers "
           "serving the same requests one by one as they finish (*HF continuous batching*: a new request joins as "
           "soon as one ends) and in fixed batches (*HF static batching*: a batch starts together and waits for its "
           "longest member).")
workload = st.radio("Requests", ["the README's benchmark: 64 requests, prompts 16–512, outputs 16–256",
                                 "this page's request mix"], key="compare_workload")
systems = st.multiselect("Systems", list(E2EConfig().systems), default=["paged-engine", "hf-continuous", "hf-static"])
if st.button("Compare", key="compare"):
    bench = E2EConfig(model=model, block_size=block_size, attention_backend=backend, systems=tuple(systems),
                      repeats=1)
    if workload.startswith("this page"):
        bench = dataclasses.replace(bench, num_requests=num_requests, prompt_range=prompt_range,
                                    output_range=output_range)
    try:
        bar = st.progress(0.0, text=f"running {len(bench.systems)} systems in a process of their own…")
        table = run_e2e_bench_detached(bench, progress=lambda done, total: bar.progress(
            done / total, text=f"{done} of {total} systems done"))
        bar.empty()
        st.session_state.update(runtime_compare=table, runtime_compare_settings=settings_of(bench))
        results_store().add("runtime", f"serving comparison: {model}", table,
                            st.session_state["runtime_compare_settings"])
    except user_errors() as exc:
        show_error(exc)
if "runtime_compare" in st.session_state:
    table = st.session_state["runtime_compare"]
    chart(system_comparison_figure(table), "systems")
    note = static_batching_note(table)
    if note:
        st.info(note)
    data_table(table)
    csv_download(table, "serving-comparison", st.session_state["runtime_compare_settings"], "dl_compare")

# ---- KV precision (issue 71): the page's request mix with an FP8 KV cache against the model's dtype ---------------
st.subheader("KV precision")
st.caption("The page's request mix and engine settings served greedily twice, on the same pool: with the model's "
           "dtype in the KV cache (`auto`) and with an FP8 cache (one byte an element, vLLM's `kv_cache_dtype`). "
           "Tokens agree position by position while each run goes its own way: a sequence that parts at a near tie "
           "differs from there on (random weights part early), so the first tokens are the fairer measure.")
precision_cols = st.columns(2)
kv_precision = precision_cols[0].selectbox("KV cache dtype", ["fp8_e4m3", "fp8_e5m2"], key="runtime_kv_precision")
kv_scales = precision_cols[1].radio("Scales", ["1.0 (vLLM's default)", "calculated from the first prefill"],
                                    key="runtime_kv_scales", horizontal=True)
if st.button("Compare KV precision", key="compare_precision"):
    try:
        with st.spinner("serving the mix with both caches (in a process of its own)…"):
            precision_table = compare_kv_precision_detached(config, kv_precision, kv_scales.startswith("calculated"))
        precision_settings = settings_of(config, kv_cache_dtype=kv_precision, kv_scales=kv_scales)
        st.session_state.update(runtime_precision=precision_table, runtime_precision_settings=precision_settings)
        results_store().add("runtime", f"KV precision: {model}, {kv_precision}", precision_table, precision_settings)
    except user_errors() as exc:
        show_error(exc)
if "runtime_precision" in st.session_state:
    precision_table = st.session_state["runtime_precision"]
    data_table(precision_table, {"kv_cache_dtype": "KV cache", "scales": "Scales", "output_tok_s": "Output tokens/s",
                                 "peak_kv_blocks": "Peak blocks in use", "num_kv_blocks": "Pool (blocks)",
                                 "kv_bytes_per_block": "Bytes a block", "peak_kv_bytes": "Peak KV bytes",
                                 "preemptions": "Preemptions", "token_agreement": "Tokens agreeing with auto",
                                 "first_token_agreement": "First tokens agreeing with auto"},
               percent=("token_agreement", "first_token_agreement"), formats={"output_tok_s": "%.0f"})
    csv_download(precision_table, "kv-precision", st.session_state["runtime_precision_settings"],
                 "dl_runtime_precision", "Download the KV precision comparison (CSV)")

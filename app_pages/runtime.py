import dataclasses

import pandas as pd
import streamlit as st

from lab.bench.e2e import E2EConfig, run_e2e_bench_detached
from lab.report.charts import (engine_live_figure, format_bytes, latency_histograms, request_timeline_figure,
                               serving_gauges_figure, static_batching_note, system_comparison_figure)
from lab.engine import EngineConfig
from lab.engine.live import RuntimeRunConfig, run_runtime_detached, throttled
from lab.engine.serving_metrics import serving_metrics
from lab.report.results import settings_of
from lab.errors import user_errors
from app_pages._ui import chart, csv_download, data_table, results_store, scheduling_radio, show_error

st.title("Qwen3 runtime")
st.caption("The paged engine serving a request mix: continuous batching, prefix caching, preemption, live. Runs "
           "and comparisons run in a process of their own, as `python -m lab` does, not inside this app's server "
           "(docs/app.md says why).")


with st.sidebar:
    model = st.text_input("Model (preset or local checkpoint directory)", "tiny")
    num_requests = st.slider("Requests", 1, 128, 16)
    prompt_range = st.slider("Prompt lengths", 1, 1024, (16, 128))
    output_range = st.slider("Max new tokens", 1, 512, (16, 64))
    shared_prefix = st.slider("Shared prompt prefix (tokens)", 0, 512, 0, step=16)
    block_size = st.select_slider("Block size", [1, 2, 4, 8, 16, 32, 64, 128, 256], 16)
    num_blocks = st.number_input("KV pool (blocks)", 1, 1_000_000, 256, key="runtime_num_blocks")
    prefix_caching = st.toggle("Prefix caching", True)
    n = st.slider("Parallel samples n", 1, 8, 1)
    temperature = st.slider("Temperature", 0.0, 2.0, 0.0)
    backend = st.selectbox("Attention backend", ["auto", "torch", "reference", "cupy"])
    scheduling = scheduling_radio("vllm", key="runtime_scheduling")
    max_num_seqs = st.number_input("Max running sequences (max_num_seqs)", 1, 1024, 32, key="runtime_max_num_seqs",
                                   help="continuous batching's cap on the sequences a step decodes")
    budget = st.number_input("Token budget per step (max_num_batched_tokens)", 1, 65_536, 4096,
                             key="runtime_budget")
    preemption = st.radio("Preemption", ["recompute", "swap"], horizontal=True, key="runtime_preemption",
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
if run or "runtime_run" not in st.session_state:
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

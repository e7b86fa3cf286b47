import math

import pandas as pd
import streamlit as st

import simulator
from simulator import charts
from simulator.metrics import rejection_warning
from pages._ui import USER_ERRORS, chart, csv_download, results_store, show_error

cached_workload = st.cache_data(simulator.make_workload, show_spinner=False)

st.title("Memory simulator")
st.caption("Replay a workload against contiguous allocators and the paged block manager; see where KV memory goes.")

with st.sidebar:
    figure2 = st.toggle("vLLM paper Figure 2 setup", help="OPT-13B on A100-40GB, ShareGPT lengths, 2048 max length, "
                        "buddy-allocated contiguous baselines, paged B=16, all requests at t=0")
    source = st.radio("Workload", ["synthetic", "upload a trace"], horizontal=True, disabled=figure2)
    upload = None
    if source == "synthetic" or figure2:
        preset = st.selectbox("Preset", simulator.SYNTHETIC_PRESETS, disabled=figure2)
    else:
        upload = st.file_uploader("Trace (Azure CSV, Mooncake JSONL or arrival_time_s,prompt_tokens,output_tokens)",
                                  type=["csv", "jsonl", "json"])
        time_scale = st.number_input("Time scale (multiplies arrival offsets)", 0.001, 1000.0, 1.0)
    num_requests = st.number_input("Requests (trace: max rows)", 1, 200_000, 1000, step=100)
    not_synthetic = figure2 or source != "synthetic"  # a trace keeps its own arrivals and lengths
    rate = st.slider("Arrival rate (req/s; 0 = all at t=0)", 0.0, 200.0, 20.0, disabled=not_synthetic)
    burstiness = st.slider("Burstiness (gamma shape; 1 = Poisson)", 0.1, 4.0, 1.0, disabled=not_synthetic)
    n = st.slider("Parallel samples n", 1, 8, 1, disabled=not_synthetic)
    beam_width = st.slider("Beam width (beam search; 1 = off)", 1, 8, 1, disabled=not_synthetic,
                           help="Beams share blocks and fork or die each step (a seeded survival model); "
                                "not together with n > 1")
    shared_prefix = st.slider("Shared system-prompt tokens", 0, 1024, 0, step=16, disabled=not_synthetic)
    model = st.selectbox("Model", list(simulator.MODELS), index=list(simulator.MODELS).index("qwen3-8b"),
                         disabled=figure2)
    gpu = st.selectbox("GPU", list(simulator.GPUS), index=list(simulator.GPUS).index("a100-40gb"), disabled=figure2)
    capacity = st.number_input("KV capacity override (tokens; 0 = from model and GPU)", 0, 10**8, 0, step=1000,
                               disabled=figure2)
    utilization = st.slider("GPU memory utilization", 0.3, 1.0, 0.9, disabled=figure2)
    with st.expander("Override model / GPU figures"):
        gpu_spec, model_spec = simulator.get_gpu(gpu), simulator.get_model(model)
        memory_gib = st.number_input("GPU memory (GiB)", 1.0, 4096.0, gpu_spec.memory_bytes / 2**30, disabled=figure2)
        bandwidth_tbs = st.number_input("HBM bandwidth (TB/s)", 0.05, 50.0, gpu_spec.bandwidth_bytes_s / 1e12,
                                        disabled=figure2)
        peak_tflops = st.number_input("Peak 16-bit TFLOP/s", 1.0, 10_000.0, gpu_spec.peak_flops / 1e12,
                                      disabled=figure2)
        dtype_bytes = st.selectbox("KV / weight bytes per element", [1, 2, 4], index=[1, 2, 4].index(
            model_spec.dtype_bytes), disabled=figure2)
    max_model_len = st.select_slider("Max model length", [512, 1024, 2048, 4096, 8192, 16384, 32768, 131072], 2048,
                                     disabled=figure2)
    allocators = st.multiselect("Allocators", simulator.ALLOCATORS, default=list(simulator.ALLOCATORS),
                                disabled=figure2)
    block_sizes = st.multiselect("Paged block sizes", [1, 2, 4, 8, 16, 32, 64, 128, 256], default=[16],
                                 disabled=figure2)
    address_space = st.radio("Contiguous address space", ["first-fit", "buddy"], horizontal=True, disabled=figure2)
    scheduling = st.radio("Scheduling", ["prefill-first", "chunked"], horizontal=True, disabled=figure2)
    max_num_seqs = st.number_input("Max running sequences (max_num_seqs)", 1, 65_536, 256, key="sim_max_num_seqs",
                                   disabled=figure2)
    budget = st.number_input("Token budget per step (max_num_batched_tokens)", 1, 10**6, 8192, key="sim_budget",
                             help="chunked: prompts longer than this are spread over several steps", disabled=figure2)
    prefix_caching = st.toggle("Prefix caching (paged)", True, key="sim_prefix_caching", disabled=figure2,
                               help="cached full prompt blocks are shared instead of recomputed")
    preemption = st.radio("Preemption (paged)", ["recompute", "swap"], horizontal=True, disabled=figure2,
                          help="swap: preempted sequences move to a host pool over the GPU's host link "
                               "(contiguous baselines always recompute)")


def build_inputs():
    if figure2:
        spec, configs = simulator.figure2_experiment(int(num_requests))
        return simulator.synthetic_workload(spec), configs
    if upload is not None:
        workload = simulator.load_trace_bytes(upload.getvalue(), upload.name, time_scale, int(num_requests))
    elif source == "synthetic":
        workload = cached_workload(preset, num_requests=int(num_requests), rate=rate or math.inf,
                                           burstiness=burstiness, n=n, beam_width=beam_width,
                                           shared_prefix_tokens=shared_prefix,
                                           max_model_len=max_model_len)
    else:
        raise ValueError("upload a trace file first (or switch to a synthetic workload)")
    configs = simulator.make_configs(allocators, sorted(block_sizes), model=model, gpu=gpu,
                                     max_model_len=max_model_len, capacity_tokens=capacity or None,
                                     gpu_memory_utilization=utilization, address_space=address_space,
                                     scheduling=scheduling, preemption_mode=preemption,
                                     max_num_seqs=int(max_num_seqs), max_num_batched_tokens=int(budget),
                                     enable_prefix_caching=prefix_caching,
                                     model_overrides={"dtype_bytes": dtype_bytes},
                                     gpu_overrides={"memory_bytes": memory_gib * 2**30,
                                                    "bandwidth_bytes_s": bandwidth_tbs * 1e12,
                                                    "peak_flops": peak_tflops * 1e12})
    return workload, configs


key = repr((figure2, source, upload.file_id if upload else None, locals().get("preset"), num_requests, rate,
            burstiness, n, beam_width, shared_prefix, model, gpu, capacity, utilization, max_model_len, allocators, block_sizes,
            address_space, scheduling, preemption, max_num_seqs, budget, prefix_caching, memory_gib, bandwidth_tbs,
            peak_tflops, dtype_bytes))
if st.session_state.get("stop_sim"):  # the Stop button interrupted the last run
    st.session_state["sim_stopped_key"] = key
if st.session_state.get("sim_stopped_key") == key:
    st.info("Stopped. Change any input to run again.")
    st.stop()
if st.session_state.get("sim_key") != key:
    try:
        workload, configs = build_inputs()
        bar, stop = st.progress(0.0, "simulating…"), st.empty()
        stop.button("Stop", key="stop_sim", help="Interrupts the run (any widget change does too)")
        summary, runs = simulator.compare(workload, configs, progress=lambda f: bar.progress(min(f, 1.0),
                                                                                          "simulating…"))
        bar.empty()
        stop.empty()
        if figure2:
            summary["paper_token_states_frac"] = summary["allocator"].map(simulator.PAPER_FIGURE2_TOKEN_STATES)
        checks = simulator.closed_form_checks(workload, runs)
        st.session_state.update(sim_key=key, sim_summary=summary, sim_series={k: r.timeseries for k, r in runs.items()},
                                sim_workload=workload.summary(), sim_checks=checks)
        results_store().add("simulation", f"simulation: {workload.name} × {len(configs)} configs", summary)
        results_store().add("checks", f"checks: {workload.name} × {len(configs)} configs", checks)
    except USER_ERRORS as exc:
        st.session_state.pop("sim_key", None)
        show_error(exc)
        st.stop()

summary: pd.DataFrame = st.session_state["sim_summary"]
series: dict = st.session_state["sim_series"]
st.caption("Workload: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in st.session_state["sim_workload"].items()))
for row in summary[summary["num_requests_rejected"] > 0].itertuples():
    st.warning(rejection_warning(row._replace(allocator=row.label)) + ".")  # paged-B16, not "(B=nan)" for contiguous
chart(charts.waste_bars(summary), "waste_bars")
tabs = st.tabs(list(series))
for tab, (label, frame) in zip(tabs, series.items()):
    with tab:
        chart(charts.waste_areas(frame, f"{label}: KV breakdown over time"), f"areas_{label}")
left, right = st.columns(2)
with left:
    chart(charts.over_time(series, "num_running", "Batch size", "running sequences"), "batch_over_time")
with right:
    chart(charts.over_time(series, "generated_tokens", "Throughput", "output tokens/s", per_second=True),
          "throughput_over_time")
chart(charts.latency_percentiles(summary), "latency_percentiles")
st.subheader("Summary")
shown = ["label", "token_states_frac", "reserved_frac", "internal_fragmentation_frac", "external_fragmentation_frac", "free_frac",
         "sharing_saving_frac", "mean_batch_size", "peak_batch_size", "throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "preemptions",
         "num_requests_completed", "num_requests_rejected", "capacity_tokens",
         "host_capacity_tokens"]
st.dataframe(summary[[c for c in shown if c in summary] + [c for c in ("paper_token_states_frac",) if c in summary]],
             hide_index=True)
csv_download(summary, "simulation_summary.csv", "dl_summary", "Download summary CSV")
timeseries = pd.concat([f.assign(run=label) for label, f in series.items()], ignore_index=True)
csv_download(timeseries, "simulation_timeseries.csv", "dl_timeseries", "Download timeseries CSV")
checks: pd.DataFrame = st.session_state["sim_checks"]
failed = checks[~checks["holds"]]
with st.expander(f"Checks against closed forms: {len(checks) - len(failed)} of {len(checks)} hold",
                 expanded=not failed.empty):
    st.caption("Identities every run satisfies and bounds that follow from how each allocator holds memory "
               "(`simulator.checks`); a row that does not hold is a simulator bug.")
    st.dataframe(checks, hide_index=True)
    csv_download(checks, "simulation_checks.csv", "dl_checks", "Download checks CSV")

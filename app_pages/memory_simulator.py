import math
import os
from collections import OrderedDict

import pandas as pd
import streamlit as st

import simulator
from simulator.views import charts, report
from lab.errors import InputError, user_errors
from app_pages._ui import (RunProgress, chart, csv_download, data_table, kept_upload, results_store,
                           scheduling_radio, setting, show_error, stopped, summary_table)

cached_workload = st.cache_data(simulator.make_workload, show_spinner=False)
DEFAULTS = simulator.APP_DEFAULTS
BLOCK_SWEEP_REQUESTS = 300
FINISHED_RUNS_KEPT = 4
RUNS_KEPT = 48  # single runs (~1 MB each at 1,000 requests)
WORKERS = os.cpu_count() or 1  # the configurations run side by side (simulator.core.parallel)
HEADLINE_CARDS = (("Allocated KV holding tokens (%)", "Allocated KV holding tokens", " %"),
                  ("Throughput (output tokens/s)", "Throughput", " tok/s"),
                  ("Mean running sequences", "Mean running sequences", ""),
                  ("Waste (GiB, mean)", "KV wasted", " GiB"))
HEADLINE_FORMAT = {"Allocated KV holding tokens (%)": st.column_config.NumberColumn(format="%.1f %%"),
                   "Waste (% of allocated KV)": st.column_config.NumberColumn(format="%.1f %%"),
                   "Waste (GiB, mean)": st.column_config.NumberColumn(format="%.2f GiB"),
                   "Mean running sequences": st.column_config.NumberColumn(format="%.1f"),
                   "Throughput (output tokens/s)": st.column_config.NumberColumn(format="%.0f")}


OFFLOAD_LABELS = {"tier": "Host tier", "prefix_cache_hit_pct": "Prefix-cache hits (% of prompt blocks)",
                  "offload_hit_pct": "Served by the tier (% of prompt blocks)"}


@st.cache_resource(show_spinner=False)
def finished_runs() -> OrderedDict:
    """The runs this server finished, by their settings: the same settings give the same result, so a return to them
    (or a second visitor at the defaults) shows it at once. The ``FINISHED_RUNS_KEPT`` most recent."""
    return OrderedDict()


@st.cache_resource(show_spinner=False)
def kept_runs() -> simulator.RunCache:
    """Every configuration's run by (workload, configuration), the ``RUNS_KEPT`` most recent: a change of the block
    sizes or the allocator set runs only the configurations not run on this workload yet."""
    return simulator.RunCache(RUNS_KEPT)


def comparison_chart(name: str):
    """A chart of the comparison shown (``charts.comparison_figure``), built when first shown and kept with the
    run (a return to its settings draws it at once)."""
    figures = st.session_state["sim_figures"]
    if name not in figures:
        figures[name] = charts.comparison_figure(name, st.session_state["sim_summary"], st.session_state["sim_series"])
    return figures[name]


def sweep_rows(name: str) -> list:
    """A new sweep's rows (``{name}_rows``), kept as they come with the run they belong to: a sweep that does not
    finish shows those (``unfinished_sweep``)."""
    rows = st.session_state[f"{name}_rows"] = []
    st.session_state[f"{name}_for"] = st.session_state["sim_key"]
    return rows


def sweep_done(name: str) -> None:
    st.session_state.pop(f"{name}_rows", None)
    st.session_state.pop(f"{name}_for", None)


def unfinished_sweep(name: str, result_key: str, stop_key: str, total: int, unit: str) -> None:
    """A sweep that did not finish: stopped, or cut short by the rerun of another action on the page (a rerun ends
    the run in progress). Its finished rows are shown (as ``result_key``) while the page's run is still the one it
    swept; after a change of settings, a note says so."""
    was_stopped = stopped(stop_key)
    rows, swept = st.session_state.get(f"{name}_rows"), st.session_state.get(f"{name}_for")
    sweep_done(name)
    if rows is None:
        return
    if swept != st.session_state["sim_key"]:
        st.info("The last sweep was cut short by a change of settings: run it again for these ones.")
        return
    how = "Stopped" if was_stopped else "Cut short by another action on the page"
    if rows:
        st.session_state[result_key] = pd.DataFrame(rows)
    st.info(f"{how}: {len(rows)} of {total} {unit} finished" + (" and are shown." if rows else "."))


def block_size_sweep(workload, configs):
    """The block-size sweep under the page's settings, or None (with a warning) when it cannot run. Its rows are
    kept as they come (``sweep_rows``)."""
    base = next((c for c in configs if c.allocator == "paged"), configs[0])
    rows = sweep_rows("sim_block")
    try:
        workloads = simulator.block_size_sweep_workloads(workload, base.max_model_len, BLOCK_SWEEP_REQUESTS)
        progress = RunProgress(f"simulating {len(simulator.BLOCK_SIZES)} block sizes on two workloads",
                               "stop_block_sweep", help="Stops the sweep; the block sizes done are shown")

        def keep(row, fraction):
            rows.append(row)
            progress(fraction, f"{len(rows)} of {2 * len(simulator.BLOCK_SIZES)} runs")

        table = simulator.block_size_sweep(workloads, base, on_row=keep)
        progress.close()
        sweep_done("sim_block")  # not when a rerun interrupts it: its rows stay for the next run to show
        return table
    except user_errors() as exc:  # the comparison above stands on its own
        sweep_done("sim_block")
        st.warning(f"The block-size sweep could not run: {exc}")
        return None


st.title("Memory simulator")
st.caption("What does paging the KV cache buy? The same requests are served with each allocator on the same GPU; the "
           "table below says how much of the memory each one hands out really holds tokens, and what that buys in "
           "batch size and throughput. Change any setting in the sidebar and it runs again.")

with st.sidebar:
    side = st.sidebar
    figure2 = setting(side.toggle, "vLLM paper Figure 2 setup", key="sim_figure2", value=False,
                      help="OPT-13B on A100-40GB, ShareGPT lengths, 2048 max length, buddy-allocated contiguous "
                           "baselines, paged B=16, all requests at t=0")
    source = setting(side.radio, "Workload", key="sim_source", value="synthetic",
                     options=["synthetic", "upload a trace"], horizontal=True, disabled=figure2)
    upload = None
    if source == "synthetic" or figure2:
        preset = setting(side.selectbox, "Preset", key="sim_preset", value=DEFAULTS["preset"],
                         options=list(simulator.SYNTHETIC_PRESETS), disabled=figure2)
    else:
        upload = kept_upload("Trace (Azure CSV, Mooncake JSONL or arrival_time_s,prompt_tokens,output_tokens)",
                             "sim_trace", side, type=["csv", "jsonl", "json"])
        time_scale = setting(side.number_input, "Time scale (multiplies arrival offsets)", key="sim_time_scale",
                             value=1.0, min_value=0.001, max_value=1000.0)
    num_requests = setting(side.number_input, "Requests (trace: max rows)", key="sim_requests",
                           value=DEFAULTS["num_requests"], min_value=1, max_value=200_000, step=100)
    not_synthetic = figure2 or source != "synthetic"  # a trace keeps its own arrivals and lengths
    # typed, not a slider: a slider over 0-200 cannot be dragged back to exactly 5.00
    rate = setting(side.number_input, "Arrival rate (requests/s; 0 = all at once)", key="sim_rate",
                   value=float(DEFAULTS["rate"]), min_value=0.0, max_value=200.0, step=0.5, format="%.2f",
                   disabled=not_synthetic,
                   help="Mean rate of a Poisson (or gamma) arrival process; at 5 requests/s ShareGPT-like requests "
                        "fill OPT-13B's KV pool on an A100-40GB, so the allocators differ")
    burstiness = setting(side.slider, "Burstiness (gamma shape; 1 = Poisson)", key="sim_burstiness", value=1.0,
                         min_value=0.1, max_value=4.0, disabled=not_synthetic)
    n = setting(side.slider, "Parallel samples n", key="sim_n", value=1, min_value=1, max_value=8,
                disabled=not_synthetic)
    beam_width = setting(side.slider, "Beam width (beam search; 1 = off)", key="sim_beam_width", value=1,
                         min_value=1, max_value=8, disabled=not_synthetic,
                         help="Beams share blocks and fork or die each step (a seeded survival model); "
                              "not together with n > 1")
    shared_prefix = setting(side.slider, "Shared system-prompt tokens", key="sim_shared_prefix", value=0,
                            min_value=0, max_value=1024, step=16, disabled=not_synthetic)
    model = setting(side.selectbox, "Model", key="sim_model", value=DEFAULTS["model"], options=list(simulator.MODELS),
                    disabled=figure2, help="OPT-13B on one A100-40GB is the vLLM paper's setup: 26 GB of weights "
                                           "leave about 12,000 tokens of KV, so memory binds")
    gpu = setting(side.selectbox, "GPU", key="sim_gpu", value=DEFAULTS["gpu"], options=list(simulator.GPUS),
                  disabled=figure2)
    capacity = setting(side.number_input, "KV capacity override (tokens; 0 = from model and GPU)", key="sim_capacity",
                       value=0, min_value=0, max_value=10**8, step=1000, disabled=figure2,
                       help="0: GPU memory × utilization − weights − 1 GiB of activations, divided by the KV "
                            "bytes of one token")
    utilization = setting(side.slider, "GPU memory utilization", key="sim_utilization", value=0.9, min_value=0.3,
                          max_value=1.0, disabled=figure2)
    with st.expander("Override model / GPU figures", key="sim_override_box"):
        gpu_spec, model_spec = simulator.get_gpu(gpu), simulator.get_model(model)
        here = st  # inside the expander; the keys name the GPU or model whose figure a value overrides
        memory_gib = setting(here.number_input, "GPU memory (GiB)", key=f"sim_memory_gib_{gpu}",
                             value=gpu_spec.memory_bytes / 2**30, min_value=1.0, max_value=4096.0, disabled=figure2)
        bandwidth_tbs = setting(here.number_input, "HBM bandwidth (TB/s)", key=f"sim_bandwidth_{gpu}",
                                value=gpu_spec.bandwidth_bytes_s / 1e12, min_value=0.05, max_value=50.0,
                                disabled=figure2)
        peak_tflops = setting(here.number_input, "Peak 16-bit TFLOP/s", key=f"sim_tflops_{gpu}",
                              value=gpu_spec.peak_flops / 1e12, min_value=1.0, max_value=10_000.0, disabled=figure2)
        dtype_bytes = setting(here.selectbox, "KV / weight bytes per element", key=f"sim_dtype_bytes_{model}",
                              value=model_spec.dtype_bytes, options=[1, 2, 4], disabled=figure2)
    max_model_len = setting(side.select_slider, "Max model length", key="sim_max_model_len",
                            value=DEFAULTS["max_model_len"],
                            options=[512, 1024, 2048, 4096, 8192, 16384, 32768, 131072], disabled=figure2)
    allocators = setting(side.multiselect, "Allocators", key="sim_allocators", value=list(simulator.ALLOCATORS),
                         options=list(simulator.ALLOCATORS), disabled=figure2)
    block_sizes = setting(side.multiselect, "Paged block sizes (tokens per block)", key="sim_block_sizes",
                          value=[DEFAULTS["block_size"]], options=list(simulator.BLOCK_SIZES), disabled=figure2,
                          help="Small blocks waste less of their last block but slow the attention kernel; the "
                               "sweep chart below shows the trade")
    address_space = setting(side.radio, "Contiguous address space", key="sim_address_space", value="first-fit",
                            options=["first-fit", "buddy"], horizontal=True, disabled=figure2)
    scheduling = scheduling_radio("prefill-first", key="sim_scheduling", disabled=figure2)
    max_num_seqs = setting(side.number_input, "Max running sequences (max_num_seqs)", key="sim_max_num_seqs",
                           value=256, min_value=1, max_value=65_536, disabled=figure2)
    budget = setting(side.number_input, "Token budget per step (max_num_batched_tokens)", key="sim_budget",
                     value=8192, min_value=1, max_value=10**6, disabled=figure2,
                     help="chunked: prompts longer than this are spread over several steps")
    prefix_caching = setting(side.toggle, "Prefix caching (paged)", key="sim_prefix_caching", value=True,
                             disabled=figure2, help="cached full prompt blocks are shared instead of recomputed")
    preemption = setting(side.radio, "Preemption (paged)", key="sim_preemption", value="recompute",
                         options=["recompute", "swap"], horizontal=True, disabled=figure2,
                         help="swap: preempted sequences move to a host pool over the GPU's host link "
                              "(contiguous baselines always recompute)")
    offload_gib = setting(side.number_input, "Host offload tier (GiB; 0 = off)", key="sim_offload_gib", value=0.0,
                          min_value=0.0, max_value=4096.0, step=8.0, disabled=figure2 or not prefix_caching,
                          help="prefix-cache blocks the GPU pool reuses are kept in this much host memory and loaded "
                               "back over the host link when a later prompt shares them (paged)")
    st.divider()
    ttft_slo = setting(side.number_input, "TTFT SLO (s)", key="sim_ttft_slo", value=2.0, min_value=0.001,
                       max_value=3600.0, step=0.5, help="Goodput counts the requests whose time to first token is "
                                                        "at most this")
    tpot_slo = setting(side.number_input, "TPOT SLO (s per output token)", key="sim_tpot_slo", value=0.1,
                       min_value=0.0001, max_value=60.0, step=0.01, format="%.3f",
                       help="… and whose time per output token after the first is at most this")


def build_inputs():
    if figure2:
        spec, configs = simulator.figure2_experiment(int(num_requests))
        return simulator.synthetic_workload(spec), configs
    if upload is not None:
        workload = simulator.load_trace_bytes(upload.getvalue(), upload.name, time_scale, int(num_requests))
    else:  # synthetic (an upload not given yet stops the page before it gets here)
        workload = cached_workload(preset, num_requests=int(num_requests), rate=rate or math.inf,
                                           burstiness=burstiness, n=n, beam_width=beam_width,
                                           shared_prefix_tokens=shared_prefix,
                                           max_model_len=max_model_len)
    configs = simulator.make_configs(allocators, sorted(block_sizes), model=model, gpu=gpu,
                                     max_model_len=max_model_len, capacity_tokens=capacity or None,
                                     gpu_memory_utilization=utilization, address_space=address_space,
                                     scheduling=scheduling, preemption_mode=preemption,
                                     max_num_seqs=int(max_num_seqs), max_num_batched_tokens=int(budget),
                                     enable_prefix_caching=prefix_caching,
                                     model_overrides={"dtype_bytes": dtype_bytes},
                                     gpu_overrides={"memory_bytes": memory_gib * 2**30,
                                                    "bandwidth_bytes_s": bandwidth_tbs * 1e12,
                                                    "peak_flops": peak_tflops * 1e12},
                                     kv_offload_gib=offload_gib if prefix_caching else 0.0)
    return workload, configs


key = repr((figure2, source, upload.file_id if upload else None, locals().get("time_scale"), locals().get("preset"),
            num_requests, rate,
            burstiness, n, beam_width, shared_prefix, model, gpu, capacity, utilization, max_model_len, allocators, block_sizes,
            address_space, scheduling, preemption, max_num_seqs, budget, prefix_caching, memory_gib, bandwidth_tbs,
            peak_tflops, dtype_bytes, offload_gib))
if not figure2 and source == "upload a trace" and upload is None:  # waiting for a file is not an error
    st.info("Upload a trace in the sidebar (an Azure CSV, a Mooncake JSONL, or a CSV of arrival_time_s, "
            "prompt_tokens, output_tokens): its arrivals and lengths drive the run.", icon=":material/upload_file:")
    st.stop()
if stopped("stop_sim"):  # the Stop button interrupted the last run: show what finished
    st.session_state["sim_stopped_key"] = key
partial = st.session_state.get("sim_stopped_key") == key and key not in finished_runs()
run_slot = st.empty()  # the run's progress, drawn on every run: what follows keeps its place
if st.session_state.get("sim_key") != key:
    try:
        if key in finished_runs():
            finished_runs().move_to_end(key)
            workload, configs, summary, runs, checks, figures = finished_runs()[key]
        else:
            workload, configs = build_inputs()
            if partial:
                done = simulator.finished_configs(workload, configs, kept_runs())
                if not done:
                    st.info("Stopped before any configuration finished. Press Run the rest, or change any input.")
                    if st.button("Run the rest", key="sim_resume", type="primary"):
                        st.session_state.pop("sim_stopped_key", None)
                        st.session_state.pop("sim_key", None)
                        st.rerun()
                    st.stop()
                summary, runs = simulator.compare(workload, done, reuse=kept_runs())
                st.session_state["sim_partial"] = (len(done), len(configs))
            else:
                progress = RunProgress(f"simulating {len(configs)} configurations on {len(workload):,} requests",
                                       "stop_sim", help="Stops the run; the configurations that finished are shown",
                                       slot=run_slot)
                summary, runs = simulator.compare(workload, configs, workers=WORKERS, reuse=kept_runs(),
                                                  progress=progress)
                progress.close()
            if figure2:
                summary["paper_token_states_frac"] = summary["allocator"].map(simulator.PAPER_FIGURE2_TOKEN_STATES)
            summary = report.with_allocated_share(summary)
            checks = simulator.closed_form_checks(workload, runs)
            figures = {}  # each chart built when first shown (comparison_chart), kept with the run
            if not partial:
                finished_runs()[key] = workload, configs, summary, runs, checks, figures
                while len(finished_runs()) > FINISHED_RUNS_KEPT:
                    finished_runs().popitem(last=False)
        summary = summary.copy()
        st.session_state.update(sim_key=key, sim_summary=summary, sim_series={k: r.timeseries for k, r in runs.items()},
                                sim_request_table=report.request_table(runs),
                                sim_workload=workload.summary(), sim_checks=checks, sim_block_sweep=None,
                                sim_figures=figures,
                                sim_settings=report.run_settings(workload,
                                                                 [r.config for r in runs.values()] or configs),
                                sim_configs=configs, sim_workload_obj=workload, sim_offload=None)
        if not partial:
            st.session_state.pop("sim_partial", None)
        results_store().add("simulation", f"simulation: {workload.name} × {len(runs)} configs", summary,
                            st.session_state["sim_settings"])
        results_store().add("checks", f"checks: {workload.name} × {len(runs)} configs", checks,
                            st.session_state["sim_settings"])
    except user_errors() as exc:
        st.session_state.pop("sim_key", None)
        show_error(exc)
        st.stop()

summary: pd.DataFrame = st.session_state["sim_summary"]
series: dict = st.session_state["sim_series"]
settings: dict = st.session_state["sim_settings"]
requests: pd.DataFrame = st.session_state["sim_request_table"]
if partial and st.session_state.get("sim_partial"):
    finished, total = st.session_state["sim_partial"]
    st.warning(f"Stopped: {finished} of {total} configurations finished and are shown; the others did not run.",
               icon=":material/stop_circle:")
    if st.button("Run the rest", key="sim_resume", type="primary"):
        st.session_state.pop("sim_stopped_key", None)
        st.session_state.pop("sim_key", None)
        st.rerun()
st.caption("Workload: " + report.describe_workload(st.session_state["sim_workload"]))
for sentence in report.rejection_warnings(summary):
    st.warning(sentence)
overloaded = report.overload(requests, summary)
verdict = report.overload_sentence(overloaded)
if verdict:
    st.warning(verdict, icon=":material/speed:")

st.subheader("What paging buys here")
versus = report.paged_vs_best_contiguous(summary)
if not versus.empty:
    first = versus.iloc[0]
    st.caption(f"**{first['Paged run']}** (the paged run of highest throughput) against **{first['Contiguous run']}** "
               f"(the contiguous run of highest throughput); every card compares these two runs.")
    cards = [column for _ in range(2) for column in st.columns(2)]  # two by two: each card's text fits whole
    for card, (figure, label, unit) in zip(cards, HEADLINE_CARDS):
        row = versus[versus["Figure"] == figure].iloc[0]
        value, comparison = report.compare_card(row, unit)
        # named as the figure is in the export below, so a card can be found in it
        card.metric(f"{figure} · {row['Paged run']}", value, comparison, delta_color="off", delta_arrow="off",
                    border=True, help=f"{row['Paged run']}: {row['Paged']:,.2f}{unit}; {row['Contiguous run']}: "
                                      f"{row['Best contiguous']:,.2f}{unit}")
    csv_download(versus, "headline", settings, "dl_headline",
                 "Download these figures (CSV: each card's figure by the same name, with its settings)")
elif (summary["num_requests_completed"] == 0).all():
    st.info("No run served a request, so there is nothing to compare: see the warnings above.")
st.dataframe(report.headline(summary), hide_index=True, column_config=HEADLINE_FORMAT)
csv_download(report.headline(summary), "headline-table", settings, "dl_headline_table",
             "Download this table (CSV)")
if not versus.empty:
    with st.expander("Paged against the best contiguous allocator, figure by figure", key="sim_versus_box"):
        st.dataframe(versus, hide_index=True, column_config={
            "Paged": st.column_config.NumberColumn(format="%.2f"),
            "Best contiguous": st.column_config.NumberColumn(format="%.2f"),
            "Paged / contiguous": st.column_config.NumberColumn(format="%.2f×")})
# ---- KV precision (issue 71): what FP8 adds next to paging, on the two runs the cards compare ----------------------
if not versus.empty:
    precision = setting(st.segmented_control, "KV cache precision", key="kv_precision", value="auto",
                        options=["auto", "fp8_e4m3", "fp8_e5m2"], help="auto: the model's dtype; FP8 (vLLM's "
                        "kv_cache_dtype): one byte an element, twice the tokens in the same memory")
    if precision and precision != "auto":
        precision_key = (st.session_state["sim_key"], precision)
        if st.session_state.get("sim_precision_key") != precision_key:
            try:
                by_label = {c.label: c for c in st.session_state["sim_configs"]}
                with st.spinner("simulating both runs with an FP8 KV cache…"):
                    gains = simulator.precision_gains(st.session_state["sim_workload_obj"],
                                                      by_label[versus.iloc[0]["Paged run"]],
                                                      by_label[versus.iloc[0]["Contiguous run"]], precision)
                st.session_state.update(sim_precision=gains, sim_precision_key=precision_key)
            except user_errors() as exc:
                show_error(exc)
        if st.session_state.get("sim_precision_key") == precision_key:
            gains = st.session_state["sim_precision"]
            left, right = st.columns(2)
            for card, (column, label) in zip((left, right), (("mean_batch_size", "Mean running sequences"),
                                                             ("throughput_tok_s", "Throughput"))):
                value, comparison = report.precision_card(gains, column)
                card.metric(f"{label} · {precision} against {versus.iloc[0]['Contiguous run']} (auto)", value,
                            comparison, delta_color="off", delta_arrow="off", border=True,
                            help="each factor against the contiguous run with the model's dtype in the KV cache")
            csv_download(gains, "kv-precision", {**settings, "kv_cache_dtype": precision}, "dl_precision",
                         "Download the KV precision comparison (CSV)")
with st.expander("Glossary: what these words and numbers mean", key="sim_glossary_box"):
    st.markdown("\n".join(f"- **{term}**: {text}" for term, text in report.GLOSSARY.items()))

chart(comparison_chart("waste_bars"), "waste_bars")
with st.expander("Which block size? The paged allocator at every block size from 1 to 256 tokens",
                 key="sim_block_sweep_box"):
    st.caption("The paged allocator at every block size on this workload and the other synthetic preset (first "
               f"{BLOCK_SWEEP_REQUESTS} requests each, the sidebar's model, GPU and scheduler). Throughput falls at "
               "small blocks (the kernel's per-block cost) and at large ones (fewer sequences fit).")
    unfinished_sweep("sim_block", "sim_block_sweep", "stop_block_sweep", 2 * len(simulator.BLOCK_SIZES), "runs")
    if st.button("Run the block-size sweep", key="run_block_sweep", disabled=figure2):
        st.session_state["sim_block_sweep"] = block_size_sweep(st.session_state["sim_workload_obj"],
                                                               st.session_state["sim_configs"])
    sweep = st.session_state.get("sim_block_sweep")
    if sweep is not None:
        chart(charts.block_size_lines(sweep), "block_size_sweep")
        # what the sweep ran, not the comparison's request count: its own first requests of each workload
        swept = {**settings, "num_requests": BLOCK_SWEEP_REQUESTS, "workloads": " ".join(sweep["workload"].unique())}
        csv_download(sweep, "block-size-sweep", swept, "dl_block_sweep", "Download the block-size sweep (CSV)")
with st.expander("What a CPU tier buys: the prefix cache with a host offload tier of 0 to unbounded GiB",
                 key="sim_offload_box"):
    st.caption("The first paged configuration, prefix caching on, with a host tier of each size: blocks the GPU pool "
               "reuses are kept in host memory and loaded back when a later prompt shares them. Traffic whose "
               "prompts share prefixes (multi-turn traces such as Mooncake's, a shared system prompt) gains; "
               "traffic that shares nothing gains nothing.")
    unfinished_sweep("sim_offload", "sim_offload", "stop_offload_sweep", len(simulator.OFFLOAD_TIERS_GIB),
                     "tier sizes")
    if st.button("Run the tier sweep", key="run_offload_sweep"):
        try:
            paged = next((c for c in st.session_state["sim_configs"] if c.allocator == "paged"), None)
            if paged is None:
                raise InputError("choose the paged allocator to sweep its offload tier")
            tier_rows = sweep_rows("sim_offload")
            tiers = RunProgress(f"simulating {len(simulator.OFFLOAD_TIERS_GIB)} tier sizes", "stop_offload_sweep",
                                help="Stops the sweep; the tier sizes done are shown")

            def keep_tier(row, fraction):
                tier_rows.append(row)
                tiers(fraction, f"{len(tier_rows)} of {len(simulator.OFFLOAD_TIERS_GIB)} tier sizes")

            st.session_state["sim_offload"] = simulator.offload_sweep(st.session_state["sim_workload_obj"], paged,
                                                                      on_row=keep_tier)
            tiers.close()
            sweep_done("sim_offload")
        except user_errors() as exc:
            sweep_done("sim_offload")
            show_error(exc)
    offload = st.session_state.get("sim_offload")
    if offload is not None:
        chart(charts.offload_lines(offload), "offload_sweep")
        tiers = offload.drop(columns="tier_gib")
        data_table(tiers, OFFLOAD_LABELS, formats=dict.fromkeys(tiers.columns[1:], "%.3g"))
        csv_download(offload, "offload-sweep", settings, "dl_offload", "Download the tier sweep (CSV)")
views = list(charts.COMPARISON_VIEWS)
view = st.segmented_control("Over time and per request", views, default=views[0], key="sim_chart_view",
                            help="One chart at a time (each is drawn when chosen)") or views[0]
name = charts.COMPARISON_VIEWS[view]
if name == "areas":
    runs_shown = list(series)
    name = "areas_" + (st.segmented_control("KV breakdown over time of", runs_shown, default=runs_shown[-1],
                                            key="sim_areas_run") or runs_shown[-1])
chart(comparison_chart(name), name)
st.subheader("Requests: latency, SLOs and goodput")
met = report.goodput(requests, ttft_slo, tpot_slo, summary)
st.caption(f"Each run's share of **all** its requests (rejected and unfinished ones count as missing) whose TTFT is "
           f"at most {ttft_slo:g} s and whose TPOT is at most {tpot_slo:g} s (the SLOs in the sidebar), and its "
           "goodput: requests meeting both per second of the run.")
data_table(met, report.GOODPUT_LABELS, percent=("met_ttft_frac", "met_tpot_frac", "met_both_frac"),
           formats={"goodput_req_s": "%.3f", "ttft_slo_s": "%g", "tpot_slo_s": "%g"})
csv_download(met, "goodput", {**settings, "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo}, "dl_goodput",
             "Download goodput CSV (with its SLOs and settings)")
left, right = st.columns(2)
with left:
    chart(charts.request_cdf(requests, "ttft_s"), "ttft_cdf")
with right:
    chart(charts.request_cdf(requests, "e2e_s"), "e2e_cdf")
if not overloaded.empty:
    with st.expander("Load: arrivals against service, run by run", key="sim_load_box"):
        data_table(overloaded, {"run": "Run", "offered_req_s": "Offered (requests/s)",
                                "served_req_s": "Served (requests/s)", "last_arrival_s": "Last arrival (s)",
                                "end_s": "Run ends (s)", "drain_s": "Drain after the last arrival (s)",
                                "early_queue_s": "Queue wait, first tenth (s, median)",
                                "late_queue_s": "Queue wait, last tenth (s, median)", "overloaded": "Overloaded"},
                   formats={c: "%.3g" for c in overloaded.columns if c.endswith("_s")})
        csv_download(overloaded, "load", settings, "dl_load", "Download the load table (CSV)")
csv_download(requests, "requests", settings, "dl_requests",
             "Download per-request CSV (arrival, queue, TTFT, TPOT, E2E, tokens, preemptions)")
st.subheader("Summary")
shown = ["label", "allocated_holding_frac", "token_states_frac", "reserved_frac", "internal_fragmentation_frac",
         "external_fragmentation_frac",
         "free_frac", "sharing_saving_frac", "mean_batch_size", "peak_batch_size", "throughput_tok_s", "ttft_p50_s",
         "tpot_p50_s", "preemptions", "num_requests_completed", "num_requests_rejected", "capacity_tokens",
         "host_capacity_tokens", "paper_token_states_frac"]
summary_table(summary, shown)
csv_download(summary, "summary", settings, "dl_summary",
             "Download summary CSV (with its settings)")
timeseries = pd.concat([f.assign(run=label) for label, f in series.items()], ignore_index=True)
csv_download(timeseries, "timeseries", settings,
             "dl_timeseries", "Download timeseries CSV (with its settings)")
checks: pd.DataFrame = st.session_state["sim_checks"]
failed = checks[~checks["holds"]]
with st.expander(f"Checks against closed forms: {len(checks) - len(failed)} of {len(checks)} hold",
                 expanded=not failed.empty, key="sim_checks_box"):
    st.caption("Identities every run satisfies and bounds that follow from how each allocator holds memory "
               "(`simulator.core.checks`); a row that does not hold is a simulator bug.")
    data_table(checks)
    csv_download(checks, "checks", settings, "dl_checks",
                 "Download checks CSV")

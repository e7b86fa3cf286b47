
import streamlit as st

import simulator
from lab.engine import EngineConfig
from lab.engine.live import throttled
from lab.report.results import human_label, settings_of
from lab.profiling.profile import GRIDS, Profile, profile_engine
from simulator.views import charts
from simulator.twins.twin import TwinConfig, run_twin, twin_workload
from lab.errors import InputError, user_errors
from app_pages._ui import (chart, csv_download, data_table, extrapolation_note, results_store, scheduling_radio,
                           show_error)

CALIBRATION_REDRAW_S = 2.0  # a redraw per scenario slowed the steps being measured (lab.engine.live.throttled)

st.title("Digital twin")
st.caption("Measure the real engine once (a profile of its step times), then run one workload through the engine "
           "and through the simulator on that profile — same scheduler, same configuration — and compare.")

with st.sidebar:
    model = st.text_input("Model (preset or local checkpoint directory)", "tiny")
    block_size = st.select_slider("Block size", [1, 2, 4, 8, 16, 32], 16)
    grid = st.radio("Calibration grid", GRIDS, horizontal=True, key="profile_grid",
                    help="full: the designed grid; small: for models whose prefills take seconds; quick: a handful")
    upload = st.file_uploader("…or load a profile (JSON from `python -m lab profile`)", type=["json"])
    st.divider()
    sources = [*simulator.SYNTHETIC_PRESETS, "upload a trace"]
    source = st.selectbox("Workload", sources, index=sources.index("random"), key="twin_workload",
                          help="random and fixed take the lengths below; a trace keeps its own arrival times")
    num_requests = st.number_input("Requests (trace: its first rows)", 1, 2000, 128,
                                   help="128 requests of 96 → 32 tokens at t = 0 on 256 blocks: the fidelity "
                                        "bench's saturated load")
    if source == "upload a trace":
        trace = st.file_uploader("Trace (Azure CSV, Mooncake JSONL or arrival_time_s,prompt_tokens,output_tokens)",
                                 type=["csv", "jsonl", "json"], key="twin_trace")
        time_scale = st.number_input("Time scale (multiplies arrival offsets)", 0.001, 1000.0, 1.0)
    else:
        rate = st.number_input("Arrival rate (req/s; 0 = all at t=0)", 0.0, 10_000.0, 0.0)
        input_len = st.number_input("Prompt tokens (random: mean, ±50 %)", 2, 4096, 96,
                                    disabled=source not in ("random", "fixed"))
        output_len = st.number_input("Output tokens (random: mean, ±50 %)", 2, 2048, 32,
                                     disabled=source not in ("random", "fixed"))
    num_blocks = st.number_input("KV pool (blocks)", 4, 1_000_000, 256)
    max_num_seqs = st.number_input("Max running sequences (max_num_seqs)", 1, 1024, 64, key="twin_max_num_seqs")
    scheduling = scheduling_radio("prefill-first", key="twin_scheduling")
    budget = st.number_input("Token budget per step (max_num_batched_tokens)", 1, 65_536, 4096,
                             help="chunked: prompts longer than this are spread over several steps")
    preemption = st.radio("Preemption", ["recompute", "swap"], horizontal=True)
    repeats = st.slider("Real runs (2+: noise floor)", 1, 3, 2)

if upload is not None:
    try:
        st.session_state["twin_profile"] = Profile.from_bytes(upload.getvalue(), upload.name)
    except user_errors() as exc:
        show_error(exc)
        st.stop()
if st.button("Calibrate on this machine", key="calibrate"):
    bar = st.progress(0.0, "profiling the engine…")
    try:
        show = throttled(lambda done, total: bar.progress(done / total, f"scenario {done} of {total}"),
                         CALIBRATION_REDRAW_S)
        st.session_state["twin_profile"] = profile_engine(model, block_size=block_size, grid=grid, progress=show)
    except user_errors() as exc:
        show_error(exc)
        st.stop()
    bar.empty()
profile: Profile | None = st.session_state.get("twin_profile")
if profile is None:
    st.info("Calibrate (or load a profile) first.")
    st.stop()
st.caption(f"Profile: {profile.model} on {profile.device} ({profile.dtype}, {profile.backend}), block size "
           f"{profile.block_size}, {len(profile.samples)} step shapes, held-out error median "
           f"{profile.holdout_median_rel_error:.1%}")
with st.expander("The fit, scenario by scenario (median measured vs fitted step time)"):
    data_table(profile.scenario_errors(), percent=("rel_error",))


def build_workload():
    if source != "upload a trace":
        return twin_workload(source, int(num_requests), rate or None, int(input_len), int(output_len))
    if trace is None:
        raise InputError("upload a trace file first (or choose a synthetic workload)")
    return simulator.load_trace_bytes(trace.getvalue(), trace.name, time_scale, int(num_requests))


try:  # built once a run: shown here (how long its arrivals alone keep each real run going), served below
    workload, workload_error = build_workload(), None
    shown = workload.summary()
    st.caption(f"Workload: {shown['num_requests']} requests arriving over {shown['duration_s']:.1f} s (each real "
               f"run lasts at least that), prompts {shown['prompt_mean']:.0f} and outputs "
               f"{shown['output_mean']:.0f} tokens on average")
except user_errors() as exc:
    workload, workload_error = None, exc
    if source != "upload a trace" or trace is not None:  # a bad input is named before any run
        show_error(exc)
if st.button("Run the twin", key="run_twin", type="primary"):
    if workload is None:
        if source == "upload a trace" and trace is None:
            show_error(workload_error)
        st.stop()
    try:
        config = TwinConfig(model, EngineConfig(block_size=block_size, num_blocks=int(num_blocks),
                                                max_num_seqs=int(max_num_seqs), max_num_batched_tokens=int(budget),
                                                scheduling=scheduling, preemption_mode=preemption))
        # a static note, not st.spinner: a browser animating a spinner on the same machine slows the steps measured
        note = st.empty()
        note.info("Running the engine and the simulator…")
        st.session_state["twin_result"] = run_twin(workload, config, profile, repeats)
        note.empty()
        st.session_state["twin_settings"] = settings_of(
            config, workload.summary(), repeats=repeats, profile_model=profile.model, profile_device=profile.device,
            profile_dtype=profile.dtype, profile_backend=profile.backend, profile_block_size=profile.block_size)
        results_store().add("twin", f"twin: {workload.name}, {len(workload)} requests",
                            st.session_state["twin_result"].table, st.session_state["twin_settings"])
    except user_errors() as exc:
        show_error(exc)
        st.stop()
result = st.session_state.get("twin_result")
if result is None:
    st.stop()
if result.first_difference:
    st.warning(f"The schedules differ (timed arrivals admit requests by real time): {result.first_difference}")
else:
    st.success("Identical schedules: every step planned the same in the engine and the simulator.")
if result.extrapolation:
    extrapolation_note(result.extrapolation, "Calibrate on a grid that reaches them, or read the errors with that in "
                                             "mind.")
data_table(result.table.assign(metric=result.table["metric"].map(human_label)),
           percent=("rel_error", "noise_floor"))
csv_download(result.table, "twin", st.session_state["twin_settings"], "dl_twin")
csv_download(result.steps_table(), "twin-steps", st.session_state["twin_settings"], "dl_twin_steps",
             "Download the steps (measured and modelled time)")
through_run = result.pricing_through_run()
if not through_run.empty:
    st.caption("Measured / modelled step time through the run, in fifths: a ratio that climbs shows the steps slowing "
               "under sustained load, which the profile's short scenarios do not see.")
    data_table(through_run)
left, right = st.columns(2)
with left:
    chart(charts.twin_steps(result.real_steps, result.simulated_steps, "blocks_in_use", "KV blocks in use"),
          "twin_blocks")
    chart(charts.latency_cdf(result.real_requests, result.simulated_requests, "ttft_s"), "twin_ttft")
with right:
    chart(charts.twin_steps(result.real_steps, result.simulated_steps, "num_decode_seqs", "Decode tokens/s",
                            per_second=True), "twin_tokens")
    chart(charts.latency_cdf(result.real_requests, result.simulated_requests, "tpot_s"), "twin_tpot")

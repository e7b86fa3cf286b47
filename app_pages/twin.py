
import streamlit as st

import simulator
from lab.engine import EngineConfig
from lab.engine.live import throttled
from lab.report.results import human_label, settings_of
from lab.profiling.profile import GRIDS, Profile, profile_engine
from simulator.views import charts
from simulator.twins.twin import TwinConfig, run_twin, twin_workload
from simulator.twins.twin import compare as compare_twin
from lab.errors import InputError, user_errors
from lab.report.trust import holdout_problem
from app_pages._ui import (chart, csv_download, data_table, extrapolation_note, kept_upload, results_store,
                           scheduling_radio, setting, show_error, stale_note, stopped,
                           trust_warning, RunProgress)

CALIBRATION_REDRAW_S = 2.0  # a redraw per scenario slowed the steps being measured (lab.engine.live.throttled)

st.title("Digital twin")
st.caption("Measure the real engine once (a profile of its step times), then run one workload through the engine "
           "and through the simulator on that profile — same scheduler, same configuration — and compare.")

with st.sidebar:
    side = st.sidebar
    model = setting(side.text_input, "Model (preset or local checkpoint directory)", key="twin_model", value="tiny")
    block_size = setting(side.select_slider, "Block size", key="twin_block_size", value=16,
                         options=[1, 2, 4, 8, 16, 32])
    grid = setting(side.radio, "Calibration grid", key="profile_grid", value=GRIDS[0], options=list(GRIDS),
                   horizontal=True,
                   help="full: the designed grid; small: for models whose prefills take seconds; quick: a handful")
    upload = side.file_uploader("…or load a profile (JSON from `python -m lab profile`)", type=["json"])
    st.divider()
    sources = [*simulator.SYNTHETIC_PRESETS, "upload a trace"]
    source = setting(side.selectbox, "Workload", key="twin_workload", value="random", options=sources,
                     help="random and fixed take the lengths below; a trace keeps its own arrival times")
    num_requests = setting(side.number_input, "Requests (trace: its first rows)", key="twin_requests", value=128,
                           min_value=1, max_value=2000,
                           help="128 requests of 96 → 32 tokens at t = 0 on 256 blocks: the fidelity bench's "
                                "saturated load")
    if source == "upload a trace":
        trace = kept_upload("Trace (Azure CSV, Mooncake JSONL or arrival_time_s,prompt_tokens,output_tokens)",
                            "twin_trace", side, type=["csv", "jsonl", "json"])
        time_scale = setting(side.number_input, "Time scale (multiplies arrival offsets)", key="twin_time_scale",
                             value=1.0, min_value=0.001, max_value=1000.0)
    else:
        rate = setting(side.number_input, "Arrival rate (req/s; 0 = all at t=0)", key="twin_rate", value=0.0,
                       min_value=0.0, max_value=10_000.0)
        input_len = setting(side.number_input, "Prompt tokens (random: mean, ±50 %)", key="twin_input_len", value=96,
                            min_value=2, max_value=4096, disabled=source not in ("random", "fixed"))
        output_len = setting(side.number_input, "Output tokens (random: mean, ±50 %)", key="twin_output_len",
                             value=32, min_value=2, max_value=2048, disabled=source not in ("random", "fixed"))
    num_blocks = setting(side.number_input, "KV pool (blocks)", key="twin_num_blocks", value=256, min_value=4,
                         max_value=1_000_000)
    max_num_seqs = setting(side.number_input, "Max running sequences (max_num_seqs)", key="twin_max_num_seqs",
                           value=64, min_value=1, max_value=1024)
    scheduling = scheduling_radio("prefill-first", key="twin_scheduling")
    budget = setting(side.number_input, "Token budget per step (max_num_batched_tokens)", key="twin_budget",
                     value=4096, min_value=1, max_value=65_536,
                     help="chunked: prompts longer than this are spread over several steps")
    preemption = setting(side.radio, "Preemption", key="twin_preemption", value="recompute",
                         options=["recompute", "swap"], horizontal=True)
    repeats = setting(side.slider, "Real runs (2+: noise floor)", key="twin_repeats", value=2, min_value=1,
                      max_value=3)

if upload is not None:
    try:
        st.session_state["twin_profile"] = Profile.from_bytes(upload.getvalue(), upload.name)
    except user_errors() as exc:
        show_error(exc)
        st.stop()
if stopped("stop_calibration"):
    partial = st.session_state.pop("twin_partial_profile", None)
    if partial is None:
        st.info("Calibration stopped before a measured round ended (the first round only warms the engine up): no "
                "profile was kept. Press Calibrate again, or choose the quick grid.")
    else:
        fit_so_far, measured, planned = partial
        try:
            st.session_state["twin_profile"] = fit_so_far()
            st.info(f"Calibration stopped: the profile is fitted on {measured} of {planned} measured rounds (each "
                    "scenario timed fewer times: a noisier fit than a whole calibration).")
        except user_errors() as exc:
            show_error(exc)
if st.button("Calibrate on this machine", key="calibrate"):
    progress = RunProgress(f"profiling the engine on the {grid} grid", "stop_calibration",
                           help="Stops the calibration; a profile of the measured rounds done is kept")
    try:
        show = throttled(lambda done, total: progress(done / total, f"scenario {done} of {total}"),
                         CALIBRATION_REDRAW_S)
        st.session_state["twin_profile"] = profile_engine(
            model, block_size=block_size, grid=grid, progress=show,
            on_round=lambda fit, measured, planned: st.session_state.__setitem__(
                "twin_partial_profile", (fit, measured, planned)))
    except user_errors() as exc:
        show_error(exc)
        st.stop()
    progress.close()
    st.session_state.pop("twin_partial_profile", None)
profile: Profile | None = st.session_state.get("twin_profile")
if profile is None:
    st.info("Calibrate (or load a profile) first.")
    st.stop()
st.caption(f"Profile: {profile.model} on {profile.device} ({profile.dtype}, {profile.backend}), block size "
           f"{profile.block_size}, {len(profile.samples)} step shapes, held-out error median "
           f"{profile.holdout_median_rel_error:.1%}")
trust_warning(holdout_problem(profile.holdout_median_rel_error, "The profile"))
with st.expander("The fit, scenario by scenario (median measured vs fitted step time)", key="twin_fit_box"):
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
# what a twin run is made of: the sidebar's settings and the profile (a result made with others is marked stale)
twin_key = repr((model, block_size, source, num_requests, locals().get("rate"), locals().get("input_len"),
                 locals().get("output_len"), trace.file_id if source == "upload a trace" and trace else None,
                 locals().get("time_scale"), num_blocks, max_num_seqs, scheduling, budget, preemption, repeats,
                 id(profile)))
def twin_config() -> TwinConfig:
    return TwinConfig(model, EngineConfig(block_size=block_size, num_blocks=int(num_blocks),
                                          max_num_seqs=int(max_num_seqs), max_num_batched_tokens=int(budget),
                                          scheduling=scheduling, preemption_mode=preemption))


def twin_settings(config: TwinConfig, runs: int) -> dict:
    return settings_of(config, workload.summary(), repeats=runs, profile_model=profile.model,
                       profile_device=profile.device, profile_dtype=profile.dtype, profile_backend=profile.backend,
                       profile_block_size=profile.block_size)


if stopped("stop_twin") and st.session_state.get("twin_real_runs") and workload is not None:
    # the real runs that ended before the Stop, compared with the simulator as they are
    done_runs = st.session_state.pop("twin_real_runs")
    try:
        st.session_state["twin_result"] = compare_twin(workload, done_runs, profile)
        st.session_state["twin_made_with"] = twin_key
        st.session_state["twin_settings"] = twin_settings(twin_config(), len(done_runs))
        st.info(f"Stopped: {len(done_runs)} of {repeats} real runs ended and are compared"
                + (" (one run: no noise floor)." if len(done_runs) == 1 else "."))
    except user_errors() as exc:
        show_error(exc)
if st.button("Run the twin", key="run_twin", type="primary"):
    if workload is None:
        if source == "upload a trace" and trace is None:
            show_error(workload_error)
        st.stop()
    try:
        config = twin_config()
        # a bar moved once a real run, not st.spinner: a browser animating a spinner on the same machine slows the
        # steps measured
        progress = RunProgress(f"running the engine {repeats} time(s), then the simulator", "stop_twin",
                               help="Stops after the real run going on; the runs done are compared")
        real_runs = st.session_state["twin_real_runs"] = []

        def kept(run, done, total):
            real_runs.append(run)
            progress(done / (total + 0.2), f"real run {done} of {total} done")  # the simulator's share is small

        st.session_state["twin_result"] = run_twin(workload, config, profile, repeats, on_run=kept)
        progress.close()
        st.session_state.pop("twin_real_runs", None)
        st.session_state["twin_made_with"] = twin_key
        st.session_state["twin_settings"] = twin_settings(config, repeats)
        results_store().add("twin", f"twin: {workload.name}, {len(workload)} requests",
                            st.session_state["twin_result"].table, st.session_state["twin_settings"])
    except user_errors() as exc:
        show_error(exc)
        st.stop()
result = st.session_state.get("twin_result")
if result is None:
    st.stop()
stale_note(st.session_state.get("twin_made_with"), twin_key, "The comparison below")
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

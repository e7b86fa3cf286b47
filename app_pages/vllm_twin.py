"""A real vLLM server and the simulator's prediction of it, live, on the same axes (simulator.twins.vllm_twin.LiveTwin)."""
import tempfile

import plotly.express as px
import streamlit as st

from lab.report.charts import facet_names
from lab.errors import user_errors
from lab.models.qwen3 import PRESETS, checkpoint_dir
from lab.peer.client import PeerError, missing_reason
from lab.report.results import human_label, settings_of
from lab.report.trust import holdout_problem
from app_pages._ui import chart, csv_download, extrapolation_note, setting, show_error, trust_warning
from simulator.twins.vllm_live import LiveTwin, Phase, live_series
from simulator.twins.vllm_twin import WORKLOADS, VLLMTwinConfig

REDRAW_S = 0.5
CALIBRATION_REDRAW_S = 3.0
WORKLOAD_LABELS = {"all-at-once": "All at once (t = 0)", "prefix": "Shared system prompt (256 tokens), all at once",
                   "poisson": "Poisson arrivals", "gamma": "Bursty arrivals (gamma, shape 0.5)",
                   "azure": "Azure 2023 conversation trace (a sample)"}
COLORS = {"vLLM server": "#1f77b4", "twin (simulator)": "#ff7f0e"}

st.title("vLLM twin")
st.caption("A real vLLM server (its CPU build, in the peer environment) serves a workload while the simulator — "
           "the vLLM V1 policy of the lab's scheduler, priced by a profile measured on vLLM's own engine — predicts "
           "it. Both are drawn on the same axes as the run goes; the scores come when it ends.")

with st.sidebar:
    where = setting(st.radio, "Server", key="vtwin_where", value="Start one here",
                    options=["Start one here", "Connect to a URL"], horizontal=True,
                    help="Start one: vLLM's OpenAI server on 127.0.0.1 at a free port, stopped when the run ends. "
                         "Connect: a server you run; nothing but that URL is contacted")
    url = setting(st.text_input, "Server URL", key="vtwin_url", value="http://127.0.0.1:8000",
                  disabled=where != "Connect to a URL")
    model = setting(st.selectbox, "Model (random weights; a checkpoint both load)", key="vtwin_model",
                    value=list(PRESETS)[0], options=list(PRESETS),
                    help="Connecting to a URL: the preset that server serves (its vocabulary draws the prompts)")
    workload = setting(st.selectbox, "Workload", key="vtwin_workload", value=list(WORKLOADS)[0],
                       options=list(WORKLOADS), format_func=WORKLOAD_LABELS.get)
    num_requests = setting(st.number_input, "Requests", key="vtwin_requests", value=48, min_value=1, max_value=2000)
    rate = setting(st.number_input, "Arrival rate (requests/s; Poisson, gamma, Azure)", key="vtwin_rate", value=20.0,
                   min_value=0.1, max_value=1000.0, disabled=workload in ("all-at-once", "prefix"))
    length_scale = setting(st.number_input, "ShareGPT-like lengths × (prompts ~167, outputs ~356 tokens at 1)",
                           key="vtwin_length_scale", value=0.25, min_value=0.01, max_value=1.0,
                           help="Shorter requests keep a CPU run to seconds")
    num_blocks = setting(st.number_input, "KV pool (blocks of 32 tokens)", key="vtwin_num_blocks", value=256,
                         min_value=16, max_value=100_000, disabled=where != "Start one here")
    max_num_seqs = setting(st.number_input, "Max running sequences", key="vtwin_max_num_seqs", value=16,
                           min_value=1, max_value=256)
    budget = setting(st.number_input, "Token budget per step", key="vtwin_budget", value=512, min_value=32,
                     max_value=16_384)
    calibration_rounds = setting(st.number_input, "Server calibration rounds", key="vtwin_calibration_repeats",
                                 value=3, min_value=1, max_value=10,
                                 help="Each run that calibrates the server (decode batches sent together, single "
                                      "prompts) is repeated this many times and the medians kept: more rounds steady "
                                      "the fit on a busy machine, fewer start the scored run sooner")
    remeasure = st.checkbox("Measure vLLM's engine again", False,  # an action for this visit, not a setting to share
                            help="The profile of vLLM's engine for these settings is measured once and kept beside "
                                 "the peer environment; measure it again after the machine or vLLM changed. It is "
                                 "measured while this page runs, so keep the machine otherwise quiet")

config = VLLMTwinConfig(model=model, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=budget, workloads=(workload,), num_requests=num_requests, rate=rate,
                        length_scale=length_scale, calibration_repeats=int(calibration_rounds),
                        url=url.strip() if where == "Connect to a URL" else None)
settings = {**settings_of(config), "workload": workload}

reason = missing_reason() if where == "Start one here" else None
if reason:
    st.warning(f"vLLM is not set up here: {reason}", icon=":material/info:")


def calibration_key(config: VLLMTwinConfig) -> tuple:
    """What a kept calibration was measured with: reused while these hold."""
    return (config.model, config.block_size, config.num_blocks, config.max_num_seqs, config.max_num_batched_tokens,
            config.url)


twin: LiveTwin | None = st.session_state.get("vllm_twin")
running = twin is not None and not twin.finished
left, right = st.columns([1, 5])
if left.button("Run", type="primary", disabled=running or bool(reason), key="vllm_twin_run"):
    try:
        folder = st.session_state.setdefault("vllm_twin_folder", tempfile.mkdtemp(prefix="minipaged-vllm-twin-"))
        checkpoint = checkpoint_dir(model, folder)
        cached = st.session_state.get("vllm_twin_profile")  # the calibration is reused while the server's settings hold
        same = cached is not None and cached[0] == calibration_key(config)
        twin = LiveTwin(config, checkpoint, workload, None if remeasure or not same else cached[1],
                        cached[2] if same and not remeasure else None, remeasure=remeasure)
        st.session_state["vllm_twin"] = twin.start()
        running = True
    except user_errors() as exc:
        show_error(exc)
if right.button("Stop", disabled=not running, key="vllm_twin_stop",
                help="Stops sending; what was measured stays on the page and in the exports"):
    twin.stop()


def draw(twin: LiveTwin) -> None:
    run = twin.snapshot()
    total = len(twin.workload)
    done = 0 if run is None else int(run.requests["finish_s"].notna().sum())
    label = {Phase.CALIBRATING: "calibrating on vLLM's engine (once per model and settings, ~20 s)",
             Phase.STARTING: "starting vLLM's server and calibrating it (~30 s)",
             Phase.RUNNING: f"{done} of {total} requests done", Phase.DONE: f"done: {done} of {total} requests",
             Phase.FAILED: "failed"}[twin.phase]
    st.progress(done / total, label)
    if twin.error:
        show_error(PeerError(twin.error))
    if run is not None and run.problems:
        st.warning("  \n".join(run.problems[:5]), icon=":material/warning:")
    series = live_series(twin)
    time_axis = {"t_s": "seconds from the first request"}
    cols = st.columns(2)
    with cols[0]:
        figure = px.line(series["kv_usage"], x="t_s", y="kv_usage_pct", color="source", color_discrete_map=COLORS,
                         labels={**time_axis, "kv_usage_pct": "KV cache in use (%)"}, title="KV cache usage",
                         line_shape="hv")
        chart(figure, "vllm_twin_kv")
    with cols[1]:
        figure = px.line(series["queues"], x="t_s", y="requests", color="source", line_dash="queue",
                         color_discrete_map=COLORS, labels={**time_axis, "requests": "requests"},
                         title="Running and waiting requests", line_shape="hv")
        chart(figure, "vllm_twin_queues")
    cols = st.columns(2)
    with cols[0]:
        figure = px.line(series["tokens_per_s"], x="t_s", y="tokens_per_s", color="source",
                         color_discrete_map=COLORS, labels={**time_axis, "tokens_per_s": "output tokens/s"},
                         title="Output throughput")
        chart(figure, "vllm_twin_tokens")
    with cols[1]:
        latency = series["latency"].melt(id_vars=["request", "source"], value_vars=["ttft_ms", "itl_ms"],
                                         var_name="metric", value_name="ms")
        latency["metric"] = latency["metric"].map({"ttft_ms": "time to first token", "itl_ms": "inter-token"})
        figure = px.ecdf(latency, x="ms", color="source", facet_col="metric", color_discrete_map=COLORS,
                         labels={"ms": "milliseconds"}, title="Latency per request (CDF)")
        figure.update_xaxes(matches=None)
        chart(facet_names(figure), "vllm_twin_latency")
    if twin.table is not None:
        st.subheader("How close the twin came")
        table = twin.table.copy()
        table["metric"] = table["metric"].map(human_label)
        st.dataframe(table, hide_index=True, column_config={
            "metric": "metric", "real": st.column_config.NumberColumn("vLLM server", format="%.4g"),
            "simulated": st.column_config.NumberColumn("twin", format="%.4g"),
            "error": st.column_config.NumberColumn("error", format="%.3g",
                                                   help="relative (0.05 = 5 %), percentage points, or a count: "
                                                        "see unit; KV usage: the mean absolute difference at each "
                                                        "reading of the server's /metrics"),
            "goal": st.column_config.NumberColumn("goal", format="%.3g"), "met": "goal met"})
        calibration = twin.calibration
        st.caption(f"Calibration: server steps {calibration.step_overhead_s * 1e3:+.2f} ms over the engine's profile "
                   f"({twin.step_overhead_s * 1e3:+.2f} ms as probed around this run), "
                   f"+{calibration.prefill_token_overhead_s * 1e6:.1f} µs a prefilled token; "
                   f"{calibration.request_overhead_s * 1e3:.1f} ms per request to reach the engine "
                   f"({twin.request_overhead_s * 1e3:.1f} ms as probed around this run; "
                   f"+{calibration.request_overhead_per_token_s * 1e6:.1f} µs a prompt token), "
                   f"{calibration.request_interval_s * 1e3:.2f} ms per request in vLLM's API process (shared by "
                   f"the requests it holds)"
                   f"{calibration.bound_note}. "
                   f"The profile of vLLM's engine ({twin.profile_source}): {len(twin.profile.samples)} step shapes, "
                   f"held-out error median {twin.profile.holdout_median_rel_error:.1%}.")
        # a profile measured while the machine was busy is kept like any other: say so where its scores are read
        problems = holdout_problem(twin.profile.holdout_median_rel_error, "The profile of vLLM's engine")
        trust_warning([f"{problem}. To measure it again, tick “Measure vLLM's engine again” in the sidebar and press "
                       "Run with the machine otherwise quiet" for problem in problems])
        beyond = twin.prediction.summary.get("profile_extrapolation", "") if twin.prediction is not None else ""
        if beyond:
            extrapolation_note(beyond, "The twin's prediction there leans on the fit of the profile's grid: read its "
                                       "errors with that in mind.")
    if run is not None:
        exports = {"scores": twin.table, "requests": run.requests, "server-metrics": run.metrics,
                   "kv-events": run.events, "kv-usage": series["kv_usage"], "queues": series["queues"],
                   "throughput": series["tokens_per_s"], "latency": series["latency"]}
        cols = st.columns(4)
        for index, (name, table) in enumerate((k, v) for k, v in exports.items() if v is not None):
            with cols[index % 4]:
                csv_download(table, f"vllm-twin-{name}", settings, f"dl_vllm_twin_{name}", f"{name} (CSV)")


# a slow redraw while vLLM's engine is measured and its server starts: the page's reruns share the cores with them
PHASE = twin.phase if twin is not None else None
interval = (REDRAW_S if PHASE == Phase.RUNNING else CALIBRATION_REDRAW_S) if running else None


@st.fragment(run_every=interval)
def live() -> None:
    current = st.session_state.get("vllm_twin")
    if current is None:
        st.info("Pick a workload and press Run: the first run measures vLLM's engine (~20 s), starts its server "
                "(~25 s) and calibrates it on requests of its own (~5 s); the workload then runs in seconds.",
                icon=":material/play_circle:")
        return
    draw(current)
    if running and current.phase != PHASE:
        st.rerun()  # a new phase: the page's timer follows it
    if current.finished:
        if current.profile is not None and current.calibration is not None:
            st.session_state["vllm_twin_profile"] = (calibration_key(current.config), current.profile,
                                                     current.calibration)


live()

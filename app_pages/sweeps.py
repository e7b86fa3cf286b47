import pandas as pd
import streamlit as st

import simulator
from lab.report.results import settings_of
from simulator.views import charts, report
from simulator.experiments.isolated import run_isolated
from simulator.experiments.plan import HOST_PRICE_PER_GIB_HOUR, plan_capacity
from simulator.experiments.sweep import (SIM_FIELDS, WORKLOAD_FIELDS, allocator_grids, default_store_path, failed_runs,
                                         read_table, run_sweep, runs_failing_checks)
from lab.errors import user_errors
from app_pages._ui import (RunProgress, chart, csv_download, kept_upload, results_store, setting, show_error,
                           stale_note, stopped, summary_table)

STORE = default_store_path()  # the user's own: finished runs survive reruns of the page

st.title("Sweeps & capacity planning")
st.caption("Many simulations at once as Ray tasks (a local Ray here; `python -m simulator sweep --address` for a "
           "cluster). A sweep runs every combination of the lists; a plan searches each configuration's highest "
           "request rate that meets the SLOs and prices it.")

with st.sidebar:
    side = st.sidebar
    mode = setting(side.radio, "Mode", key="sweep_mode", value="sweep",
                   options=["sweep", "capacity plan", "load a results file"])
    on_ray = setting(side.toggle, "Run on Ray (local)", key="on_ray", value=True,
                     help="off: run in the page's process (no Ray start-up; for small grids)")
    if mode != "load a results file":
        preset = setting(side.selectbox, "Workload preset", key="sweep_preset", value="sharegpt",
                         options=list(simulator.SYNTHETIC_PRESETS))
        num_requests = setting(side.number_input, "Requests per run", key="sweep_requests", value=300, min_value=20,
                               max_value=20_000, step=100)
        allocators = setting(side.multiselect, "Allocators", key="sweep_allocators",
                             value=["paged", "contiguous-oracle"], options=list(simulator.ALLOCATORS))
        replicas = setting(side.multiselect, "Replicas", key="sweep_replicas", value=[1], options=[1, 2, 4, 8, 16])
    if mode == "sweep":
        block_sizes = setting(side.multiselect, "Paged block sizes (paged runs only)", key="sweep_block_sizes",
                              value=[8, 16, 32], options=[1, 4, 8, 16, 32, 64, 128],
                              help="A contiguous allocator has no blocks: it runs once per point of the other "
                                   "lists, not once per block size")
        rates = setting(side.multiselect, "Arrival rates (req/s)", key="sweep_rates", value=[1.0, 5.0, 20.0],
                        options=[1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0])
        # OPT-13B on an A100-40GB leaves ~14,500 tokens of KV (the vLLM paper's setup): memory binds, so the
        # allocators differ; a small model on a large GPU never fills its pool and the sweep would show noise
        model = setting(side.selectbox, "Model", key="sweep_model", value="opt-13b", options=list(simulator.MODELS))
        gpu = setting(side.selectbox, "GPU", key="sweep_gpu", value="a100-40gb", options=list(simulator.GPUS))
    elif mode == "capacity plan":
        slos = setting(side.text_input, "SLOs (seconds)", key="plan_slos", value="ttft_p90=2,tpot_p90=0.2")
        models = setting(side.multiselect, "Models", key="plan_models", value=["qwen3-8b"],
                         options=list(simulator.MODELS))
        gpus = setting(side.multiselect, "GPUs", key="plan_gpus", value=["a100-80gb", "l4"],
                       options=list(simulator.GPUS))
        tps = setting(side.multiselect, "Tensor parallel", key="plan_tps", value=[1], options=[1, 2, 4, 8])
        target = setting(side.number_input, "Target rate (req/s; 0 = none)", key="plan_target", value=5.0,
                         min_value=0.0, max_value=1e6)
        offload = setting(side.multiselect, "Host offload tier per replica (GiB; paged)", key="plan_offload",
                          value=[0], options=[0, 8, 32, 128],
                          help="prefix blocks the GPU evicts kept in host memory; each size is tried")
        host_price = setting(side.number_input, "Host memory price (USD per GiB-hour)", key="plan_host_price",
                             value=HOST_PRICE_PER_GIB_HOUR, min_value=0.0, max_value=10.0, step=0.001, format="%.4f")
    else:
        upload = kept_upload("A sweep or plan table (.parquet or .csv)", "sweep_upload", side,
                             type=["parquet", "csv"])

if mode == "load a results file":
    if upload is None:
        st.info("Upload a table written by `python -m simulator sweep` or `plan`, or by this page.")
        st.stop()
    try:
        loaded = read_table(upload.getvalue(), upload.name)
        st.session_state.update(sweep_table=loaded, sweep_settings=settings_of(source_file=upload.name),
                                sweep_key=None, sweep_job="plan" if "max_rate_req_s" in loaded else "sweep")
    except user_errors() as exc:
        show_error(exc)
        st.stop()
else:
    key = repr((mode, on_ray, preset, num_requests, allocators, replicas, locals().get("block_sizes"),
                locals().get("rates"), locals().get("model"), locals().get("gpu"), locals().get("slos"),
                locals().get("models"), locals().get("gpus"), locals().get("tps"), locals().get("target"),
                locals().get("offload"), locals().get("host_price")))
    if stopped("stop_sweep"):
        st.session_state["sweep_stopped"] = key
    if st.button("Run", key="run_sweep", type="primary") and st.session_state.get("sweep_key") != key:
        progress = RunProgress("running", "stop_sweep", help="Stops the runs; finished ones are kept and shown")

        def show(done, total):
            progress(done / max(total, 1), f"{done} of {total} runs")
            return False

        try:
            workload = {"workload": preset, "num_requests": int(num_requests)}
            if mode == "sweep":
                grid = {**{k: [v] for k, v in workload.items()}, "allocator": allocators, "block_size": block_sizes,
                        "rate": rates, "replicas": replicas, "model": [model], "gpu": [gpu]}
                # each allocator swept over the settings it reads only: contiguous runs once per rate, not per block
                job, kwargs = "sweep", dict(grid=allocator_grids(grid), store=STORE)
            else:
                job, kwargs = "plan", dict(workload=workload, slos=slos, models=models, gpus=gpus, tps=tps,
                                           replicas=replicas, allocators=allocators, target_rate=target or None,
                                           offload_gib=[float(g) for g in offload] or [0.0],
                                           host_price_per_gib_hour=host_price)
            if on_ray:  # Ray lives in a child process: a driver in the server's thread took the server down
                result = run_isolated(job, {**kwargs, "parallel": True}, show)
            elif job == "sweep":
                result = run_sweep(**kwargs, parallel=False, progress=False, should_stop=show)
            else:
                result = plan_capacity(**kwargs, parallel=False, progress=False, on_progress=show)
            table = result.table
            recorded = {k: v for k, v in kwargs.items() if k not in ("store", "grid")}
            if job == "sweep":  # the lists as chosen (the grids' split is the allocators' business)
                recorded.update(allocators=allocators, block_sizes=block_sizes, rates=rates, replicas=replicas,
                                model=model, gpu=gpu)
            settings = settings_of(recorded, workload=preset, num_requests=int(num_requests), on_ray=on_ray)
            st.session_state.update(sweep_key=key, sweep_table=table, sweep_settings=settings)
            results_store().add(mode, f"{mode}: {len(table)} rows", table, settings)
        except user_errors() as exc:
            show_error(exc)
            st.stop()
        progress.close()
        st.session_state.pop("sweep_stopped", None)
    elif st.session_state.get("sweep_stopped") == key and mode == "sweep":
        # what the stopped sweep finished is in the store: the table of those (one more run, then it stops)
        try:
            grid = {"workload": [preset], "num_requests": [int(num_requests)], "allocator": allocators,
                    "block_size": block_sizes, "rate": rates, "replicas": replicas, "model": [model], "gpu": [gpu]}
            kept = run_sweep(allocator_grids(grid), STORE, parallel=False, progress=False,
                             should_stop=lambda done, total: True).table
        except user_errors() as exc:
            show_error(exc)
            st.stop()
        st.session_state.pop("sweep_stopped")
        st.session_state.update(sweep_table=kept, sweep_key=("stopped", key), sweep_settings=settings_of(
            allocators=allocators, block_sizes=block_sizes, rates=rates, replicas=replicas, model=model, gpu=gpu,
            workload=preset, num_requests=int(num_requests), on_ray=on_ray, stopped=True))

table: pd.DataFrame | None = st.session_state.get("sweep_table")
if table is None:
    st.info("Choose the lists in the sidebar and press Run.")
    st.stop()
made_with = st.session_state.get("sweep_key")
if isinstance(made_with, tuple):  # a stopped sweep's finished runs
    made_with = made_with[1]
    st.warning(f"Stopped: {len(table)} of the sweep's runs finished and are shown; press Run to run the rest (only "
               "the missing ones run).", icon=":material/stop_circle:")
if mode != "load a results file":
    stale_note(made_with, key, "The results below")
for row in failed_runs(table).head(3).itertuples():
    st.warning(f"a run failed: {row.error}")
for row in runs_failing_checks(table).head(3).itertuples():
    st.error(f"run {row.run_key} broke {row.checks_failed} closed-form check(s): a simulator bug")
if "max_rate_req_s" in table:  # a capacity plan
    chart(charts.pareto(table), "pareto")
    chosen = table[table["chosen"]]
    if chosen.empty:
        st.warning("No configuration meets the SLOs (at the target rate).")
    else:
        best = chosen.iloc[0]
        st.success(f"Cheapest: {best['model']} on {best['tp']} × {best['gpu']} × {best['replicas']} replicas, "
                   f"{best['allocator']} — up to {best['max_rate_req_s']:.2f} req/s for ${best['cost_per_hour']:.2f}/h")
else:
    bound = report.memory_bound_sentence(table)
    if bound:
        st.info(bound, icon=":material/memory:")
    varied = [c for c in table.columns[1:] if c not in ("error",) and table[c].nunique() > 1
              and c in WORKLOAD_FIELDS + SIM_FIELDS]
    metrics = [c for c in ("throughput_tok_s", "token_states_frac", "ttft_p90_s", "tpot_p90_s", "preemptions",
                           "internal_fragmentation_frac") if c in table]
    if len(varied) >= 1 and metrics:
        value = st.selectbox("Value", metrics, format_func=report.label)
        left, right = st.columns(2)
        # rate across, allocator down where both vary: every allocator has a rate (a contiguous one no block size)
        first = varied.index("rate") if "rate" in varied else 0
        second = varied.index("allocator") if "allocator" in varied and first != varied.index("allocator") else \
            min(1 if first == 0 else 0, len(varied) - 1)
        x = left.selectbox("x", varied, index=first, format_func=report.label)
        y = right.selectbox("y", varied, index=second, format_func=report.label)
        if x != y:
            chart(charts.sweep_heatmap(table, x, y, value), "sweep_heatmap")
        chart(charts.sweep_lines(table, x, value, y if x != y else None), "sweep_lines")
summary_table(table)
csv_download(table, "plan" if "max_rate_req_s" in table else "sweep", st.session_state["sweep_settings"], "dl_sweep")

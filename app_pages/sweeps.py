import pandas as pd
import streamlit as st

import simulator
from lab.report.results import settings_of
from simulator.views import charts, report
from simulator.experiments.isolated import run_isolated
from simulator.experiments.plan import HOST_PRICE_PER_GIB_HOUR, plan_capacity
from simulator.experiments.sweep import (SIM_FIELDS, WORKLOAD_FIELDS, default_store_path, failed_runs, read_table, run_sweep,
                             runs_failing_checks)
from lab.errors import user_errors
from app_pages._ui import chart, csv_download, results_store, show_error, summary_table

STORE = default_store_path()  # the user's own: finished runs survive reruns of the page

st.title("Sweeps & capacity planning")
st.caption("Many simulations at once as Ray tasks (a local Ray here; `python -m simulator sweep --address` for a "
           "cluster). A sweep runs every combination of the lists; a plan searches each configuration's highest "
           "request rate that meets the SLOs and prices it.")

with st.sidebar:
    mode = st.radio("Mode", ["sweep", "capacity plan", "load a results file"], key="sweep_mode")
    on_ray = st.toggle("Run on Ray (local)", value=True, key="on_ray",
                       help="off: run in the page's process (no Ray start-up; for small grids)")
    if mode != "load a results file":
        preset = st.selectbox("Workload preset", simulator.SYNTHETIC_PRESETS)
        num_requests = st.number_input("Requests per run", 20, 20_000, 300, step=100)
        allocators = st.multiselect("Allocators", simulator.ALLOCATORS, default=["paged", "contiguous-oracle"])
        replicas = st.multiselect("Replicas", [1, 2, 4, 8, 16], default=[1])
    if mode == "sweep":
        block_sizes = st.multiselect("Paged block sizes", [1, 4, 8, 16, 32, 64, 128], default=[8, 16, 32])
        rates = st.multiselect("Arrival rates (req/s)", [1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0],
                               default=[5.0, 20.0])
        model = st.selectbox("Model", list(simulator.MODELS), index=list(simulator.MODELS).index("qwen3-8b"))
        gpu = st.selectbox("GPU", list(simulator.GPUS), index=list(simulator.GPUS).index("a100-40gb"))
    elif mode == "capacity plan":
        slos = st.text_input("SLOs (seconds)", "ttft_p90=2,tpot_p90=0.2")
        models = st.multiselect("Models", list(simulator.MODELS), default=["qwen3-8b"])
        gpus = st.multiselect("GPUs", list(simulator.GPUS), default=["a100-80gb", "l4"])
        tps = st.multiselect("Tensor parallel", [1, 2, 4, 8], default=[1])
        target = st.number_input("Target rate (req/s; 0 = none)", 0.0, 1e6, 5.0)
        offload = st.multiselect("Host offload tier per replica (GiB; paged)", [0, 8, 32, 128], default=[0],
                                 help="prefix blocks the GPU evicts kept in host memory; each size is tried")
        host_price = st.number_input("Host memory price (USD per GiB-hour)", 0.0, 10.0, HOST_PRICE_PER_GIB_HOUR,
                                     step=0.001, format="%.4f")
    else:
        upload = st.file_uploader("A sweep or plan table (.parquet or .csv)", type=["parquet", "csv"])

if mode == "load a results file":
    if upload is None:
        st.info("Upload a table written by `python -m simulator sweep` or `plan`, or by this page.")
        st.stop()
    try:
        st.session_state.update(sweep_table=read_table(upload.getvalue(), upload.name),
                                sweep_settings=settings_of(source_file=upload.name))
    except user_errors() as exc:
        show_error(exc)
        st.stop()
else:
    key = repr((mode, on_ray, preset, num_requests, allocators, replicas, locals().get("block_sizes"),
                locals().get("rates"), locals().get("model"), locals().get("gpu"), locals().get("slos"),
                locals().get("models"), locals().get("gpus"), locals().get("tps"), locals().get("target"),
                locals().get("offload"), locals().get("host_price")))
    if st.button("Run", key="run_sweep", type="primary") and st.session_state.get("sweep_key") != key:
        bar, stop = st.progress(0.0, "running…"), st.empty()
        stop.button("Stop", key="stop_sweep", help="Interrupts the runs (finished ones are kept)")

        def show(done, total):
            bar.progress(done / max(total, 1), f"{done} of {total} done")
            return False

        try:
            workload = {"workload": preset, "num_requests": int(num_requests)}
            if mode == "sweep":
                grid = {**{k: [v] for k, v in workload.items()}, "allocator": allocators, "block_size": block_sizes,
                        "rate": rates, "replicas": replicas, "model": [model], "gpu": [gpu]}
                job, kwargs = "sweep", dict(grid=grid, store=STORE)
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
            settings = settings_of({k: v for k, v in kwargs.items() if k != "store"}, workload=preset,
                                   num_requests=int(num_requests), on_ray=on_ray)
            st.session_state.update(sweep_key=key, sweep_table=table, sweep_settings=settings)
            results_store().add(mode, f"{mode}: {len(table)} rows", table, settings)
        except user_errors() as exc:
            show_error(exc)
            st.stop()
        bar.empty()
        stop.empty()

table: pd.DataFrame | None = st.session_state.get("sweep_table")
if table is None:
    st.info("Choose the lists in the sidebar and press Run.")
    st.stop()
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
    varied = [c for c in table.columns[1:] if c not in ("error",) and table[c].nunique() > 1
              and c in WORKLOAD_FIELDS + SIM_FIELDS]
    metrics = [c for c in ("throughput_tok_s", "token_states_frac", "ttft_p90_s", "tpot_p90_s", "preemptions",
                           "internal_fragmentation_frac") if c in table]
    if len(varied) >= 1 and metrics:
        value = st.selectbox("Value", metrics, format_func=report.label)
        left, right = st.columns(2)
        x = left.selectbox("x", varied, index=0, format_func=report.label)
        y = right.selectbox("y", varied, index=min(1, len(varied) - 1), format_func=report.label)
        if x != y:
            chart(charts.sweep_heatmap(table, x, y, value), "sweep_heatmap")
        chart(charts.sweep_lines(table, x, value, y if x != y else None), "sweep_lines")
summary_table(table)
csv_download(table, "sweep" if "run_key" in table else "plan", st.session_state["sweep_settings"], "dl_sweep")

import dataclasses

import streamlit as st
import torch

import paged_kernels
from lab.bench.kernels import (KernelBenchConfig, baseline_problem, check_against_reference, run_kernel_bench,
                               run_precision_bench)
from lab.report.charts import kernel_bandwidth_figure, kernel_time_figure
from lab.engine.live import throttled
from lab.report.results import settings_of
from lab.errors import InputError, user_errors
from lab.report.trust import spread_problems
from app_pages._ui import (RunProgress, chart, csv_download, data_table, results_store, setting, show_error,
                           stale_note, stopped, trust_warning)

cached_check = st.cache_data(check_against_reference, show_spinner="checking against the reference…")
SHAPES = {"Qwen3-0.6B/1.7B (16 q / 8 kv heads)": (16, 8), "Qwen3-4B/8B (32 / 8)": (32, 8),
          "Qwen3-14B (40 / 8)": (40, 8), "Qwen3-32B (64 / 8)": (64, 8)}

st.title("Kernel lab")
usable, reason = paged_kernels.cupy_status()
if not usable:
    st.info(f"The CuPy CUDA kernels need an NVIDIA GPU: {reason}. Running the CPU backends (torch, reference).")
with st.sidebar:
    side = st.sidebar
    available = paged_kernels.available_backends()
    backends = setting(side.multiselect, "Backends", key="kernel_backends",
                       value=["cupy"] if usable else ["torch"], options=available)
    shape = setting(side.selectbox, "Heads (head_dim 128)", key="kernel_shape", value=list(SHAPES)[0],
                    options=list(SHAPES))
    batches = setting(side.multiselect, "Batch sizes", key="kernel_batches", value=[1, 8],
                      options=[1, 2, 4, 8, 16, 32, 64])
    contexts = setting(side.multiselect, "Context lengths", key="kernel_contexts", value=[256, 1024],
                       options=[128, 256, 512, 1024, 2048, 4096, 8192, 32768])
    block_size = setting(side.select_slider, "Block size", key="kernel_block_size", value=16,
                         options=[1, 3, 7, 8, 16, 32, 64, 128, 256])
    dtypes = ["float32", "float16", "bfloat16"] if usable else ["float32", "bfloat16"]
    dtype = setting(side.selectbox, "dtype", key="kernel_dtype", value="float32", options=dtypes)
    repeats = setting(side.slider, "Repeats (median)", key="kernel_repeats", value=5, min_value=1, max_value=20)
    run = st.button("Run sweep", type="primary", key="run")

num_q_heads, num_kv_heads = SHAPES[shape]
config = KernelBenchConfig(device="cuda" if usable else "cpu", dtype=getattr(torch, dtype),
                           batch_sizes=tuple(sorted(batches)), context_lens=tuple(sorted(contexts)),
                           num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size,
                           backends=tuple(b for b in backends if b != "reference"), repeats=repeats)
current = settings_of(config, shape=shape)
was_stopped = stopped("stop_kernels")
if was_stopped and st.session_state.get("kernel_partial") is not None:
    # Stop keeps the shapes measured so far (their baseline unchecked: the sweep did not finish)
    partial = st.session_state.pop("kernel_partial").assign(device=config.device, dtype=dtype, block_size=block_size)
    st.session_state.update(kernel_table=partial, kernel_settings={**current, "stopped": True}, kernel_stopped=True)
elif was_stopped and "kernel_table" not in st.session_state:
    st.info("Stopped before any shape was timed. Press Run sweep to time them.")
    st.stop()
elif run or "kernel_table" not in st.session_state:
    try:
        if not config.backends:
            raise InputError("choose at least one of the torch / cupy backends to time")
        if not batches or not contexts:
            raise InputError("choose at least one batch size and one context length")
        correctness = cached_check(dataclasses.replace(config, backends=tuple(backends)))
        st.session_state["kernel_correctness"] = correctness
        progress = RunProgress(f"timing {len(config.shape_list())} shapes", "stop_kernels",
                               help="Stops the sweep; the shapes timed so far are kept")
        # redraws cost time
        show = throttled(lambda done, total: progress(done / total, f"{done} of {total} shapes"), 1.0)
        st.session_state["kernel_partial"] = None
        table = run_kernel_bench(config, progress=show, refuse_noisy=False,
                                 on_rows=lambda rows: st.session_state.__setitem__("kernel_partial", rows))
        progress.close()
        st.session_state.pop("kernel_partial", None)
        st.session_state.update(kernel_table=table, kernel_settings=current, kernel_stopped=False)
        results_store().add("kernels", f"kernels: {shape}, {dtype}, B={block_size}", table, current)
    except user_errors() as exc:
        show_error(exc)
        st.stop()

table = st.session_state["kernel_table"]
made_with = {k: v for k, v in st.session_state["kernel_settings"].items() if k != "stopped"}
stale_note(repr(made_with), repr(current), "The timings below")
if st.session_state.get("kernel_stopped"):
    st.warning(f"Stopped: {table[['batch', 'context']].drop_duplicates().shape[0]} of {len(config.shape_list())} "
               "shapes were timed and are shown.", icon=":material/stop_circle:")
baseline = None if st.session_state.get("kernel_stopped") else baseline_problem(table)
trust_warning(([f"{baseline[0].upper()}{baseline[1:]}, timed twice."] if baseline else [])
              + spread_problems(table, "median_ms", "max_ms", ["kernel", "batch", "context"]))
st.subheader("Correctness against the float64 reference")
data_table(st.session_state["kernel_correctness"],
           {"max_rel_err": "Max relative error vs the float64 reference"}, formats={"max_rel_err": "%.1e"})
settings = st.session_state["kernel_settings"]
csv_download(st.session_state["kernel_correctness"], "kernel-correctness", settings, "dl_correctness")
left, right = st.columns(2)
with left:
    chart(kernel_time_figure(table), "kernel_time")
with right:
    chart(kernel_bandwidth_figure(table), "kernel_bandwidth")
st.subheader("Timings (paged vs SDPA on contiguous K/V)")
data_table(table, {"kernel": "Kernel", "batch": "Batch", "context": "Context (tokens)", "median_ms": "Median (ms)",
                   "min_ms": "Fastest call (ms)", "max_ms": "Slowest call (ms)", "vs_sdpa": "Median vs SDPA's",
                   "kv_gb_per_s": "K/V read (GB/s)", "max_rel_err": "Max relative error vs SDPA"},
           formats={"context": "localized", "median_ms": "%.3f", "min_ms": "%.3f", "max_ms": "%.3f",
                    "vs_sdpa": "%.2f×", "kv_gb_per_s": "%.1f", "max_rel_err": "%.1e"})
st.caption(f"Each time is the median of {config.repeats} calls; fastest and slowest call give its spread.")
csv_download(table, "kernels", settings, "dl_kernels")

# ---- KV precision (issue 71): the decode kernel over FP8 caches against the full-precision one -------------------
st.subheader("KV precision: FP8 against the model's dtype")
st.caption(f"The torch backend's decode attention over a {dtype} cache (`auto`) and over FP8 caches (one byte an "
           "element, scale 1.0, dequantized as the kernel loads them), on the sweep's shapes; the errors on a small "
           "shape against the float64 reference: over what the cache holds (the kernel's own arithmetic) and over "
           "the keys and values before they were stored (what the precision costs).")
if st.button("Compare KV precision", key="run_precision"):
    try:
        if not batches or not contexts:
            raise InputError("choose at least one batch size and one context length")
        with st.spinner("timing the decode kernel per KV precision…"):
            precision_table = run_precision_bench(dataclasses.replace(config, backends=("torch",)))
        st.session_state.update(kernel_precision=precision_table,
                                kernel_precision_settings=settings_of(config, shape=shape, backend="torch"))
        results_store().add("kernels", f"KV precision: {shape}, {dtype}, B={block_size}", precision_table,
                            st.session_state["kernel_precision_settings"])
    except user_errors() as exc:
        show_error(exc)
if "kernel_precision" in st.session_state:
    precision_table = st.session_state["kernel_precision"]
    data_table(precision_table, {"kv_cache_dtype": "KV cache", "median_ms": "Median (ms)",
                                 "vs_auto": "Median vs auto's",
                                 "kv_bytes": "K/V bytes read", "kv_gb_per_s": "K/V read (GB/s)",
                                 "kernel_rel_err": "Error vs float64 of the stored K/V",
                                 "rel_err_vs_fp64": "Error vs float64 of the original K/V"},
               formats={"context": "localized", "median_ms": "%.3f", "vs_auto": "%.2f×", "kv_gb_per_s": "%.1f",
                        "kernel_rel_err": "%.1e", "rel_err_vs_fp64": "%.1e"})
    csv_download(precision_table, "kv-precision-kernels", st.session_state["kernel_precision_settings"],
                 "dl_kernel_precision", "Download the KV precision table (CSV)")

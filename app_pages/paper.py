import pandas as pd
import streamlit as st

from lab.report.results import settings_of
from simulator.views import charts
from simulator.experiments.paper import (FIGURES, SAVED_RUN, SUMMARY_COLUMNS, TINY, compute_figures, load_figures,
                                         run_settings)
from lab.errors import user_errors
from app_pages._ui import (RunProgress, chart, csv_download, results_store, setting, show_error, stale_note,
                           stopped, summary_table)

st.title("The vLLM paper, reproduced")
st.caption("Kwon et al., SOSP 2023: the simulator's numbers beside the paper's, figure by figure, with a verdict "
           "(reproduced within 25 %, partly when the order or trend holds, not otherwise).")

with st.sidebar:
    figures = setting(st.multiselect, "Figures", key="paper_figures", value=["2", "13", "19"], options=list(FIGURES))
    num_requests = setting(st.number_input, "Requests per workload", key="paper_requests", value=1000, min_value=50,
                           max_value=20_000, step=250)
    with_tiny = setting(st.toggle, "Also run the real tiny engine (Figures 18, 19)", key="paper_tiny", value=False,
                        help="Profiles the tiny Qwen3 on this machine at block sizes 1-64 and runs it beside the "
                             "simulator: a few minutes on a CPU")

LAB_COLUMN = {"lab": st.column_config.NumberColumn(format="%.3g", help="the lab's value (the CSV keeps every digit)")}

paper_key = repr((figures, num_requests, with_tiny))
done: dict = st.session_state.get("paper_done") or {}
if stopped("stop_paper") and done:  # the figures finished before the Stop
    tiny = TINY if with_tiny else None
    st.session_state.update(paper_summary=pd.DataFrame([row for _, rows in done.values() for row in rows],
                                                       columns=SUMMARY_COLUMNS),
                            paper_tables={figure: table for figure, (table, _) in done.items()},
                            paper_settings=run_settings(list(done), int(num_requests), tiny), paper_done=None, paper_key=paper_key)
    st.info(f"Stopped: {len(done)} of {len(figures)} figures finished and are shown.")
if st.button("Run", key="run_paper", type="primary"):
    try:
        progress = RunProgress(f"computing {len(figures)} figure(s)", "stop_paper",
                               help="Stops the run; the figures finished are shown")
        done = st.session_state["paper_done"] = {}

        def keep(figure, table, rows, fraction):
            done[figure] = (table, rows)
            progress(fraction, f"Figure {figure} done")

        summary, tables = compute_figures(figures, int(num_requests), TINY if with_tiny else None, on_figure=keep)
        progress.close()
        st.session_state.update(paper_done=None, paper_key=paper_key, paper_summary=summary, paper_tables=tables,
                                paper_settings=run_settings(figures, int(num_requests), TINY if with_tiny else None))
        results_store().add("paper", f"paper figures {','.join(figures)}", summary, st.session_state["paper_settings"])
    except user_errors() as exc:
        show_error(exc)
        st.stop()
summary = st.session_state.get("paper_summary")
if summary is None and (saved := load_figures(SAVED_RUN)) is not None:
    summary, st.session_state["paper_tables"], saved_settings = saved
    source = str(SAVED_RUN.relative_to(SAVED_RUN.parents[2]))
    st.session_state["paper_settings"] = settings_of(saved_settings, source=source)
    requests = saved_settings.get("num_requests")
    st.caption(f"Showing the last full run ({source}" + (f", {requests:,} requests per workload" if requests else "")
               + "); press Run to recompute.")
if summary is None:
    st.info("Choose figures and press Run (all seven take a few minutes at 2,000 requests).")
    st.stop()
stale_note(st.session_state.get("paper_key"), paper_key, "The figures below")
counts = summary["verdict"].value_counts()
st.markdown(" · ".join(f"**{counts.get(v, 0)}** {v}" for v in ("reproduced", "partly", "not")))
chart(charts.paper_vs_lab(summary), "paper_vs_lab")
st.dataframe(summary, hide_index=True, column_config=LAB_COLUMN)
settings = st.session_state["paper_settings"]
csv_download(summary, "paper-summary", settings, "dl_paper")
tables = st.session_state["paper_tables"]
for tab, (figure, table) in zip(st.tabs([f"Figure {figure}" for figure in tables]), tables.items()):
    with tab:
        chart(charts.paper_figure(figure, table), f"paper_figure{figure}")
        st.dataframe(summary[summary["figure"].astype(str).str.fullmatch(f"{figure}[a-z]?")], hide_index=True,
                     column_config=LAB_COLUMN)
        summary_table(table)
        csv_download(table, f"paper-figure{figure}", settings, f"dl_figure{figure}")

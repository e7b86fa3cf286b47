"""Streamlit glue shared by the pages: the session's result store, error display, CSV downloads, charts."""
from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from lab.errors import LabError
from lab.profiling.profile import extrapolation_warning
from lab.report.results import ResultStore, export_name, human_columns, human_label, to_csv_bytes, with_settings


@dataclass(frozen=True, slots=True)
class PageEntry:
    """One page of the app: its script, its title in the navigation, its icon and what it is for (the Overview's
    list)."""

    path: str
    title: str
    icon: str
    blurb: str


# The app's pages in navigation order (app.py's navigation and the Overview's list both read this)
PAGES = (
    PageEntry("app_pages/overview.py", "Overview", ":material/home:", "what paging is, and this machine"),
    PageEntry("app_pages/memory_simulator.py", "Memory simulator", ":material/stacked_bar_chart:",
              "contiguous vs paged on your traffic"),
    PageEntry("app_pages/block_pool.py", "Block pool", ":material/grid_view:",
              "watch paging, sharing and copy-on-write"),
    PageEntry("app_pages/kernel_lab.py", "Kernel lab", ":material/memory:", "paged attention vs SDPA"),
    PageEntry("app_pages/runtime.py", "Qwen3 runtime", ":material/smart_toy:", "the paged engine live"),
    PageEntry("app_pages/twin.py", "Digital twin", ":material/compare:",
              "the engine measured, then predicted by the simulator"),
    PageEntry("app_pages/vllm_twin.py", "vLLM twin", ":material/dns:",
              "a real vLLM server and the simulator's prediction of it, live"),
    PageEntry("app_pages/paper.py", "vLLM paper", ":material/science:",
              "its figures beside the simulator's, with verdicts"),
    PageEntry("app_pages/sweeps.py", "Sweeps & planning", ":material/grid_on:",
              "many runs on Ray, cheapest config for an SLO"),
    PageEntry("app_pages/benchmarks.py", "Benchmarks", ":material/table_chart:",
              "the headline figures against their goals, and every result of this session"),
)


def results_store() -> ResultStore:
    if "results" not in st.session_state:
        st.session_state["results"] = ResultStore()
    return st.session_state["results"]


def csv_download(table, kind: str, settings: dict, key: str, label: str = "Download CSV") -> None:
    """A download of ``table`` that says what produced it: the ``settings`` (``lab.report.results.settings_of``) as leading
    columns and in the file name, with a timestamp, so two exports can be told apart."""
    st.download_button(label, lambda: to_csv_bytes(with_settings(table, settings)),  # made when clicked, not per run
                       file_name=export_name(kind, settings), mime="text/csv", key=key,
                       on_click="ignore")  # a download never reruns (or stops) the page


SCHEDULING_LABELS = {"prefill-first": "Prefill first (vLLM 0.1, the paper)", "chunked": "Chunked prefill",
                     "vllm": "vLLM V1"}


def scheduling_radio(default: str, key: str, disabled: bool = False) -> str:
    """The scheduling policy (``lab.sched.scheduler.SCHEDULING_MODES``), named as people know them."""
    modes = list(SCHEDULING_LABELS)
    return st.radio("Scheduling", modes, index=modes.index(default), format_func=SCHEDULING_LABELS.get,
                    horizontal=True, key=key, disabled=disabled,
                    help="Prefill first: a step prefills waiting prompts whole, or else decodes. Chunked: every step "
                         "decodes all running sequences, then fills the token budget with prompt chunks (Sarathi), "
                         "admitting a prompt when its blocks and its first decode's fit. vLLM V1: chunked as vLLM V1 "
                         "schedules (a chunk's blocks taken as it is scheduled, the newest request preempted when a "
                         "block is short; docs/vllm.md)")


def show_error(exc: Exception) -> None:
    """The error's message, and for the lab's own errors what to do about it."""
    hint = "" if not isinstance(exc, LabError) else "  \nChange the setting or file it names and the page runs again."
    st.error(f"{exc}{hint}", icon=":material/error:")


def extrapolation_note(beyond: str, advice: str) -> None:
    """A twin's warning that it priced steps beyond its profile (``lab.profiling.profile.extrapolation_warning`` of
    ``beyond``), then what to do about it."""
    warning = extrapolation_warning(beyond)
    st.warning(f"{warning[0].upper()}{warning[1:]}. {advice}")


def data_table(frame, labels: dict | None = None, percent: tuple[str, ...] = (), formats: dict | None = None) -> None:
    """``frame`` with its columns named for a person (``lab.report.results.human_columns``; ``labels`` first), the
    ``percent`` columns (fractions) shown as percentages, ``formats`` (name: printf format) for others. Only the
    display: an export keeps the names."""
    labels, formats = labels or {}, {**dict.fromkeys(percent, "percent"), **(formats or {})}
    st.dataframe(human_columns(frame, labels), hide_index=True, column_config={
        labels.get(name) or human_label(name): st.column_config.NumberColumn(format=style)
        for name, style in formats.items() if name in frame})


def summary_table(frame, columns: list[str] | None = None) -> None:
    """Simulator results (``columns`` of them; default all) as a person reads them: ``simulator.views.report.readable``'s
    labels, fractions of the KV pool as percentages."""
    from simulator.views import report

    st.dataframe(report.readable(frame, list(frame.columns) if columns is None else columns), hide_index=True,
                 column_config={label: st.column_config.NumberColumn(format="%.1f %%")
                                for label in map(report.LABELS.get, report.PERCENT_COLUMNS)})


def chart(figure, key: str) -> None:
    st.plotly_chart(figure, key=key,
                    config={"toImageButtonOptions": {"format": "png", "filename": key}, "displaylogo": False})

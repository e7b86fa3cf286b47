"""Streamlit glue shared by the pages: the session's result store, error display, CSV downloads, charts."""
from __future__ import annotations

import time
from dataclasses import dataclass

import streamlit as st

from lab.errors import LabError
from lab.profiling.profile import extrapolation_warning
from lab.report import url_settings
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
    return setting(st.radio, "Scheduling", key=key, value=default, options=list(SCHEDULING_LABELS),
                   format_func=SCHEDULING_LABELS.get, horizontal=True, disabled=disabled,
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


# ---- settings that survive a change of page and travel in the URL ----------------------------------------------
KEPT = "_kept_settings"  # widget key -> its last value, for the whole session (Streamlit drops a widget's own state
KEPT_FILES = "_kept_files"  # when its page is left); uploaded files by widget key, which no URL can carry
# each widget's value argument, by widget: what a kept value replaces (passing both draws Streamlit's warning)
_DEFAULT_ARGUMENT = {"selectbox": "index", "radio": "index", "multiselect": "default", "segmented_control": "default",
                     "pills": "default"}


def setting(widget, label: str, *, key: str, value, **kwargs):
    """``widget`` (``st.slider``, ``st.selectbox``, … or the same on ``st.sidebar``) labelled ``label`` whose value
    is kept for the session and in the URL's query parameter ``key`` (unique across the app): leaving the page and
    coming back, or opening the URL in a new browser, shows it as it was. ``value`` is the default (an option
    itself for a selectbox or radio; a list for a multiselect); ``options``, ``min_value`` and ``max_value`` given
    as keywords also check a value read from a URL (one they refuse falls back to the default). The URL holds only
    values that differ from their defaults."""
    kept = st.session_state.setdefault(KEPT, {})
    options = kwargs.get("options")
    if key not in st.session_state:  # the widget is not alive: its page is new to this session, or was left
        if key in kept and (options is None or _allowed(kept[key], options)):
            st.session_state[key] = kept[key]
        elif key in st.query_params:
            read = url_settings.decode(st.query_params[key], value, options, kwargs.get("min_value"),
                                       kwargs.get("max_value"))
            if read is not url_settings.MISSING:
                st.session_state[key] = read
    if key not in st.session_state:
        name = _DEFAULT_ARGUMENT.get(getattr(widget, "__name__", ""), "value")
        kwargs[name] = list(options).index(value) if name == "index" else value
    result = widget(label, key=key, **kwargs)
    kept[key] = result
    text = url_settings.encode(result)
    if result == value or (isinstance(value, (list, tuple)) and list(result) == list(value)):
        if key in st.query_params:
            del st.query_params[key]
    elif st.query_params.get(key) != text:
        st.query_params[key] = text
    return result


def leave_settings_of_other_pages(page: str) -> None:
    """On a change of page (``page``: its URL path), take the settings of the page left out of the URL: each page's
    link carries its own (its widgets write them as they draw), and the session keeps them all."""
    last = st.session_state.get("_page")
    st.session_state["_page"] = page
    if last is not None and last != page:
        for key in st.session_state.get(KEPT, {}):
            if key in st.query_params:
                del st.query_params[key]


def _allowed(value, options) -> bool:
    choices = list(options)
    return all(item in choices for item in value) if isinstance(value, list) else value in choices


@dataclass(frozen=True, slots=True)
class KeptFile:
    """An uploaded file kept for the session: what a page reads of ``st.file_uploader``'s answer."""

    name: str
    data: bytes
    file_id: str

    def getvalue(self) -> bytes:
        return self.data


def kept_upload(label: str, key: str, container=None, **kwargs) -> KeptFile | None:
    """``st.file_uploader`` whose file stays for the session when the page is left and come back to (a URL cannot
    carry a file: the page says so beside it); removing the file in the uploader forgets it."""
    files = st.session_state.setdefault(KEPT_FILES, {})
    where = container or st

    def removed():  # the user cleared the uploader (a page left and come back to calls nothing)
        if st.session_state.get(key) is None:
            files.pop(key, None)

    upload = where.file_uploader(label, key=key, on_change=removed, **kwargs)
    if upload is not None:
        files[key] = KeptFile(upload.name, upload.getvalue(), upload.file_id)
        return files[key]
    kept = files.get(key)
    if kept is not None:
        where.caption(f"Using **{kept.name}**, uploaded earlier in this session. Files stay for the session only: a "
                      "shared link carries the other settings, not the file.")
    return kept


# ---- long runs: progress, an estimate of the time left, and a Stop that keeps what finished ---------------------
class RunProgress:
    """A progress bar that says how far a run is, how long it has taken and about how long is left (from the pace so
    far), with a Stop button beside it. Call it with the fraction done; ``close`` removes both. A click on Stop
    reruns the page (Streamlit interrupts the run at its next redraw): the page reads ``stopped(key)`` then.
    ``slot``: an ``st.empty()`` the page draws on every run, so that the elements below keep their places (and an
    open expander stays open) whether or not this run needed a progress bar; by default a new one here."""

    def __init__(self, what: str, key: str, help: str = "Stops the run; what finished is kept", slot=None):
        self.what, self.key, self.started = what, key, time.monotonic()
        self.slot = st.empty() if slot is None else slot
        box = self.slot.container()
        self.bar = box.progress(0.0, f"{what}…")
        box.button("Stop", key=key, on_click=_mark_stopped, args=(key,), help=help)

    def __call__(self, fraction: float, detail: str = "") -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        elapsed = time.monotonic() - self.started
        text = f"{self.what}: {fraction:.0%} done, {elapsed:,.0f} s so far"
        if 0.02 <= fraction < 1.0 and elapsed >= 1.0:
            text += f", about {elapsed * (1 - fraction) / fraction:,.0f} s left"
        self.bar.progress(fraction, text + (f" ({detail})" if detail else ""))

    def close(self) -> None:
        self.slot.empty()


def _mark_stopped(key: str) -> None:
    st.session_state[f"{key}_clicked"] = True


def stopped(key: str) -> bool:
    """Whether the Stop button of a ``RunProgress`` keyed ``key`` was pressed since the last call (read once)."""
    return bool(st.session_state.pop(f"{key}_clicked", False))


def stale_note(made_with, current, what: str = "These results") -> bool:
    """Marks results made with settings other than the sidebar's: ``made_with`` and ``current`` are the settings'
    keys. Returns whether they differ."""
    if made_with is None or made_with == current:
        return False
    st.warning(f"{what} were made with other settings than the sidebar's now: settings changed — press Run to "
               "update them.", icon=":material/update:")
    return True


def trust_warning(problems: list[str]) -> None:
    """One warning that lists why numbers on the page should not be taken at face value (``lab.report.trust``): a
    spread too wide for a median to stand for its calls, a model's error on data it was not fitted to."""
    if problems:
        st.warning("Read these numbers with care:\n" + "\n".join(f"- {problem}" for problem in problems),
                   icon=":material/report:")

"""Streamlit glue shared by the pages: the session's result store, error display, CSV downloads."""
from __future__ import annotations

import streamlit as st

from lab.results import ResultStore, to_csv_bytes

USER_ERRORS = (ValueError, RuntimeError, OSError, KeyError)


def results_store() -> ResultStore:
    if "results" not in st.session_state:
        st.session_state["results"] = ResultStore()
    return st.session_state["results"]


def csv_download(table, file_name: str, key: str, label: str = "Download CSV") -> None:
    st.download_button(label, to_csv_bytes(table), file_name=file_name, mime="text/csv", key=key)


def show_error(exc: Exception) -> None:
    st.error(f"{type(exc).__name__}: {exc}")


def chart(figure, key: str) -> None:
    st.plotly_chart(figure, key=key,
                    config={"toImageButtonOptions": {"format": "png", "filename": key}, "displaylogo": False})

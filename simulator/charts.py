"""Plotly figures of simulator results (pure functions of result tables)."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from .metrics import CATEGORIES

COLOURS = {"token_states": "#16a34a", "reserved": "#facc15", "internal_fragmentation": "#f97316",
           "external_fragmentation": "#dc2626", "free": "#cbd5e1"}
FRACTION_COLUMNS = {"token_states": "token_states_frac", "reserved": "reserved_frac",
                    "internal_fragmentation": "internal_frag_frac", "external_fragmentation": "external_frag_frac",
                    "free": "free_frac"}


def waste_bars(summary: pd.DataFrame, label: str = "label") -> go.Figure:
    """Stacked bars of the time-weighted KV breakdown per configuration (like the vLLM paper's Figure 2)."""
    figure = go.Figure()
    for name in CATEGORIES:
        figure.add_bar(x=summary[label], y=summary[FRACTION_COLUMNS[name]] * 100, name=name,
                       marker_color=COLOURS[name], hovertemplate="%{y:.1f}%")
    if "paper_token_states_frac" in summary:
        figure.add_scatter(x=summary[label], y=summary["paper_token_states_frac"] * 100, mode="markers",
                           name="paper: token states", marker=dict(symbol="diamond", size=12, color="black"))
    figure.update_layout(barmode="stack", title="KV memory breakdown (time-weighted mean)", yaxis_title="% of KV",
                         height=400)
    return figure


def waste_areas(timeseries: pd.DataFrame, title: str) -> go.Figure:
    """Stacked areas of the breakdown over time for one run."""
    figure = go.Figure()
    for name in CATEGORIES:
        figure.add_scatter(x=timeseries["time_s"], y=timeseries[f"{name}_frac"] * 100, name=name, mode="lines",
                           stackgroup="kv", line=dict(width=0.5, color=COLOURS[name]))
    figure.update_layout(title=title, xaxis_title="simulated s", yaxis_title="% of KV", height=340,
                         yaxis_range=[0, 100])
    return figure


def over_time(timeseries: dict[str, pd.DataFrame], column: str, title: str, per_second: bool = False) -> go.Figure:
    """One line per run of ``column`` (or its rate per simulated second) over time."""
    frames = []
    for label, frame in timeseries.items():
        values = frame[column].diff() / frame["time_s"].diff() if per_second else frame[column]
        frames.append(pd.DataFrame({"time_s": frame["time_s"], "value": values, "run": label}))
    data = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["time_s", "value", "run"])
    figure = px.line(data, x="time_s", y="value", color="run", title=title, labels={"time_s": "simulated s"})
    return figure.update_layout(height=320)


def latency_percentiles(summary: pd.DataFrame, label: str = "label") -> go.Figure:
    """TTFT / TPOT / end-to-end p50, p90, p99 per configuration."""
    rows = []
    for _, run in summary.iterrows():
        for metric in ("ttft", "tpot", "e2e"):
            for q in (50, 90, 99):
                rows.append({"run": run[label], "metric": metric, "percentile": f"p{q}",
                             "seconds": run[f"{metric}_p{q}_s"]})
    figure = px.bar(pd.DataFrame(rows), x="percentile", y="seconds", color="run", barmode="group",
                    facet_col="metric", title="Latency percentiles", log_y=True)
    figure.update_yaxes(matches=None)
    return figure.update_layout(height=340)

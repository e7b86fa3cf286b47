"""Plotly figures of simulator results (pure functions of result tables)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from lab.report.charts import facet_names, log_ticks
from lab.report.results import human_number
from lab.errors import InputError
from simulator.core.metrics import CATEGORIES, CATEGORY_LABELS, SUMMARY_FRACTIONS as FRACTION_COLUMNS
from .report import label as _label

COLOURS = {"token_states": "#16a34a", "reserved": "#facc15", "internal_fragmentation": "#f97316",
           "external_fragmentation": "#dc2626", "free": "#cbd5e1"}


def waste_bars(summary: pd.DataFrame, label: str = "label") -> go.Figure:
    """Stacked bars of the time-weighted KV breakdown per configuration (like the vLLM paper's Figure 2)."""
    figure = go.Figure()
    for name in CATEGORIES:
        figure.add_bar(x=summary[label], y=summary[FRACTION_COLUMNS[name]] * 100, name=CATEGORY_LABELS[name],
                       marker_color=COLOURS[name], hovertemplate="%{y:.1f}%")
    if "paper_token_states_frac" in summary:
        figure.add_scatter(x=summary[label], y=summary["paper_token_states_frac"] * 100, mode="markers",
                           name="paper: holding tokens", marker=dict(symbol="diamond", size=12, color="black"))
    figure.update_layout(barmode="stack", title="Where the KV memory goes (time-weighted mean)", yaxis_title="% of KV",
                         height=400)
    return figure


MAX_POINTS = 400  # per line of a chart over time: a browser draws thousands of points per trace slowly


def thinned(frame: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Every k-th row of ``frame`` (and its last), at most about ``max_points``: what a chart draws of a timeseries
    (the exports keep every row)."""
    if len(frame) <= max_points:
        return frame
    step = -(-len(frame) // max_points)
    keep = list(range(0, len(frame), step))
    if keep[-1] != len(frame) - 1:
        keep.append(len(frame) - 1)
    return frame.iloc[keep]


def waste_areas(timeseries: pd.DataFrame, title: str) -> go.Figure:
    """Stacked areas of the breakdown over time for one run (``thinned``)."""
    timeseries = thinned(timeseries)
    figure = go.Figure()
    for name in CATEGORIES:
        figure.add_scatter(x=timeseries["elapsed_s"], y=timeseries[f"{name}_frac"] * 100, name=CATEGORY_LABELS[name],
                           mode="lines",
                           stackgroup="kv", line=dict(width=0.5, color=COLOURS[name]))
    figure.update_layout(title=title, xaxis_title="simulated time (s)", yaxis_title="% of KV", height=340,
                         yaxis_range=[0, 100])
    return figure


RATE_WINDOWS = 100  # over_time's windows for a rate


def over_time(timeseries: dict[str, pd.DataFrame], column: str, title: str, y_label: str,
              per_second: bool = False) -> go.Figure:
    """One line per run of ``column`` over time; ``y_label`` names the axis. With ``per_second``, ``column`` is a
    running total (e.g. generated tokens) and the line its rate in ``RATE_WINDOWS`` equal time windows: step by step
    the rate swings between a prefill step's few tokens and a decode step's whole batch, which hides the trend."""
    frames = []
    for label, frame in timeseries.items():
        if per_second:
            counts = frame[column].diff().fillna(frame[column])  # each kept row's share of the total
            points = windowed_rate(frame["elapsed_s"], counts, frame["elapsed_s"].max() / RATE_WINDOWS)
        else:
            points = thinned(pd.DataFrame({"elapsed_s": frame["elapsed_s"], "value": frame[column]}))
        frames.append(points.assign(run=label))
    data = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["elapsed_s", "value", "run"])
    figure = px.line(data, x="elapsed_s", y="value", color="run", title=title,
                     labels={"elapsed_s": "simulated time (s)", "value": y_label, "run": "allocator"})
    return figure.update_layout(height=320)


def block_size_lines(table: pd.DataFrame) -> go.Figure:
    """``block_size_sweep``'s table: internal fragmentation, throughput and mean running sequences against the
    block size (log scale), one line per workload."""
    from plotly.subplots import make_subplots

    panels = (("internal_fragmentation_pct", "Internal fragmentation (% of KV)"),
              ("throughput_tok_s", "Throughput (output tokens/s)"), ("mean_batch_size", "Mean running sequences"))
    figure = make_subplots(rows=1, cols=3, subplot_titles=[title for _, title in panels])
    colours = px.colors.qualitative.Plotly
    for index, (workload, rows) in enumerate(table.groupby("workload", sort=False)):
        for col, (column, title) in enumerate(panels, 1):
            figure.add_scatter(x=rows["block_size"], y=rows[column], mode="lines+markers", name=str(workload),
                               legendgroup=str(workload), showlegend=col == 1,
                               line=dict(color=colours[index % len(colours)]),
                               hovertemplate=f"block size %{{x}}<br>{title}: %{{y:.3g}}<extra>{workload}</extra>",
                               row=1, col=col)
    figure.update_xaxes(type="log", title_text="block size (tokens)", tickvals=sorted(table["block_size"].unique()))
    return figure.update_layout(height=360, title="What the block size trades: fragmentation against kernel speed",
                                legend_title_text="workload")


def offload_lines(table: pd.DataFrame) -> go.Figure:
    """``simulator.offload_sweep``'s table: prefix-cache hit rate, TTFT p50/p90 and throughput against the host
    tier's size."""
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=3, subplot_titles=["Prefix-cache hit rate (% of prompt blocks)",
                                                           "Time to first token (s)", "Throughput (output tokens/s)"])
    for name, column, col in (("hits, GPU + tier", "prefix_cache_hit_pct", 1), ("served by the tier",
                                                                                "offload_hit_pct", 1),
                              ("TTFT p50", "ttft_p50_s", 2), ("TTFT p90", "ttft_p90_s", 2),
                              ("throughput", "throughput_tok_s", 3)):
        figure.add_scatter(x=table["tier"], y=table[column], mode="lines+markers", name=name, row=1, col=col,
                           hovertemplate=f"%{{x}}: %{{y:.3g}}<extra>{name}</extra>")
    figure.update_xaxes(title_text="host tier")
    return figure.update_layout(height=360, title="What a CPU tier buys: the prefix cache's blocks kept in host memory")


LATENCY_LABELS = {"ttft": "Time to first token", "tpot": "Time per output token", "e2e": "End to end"}


def latency_percentiles(summary: pd.DataFrame, label: str = "label") -> go.Figure:
    """TTFT / TPOT / end-to-end p50, p90, p99 per configuration."""
    rows = []
    for _, run in summary.iterrows():
        for metric in ("ttft", "tpot", "e2e"):
            for q in (50, 90, 99):
                rows.append({"run": run[label], "metric": LATENCY_LABELS[metric], "percentile": f"p{q}",
                             "seconds": run[f"{metric}_p{q}_s"]})
    frame = pd.DataFrame(rows)
    figure = px.bar(frame, x="percentile", y="seconds", color="run", barmode="group", facet_col="metric",
                    title="Latency percentiles", log_y=True, labels={"run": "allocator", "seconds": "latency (s)"},
                    facet_col_spacing=0.06)
    figure.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))  # "TTFT", not "metric=TTFT"
    metrics = list(dict.fromkeys(frame["metric"]))  # the facets, left to right
    for col, metric in enumerate(metrics, 1):  # each facet its own scale and ticks (TTFT and TPOT differ ~10^4 x)
        figure.update_yaxes(matches=None, showticklabels=True, row=1, col=col,
                            **_log_axis(frame.loc[frame["metric"] == metric, "seconds"]))
    return figure.update_layout(height=340)


def _log_axis(values: pd.Series) -> dict:
    """``log_ticks`` and a range from the tick at or below the smallest value to the one at or above the largest,
    so that a narrow range still shows a tick at each end (a log axis autoranged to 0.3-0.4 shows none)."""
    ticks = log_ticks(values)
    positive = values[(values > 0) & np.isfinite(values)]
    if not ticks or positive.empty:
        return ticks
    low, high = positive.min(), positive.max()
    bottom = max((t for t in ticks["tickvals"] if t <= low), default=low)
    top = min((t for t in ticks["tickvals"] if t >= high), default=high)
    return ticks | {"range": [math.log10(bottom), math.log10(top)]}


def _in_percent(table: pd.DataFrame, value: str) -> pd.DataFrame:
    """Fractions shown as percentages, as every other table and chart of the app shows them."""
    return table.assign(**{value: table[value] * 100}) if value.endswith("_frac") else table


def sweep_heatmap(table: pd.DataFrame, x: str, y: str, value: str) -> go.Figure:
    """Median of ``value`` over the runs at each (``x``, ``y``) of a sweep table. The colour scale starts at zero
    (a 2 % gap does not span the whole scale); a figure with negative values spans them, and the title says so."""
    grid = _in_percent(table, value).pivot_table(index=y, columns=x, values=value, aggfunc="median")
    low, high = float(np.nanmin(grid.to_numpy())), float(np.nanmax(grid.to_numpy()))
    from_zero = low >= 0
    figure = px.imshow(grid, aspect="auto", color_continuous_scale="Viridis",
                       range_color=(0.0, high if high > 0 else 1.0) if from_zero else (low, high),
                       labels=dict(x=_label(x), y=_label(y), color=_label(value)),
                       title=f"{_label(value)}, median over the other fields (colour scale "
                             f"{'from zero' if from_zero else 'from its lowest value: it has negative ones'})")
    figure.update_traces(text=grid.map(human_number).to_numpy(), texttemplate="%{text}")
    figure.update_xaxes(type="category")
    figure.update_yaxes(type="category")
    return figure.update_layout(height=380)


def sweep_lines(table: pd.DataFrame, x: str, value: str, colour: str | None) -> go.Figure:
    """``value`` against ``x``, one line per ``colour`` (median over the other fields)."""
    keys = [x] + ([colour] if colour else [])
    data = _in_percent(table, value).groupby(keys, as_index=False)[value].median().sort_values(keys)
    if colour:
        data[colour] = data[colour].astype(str)
    labels = {column: _label(column) for column in (x, value, colour) if column}
    figure = px.line(data, x=x, y=value, color=colour, markers=True, labels=labels,
                     title=f"{_label(value)} against {_label(x).lower()} (y axis from zero)")
    return figure.update_layout(height=360).update_yaxes(rangemode="tozero")


def pareto(plan: pd.DataFrame) -> go.Figure:
    """Cost per hour against the highest SLO-meeting rate, one point per configuration; the Pareto front joined,
    the chosen configuration marked."""
    data = plan[plan["max_rate_req_s"] > 0].copy()
    data["configuration"] = (data["model"].astype(str) + " · " + data["tp"].astype(str) + "×" + data["gpu"].astype(str)
                             + " · " + data["replicas"].astype(str) + " repl · " + data["allocator"].astype(str))
    figure = px.scatter(data, x="max_rate_req_s", y="cost_per_hour", color="allocator", hover_name="configuration",
                        title="Cost vs the highest rate meeting every SLO", log_x=True,
                        labels={"max_rate_req_s": "max sustainable rate (req/s)", "cost_per_hour": "USD per hour"})
    front = data.sort_values(["cost_per_hour", "max_rate_req_s"], ascending=[True, False])
    front = front[front["max_rate_req_s"] > front["max_rate_req_s"].cummax().shift(fill_value=0)]
    figure.add_scatter(x=front["max_rate_req_s"], y=front["cost_per_hour"], mode="lines", name="Pareto front",
                       line=dict(color="black", dash="dot"), hoverinfo="skip")
    chosen = data[data["chosen"]]
    if not chosen.empty:
        figure.add_scatter(x=chosen["max_rate_req_s"], y=chosen["cost_per_hour"], mode="markers", name="chosen",
                           marker=dict(symbol="star", size=18, color="gold", line=dict(color="black", width=1)),
                           hovertext=chosen["configuration"])
    return figure.update_layout(height=420)


def twin_steps(real: pd.DataFrame, simulated: pd.DataFrame, column: str, title: str,
               per_second: bool = False, windows: int = 60) -> go.Figure:
    """A step-log column of the real run and the simulated one against (real or simulated) elapsed time;
    ``per_second`` plots ``column`` summed over time windows per second of window (e.g. decode tokens per second),
    ``windows`` of them over the longer run (a step's count lands in the window where it ends)."""
    longest = max(float(steps["duration_s"].sum()) for steps in (real, simulated))
    frames = []
    for label, steps in (("real", real), ("simulated", simulated)):
        ends = steps["duration_s"].cumsum()
        if per_second:
            frame = windowed_rate(ends, steps[column], longest / windows)
        else:
            frame = pd.DataFrame({"elapsed_s": ends, "value": steps[column]})
        frames.append(frame.assign(run=label))
    figure = px.line(pd.concat(frames, ignore_index=True), x="elapsed_s", y="value", color="run", title=title,
                     line_shape="hv", labels={"elapsed_s": "elapsed s (each run's own clock)", "value": title})
    return figure.update_layout(height=320)


def windowed_rate(ends: pd.Series, counts: pd.Series, width_s: float) -> pd.DataFrame:
    """``counts`` (one per step, ending at ``ends`` seconds) per second in consecutive windows of ``width_s``, empty
    windows included: ``elapsed_s`` (the window's start), ``value``."""
    if len(ends) == 0 or width_s <= 0:
        return pd.DataFrame({"elapsed_s": [], "value": []})
    position = ends.to_numpy() / width_s
    num_windows = max(1, math.ceil(position[-1] - 1e-9))
    window = np.clip(np.ceil(position).astype(int) - 1, 0, num_windows - 1)  # (k-1) w < end <= k w: window k-1
    totals = np.bincount(window, weights=counts.to_numpy(dtype=float), minlength=num_windows)
    return pd.DataFrame({"elapsed_s": np.arange(len(totals)) * width_s, "value": totals / width_s})


def latency_cdf(real: pd.DataFrame, simulated: pd.DataFrame, column: str) -> go.Figure:
    """The distribution of one per-request latency, real vs simulated."""
    data = pd.concat([real[[column]].assign(run="real"), simulated[[column]].assign(run="simulated")],
                     ignore_index=True)
    figure = px.ecdf(data, x=column, color="run", title=f"{_label(column)}: distribution over requests",
                     labels={column: _label(column), "run": "run"})
    return figure.update_layout(height=320, yaxis_title="fraction of requests")


def paper_vs_lab(summary: pd.DataFrame) -> go.Figure:
    """The paper's value and the lab's, side by side, for every quantity the paper states as one number."""
    numeric = summary.assign(paper=pd.to_numeric(summary["paper"], errors="coerce"),
                             lab=pd.to_numeric(summary["lab"], errors="coerce")).dropna(subset=["paper", "lab"])
    figure = go.Figure()
    colours = {"reproduced": "#16a34a", "partly": "#facc15", "not": "#dc2626"}
    figure.add_bar(x=numeric["quantity"], y=numeric["paper"], name="paper", marker_color="#94a3b8")
    figure.add_bar(x=numeric["quantity"], y=numeric["lab"], name="lab",
                   marker_color=[colours.get(v, "#64748b") for v in numeric["verdict"]])
    figure.update_layout(barmode="group", title="Paper vs lab (lab bars coloured by verdict)", height=460,
                         yaxis_type="log", xaxis_tickangle=-35,
                         yaxis_title="the quantity (a share of KV, or requests; log scale)")
    return figure.update_yaxes(**log_ticks(list(numeric["paper"]) + list(numeric["lab"])))


def _lab_and_paper(table: pd.DataFrame, x: str, lab: str, paper: str, facet: str | None, title: str) -> go.Figure:
    """Bars: the lab's value and the paper's, side by side per ``x`` (and facet)."""
    keep = [c for c in (x, facet) if c]
    long = _in_percent(table, lab).pipe(_in_percent, paper).melt(id_vars=keep, value_vars=[lab, paper],
                                                                  var_name="source", value_name="value")
    long["source"] = long["source"].map({lab: "lab", paper: "paper"})
    return px.bar(long, x=x, y="value", color="source", barmode="group", facet_col=facet, title=title,
                  labels={"value": _label(lab), **{c: _label(c) for c in keep}})


def _labels(table: pd.DataFrame) -> dict:
    """Every column of ``table`` as a person reads it (``simulator.views.report.label``): a plotly express ``labels``."""
    return {column: _label(column) for column in table.columns}


def paper_figure(figure: str, table: pd.DataFrame) -> go.Figure:
    """The chart of one vLLM-paper figure from its table (``simulator.experiments.paper``): the simulator's values with the
    paper's beside them where the paper gives numbers, and the tiny engine's measured values beside the
    simulator's; panels titled by their value (``opt-13b``, not ``model=opt-13b``)."""
    return facet_names(_paper_figure(str(figure), table))


def _paper_figure(figure: str, table: pd.DataFrame) -> go.Figure:
    if figure == "2":
        return _lab_and_paper(table, "system", "token_states_frac", "paper_token_states_frac", None,
                              "Figure 2: share of KV memory holding token states")
    if figure == "12":
        return px.bar(table, x="system", y="max_rate_req_s", color="workload", barmode="group", facet_col="model",
                      title="Figure 12: highest sustainable request rate (latency knee)", labels=_labels(table))
    if figure == "13":
        return _lab_and_paper(table, "system", "mean_batch_size", "paper_mean_batch_size", "workload",
                              "Figure 13: mean batched requests")
    if figure == "15":
        frame = table.assign(k=table["n"].fillna(table["beam_width"]).astype(int).astype(str),
                             what=table["workload"].str.slice(0, 12).str.rstrip(", ") + ", " + table["n"].notna().map(
                                 {True: "parallel n", False: "beam width"}))
        measured = frame["source"].eq("runtime (measured)") if "source" in frame else frame["n"].isna() & False
        bars = []
        for rows, pairs in ((frame[~measured], (("saving", "simulator"), ("paper_saving", "paper"))),
                            (frame[measured], (("saving", "tiny engine, measured"),
                                               ("simulated_same_lengths", "simulator")))):
            for column, source in pairs:
                if column in rows and len(rows):
                    bars.append(rows[["k", "what"]].assign(value=rows[column], source=source))
        return px.bar(pd.concat(bars, ignore_index=True), x="k", y="value", color="source", barmode="group",
                      facet_col="what", title="Figure 15: memory saved by sharing", labels={"value": "saving"})
    if figure == "16":
        return px.bar(table, x="prefix_tokens", y="max_rate_req_s", color="system", barmode="group",
                      title="Figure 16: sustainable rate with a shared few-shot prefix", labels=_labels(table))
    if figure == "18":
        paper = table[table["normalized_latency_s_per_token"].notna()]
        chart = px.line(paper, x="block_size", y="normalized_latency_s_per_token", color="workload", markers=True,
                        log_x=True, title="Figure 18b: normalized latency by block size", labels=_labels(table))
        tiny = table[table["real_throughput_tok_s"].notna()] if "real_throughput_tok_s" in table else table.iloc[:0]
        for column, name in (("real_throughput_tok_s", "tiny engine, measured tok/s"),
                             ("simulated_throughput_tok_s", "tiny engine, simulated tok/s")):
            if len(tiny):
                chart.add_scatter(x=tiny["block_size"], y=tiny[column], name=name, yaxis="y2", mode="lines+markers")
        return chart.update_layout(yaxis2=dict(overlaying="y", side="right", title="tokens/s (tiny engine)"),
                                   legend=dict(x=1.1))
    if figure == "19":
        paper = table[table["normalized_latency_s_per_token"].notna()]
        chart = px.line(paper, x="block_size", y="normalized_latency_s_per_token", color="preemption_mode",
                        markers=True, log_x=True, title="Figure 19: recompute vs swap by block size",
                        labels=_labels(table))
        if "measured_swap_over_recompute" in table:
            tiny = table[table["measured_swap_over_recompute"].notna()].drop_duplicates("block_size")
            for column, name in (("measured_swap_over_recompute", "tiny engine swap/recompute, measured"),
                                 ("simulated_swap_over_recompute", "tiny engine swap/recompute, simulated")):
                chart.add_scatter(x=tiny["block_size"], y=tiny[column], name=name, yaxis="y2", mode="lines+markers")
            chart.update_layout(yaxis2=dict(overlaying="y", side="right", title="swap / recompute (tiny)"),
                                legend=dict(x=1.1))
        return chart
    raise InputError(f"no chart for figure {figure!r}")


def request_cdf(requests: pd.DataFrame, column: str) -> go.Figure:
    """The distribution over requests of one latency of ``simulator.views.report.request_table`` (``ttft_s``,
    ``e2e_s``, …), one line per run, finished requests only, on a log time axis (seconds to minutes)."""
    from simulator.views.report import REQUEST_LABELS

    data = requests[requests[column] > 0]
    label = REQUEST_LABELS.get(column, _label(column))
    figure = px.ecdf(data, x=column, color="run", log_x=True, labels={column: label, "run": "Run"},
                     title=f"{label}: share of finished requests at or below each value")
    return figure.update_layout(height=360, yaxis_title="share of finished requests", yaxis_tickformat=".0%")


COMPARISON_VIEWS = {"KV breakdown over time": "areas", "Running sequences over time": "batch_over_time",
                    "Throughput over time": "throughput_over_time", "Latency percentiles": "latency_percentiles"}


def comparison_figure(name: str, summary: pd.DataFrame, series: dict[str, pd.DataFrame]) -> go.Figure:
    """One chart of a comparison (the Memory simulator's) by name: ``waste_bars`` (where the KV memory goes),
    ``areas_<run label>`` (that run's breakdown over time) or a value of ``COMPARISON_VIEWS`` other than ``areas``."""
    if name == "waste_bars":
        return waste_bars(summary)
    if name.startswith("areas_"):
        label = name.removeprefix("areas_")
        if label not in series:
            raise InputError(f"no run labelled {label!r} in this comparison (runs: {', '.join(series)})")
        return waste_areas(series[label], f"{label}: KV breakdown over time")
    if name == "batch_over_time":
        return over_time(series, "num_running", "Batch size", "running sequences")
    if name == "throughput_over_time":
        return over_time(series, "generated_tokens", "Throughput", "output tokens/s", per_second=True)
    if name == "latency_percentiles":
        return latency_percentiles(summary)
    raise InputError(f"unknown comparison chart {name!r}")

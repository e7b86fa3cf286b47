"""Plotly figures and tables for the app: the block pool, the paging diagram, kernel sweeps and runtime runs.
Pure functions of data, so they are tested without Streamlit."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from .results import human_number

SHARED_MARK = "●"


def block_pool_frame(ref_counts: list[int], owners: list[list]) -> pd.DataFrame:
    """One row per physical block: its id, ref count, owning sequences ('' when free) and whether it is shared."""
    return pd.DataFrame({"block": np.arange(len(ref_counts)), "ref_count": ref_counts,
                         "owners": [",".join(map(str, o)) for o in owners],
                         "shared": [count > 1 for count in ref_counts]})


SEQUENCE_PALETTE = px.colors.qualitative.Alphabet  # 26 distinct colours: neighbouring sequence ids differ
FREE_COLOUR = "#e8e8e8"
EVENT_SYMBOLS = {"shared": "star", "copy-on-write": "diamond", "evicted": "x", "swapped out": "triangle-down"}


def sequence_colour(seq_id) -> str:
    """The colour of a sequence in every block-pool picture: its id's place in a qualitative palette, so a sequence
    keeps its colour from frame to frame and consecutive ids get unlike colours."""
    index = seq_id if isinstance(seq_id, int) else zlib.crc32(str(seq_id).encode())
    return SEQUENCE_PALETTE[index % len(SEQUENCE_PALETTE)]


def _faded(colour: str, keep: float = 0.25) -> str:
    red, green, blue = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(255 - (255 - c) * keep):02x}" for c in (red, green, blue))


def block_pool_figure(ref_counts: list[int], owners: list[list], columns: int | None = None,
                      title: str = "Physical block pool", highlight=None, events: list | None = None,
                      max_legend: int = 40) -> go.Figure:
    """Every physical block as a cell, coloured by its (first) owner's ``sequence_colour``, with a legend from colour
    to sequence (the first ``max_legend``) and a hover naming the block's holders; free blocks grey, so the pool's
    size shows; shared blocks marked with their ref count. ``highlight``: a sequence whose blocks keep their colour
    while every other held block fades. ``events``: ``lab.kv_cache.pool_view.PoolEvent`` s, marked on their blocks
    by kind (``EVENT_SYMBOLS``)."""
    count = len(ref_counts)
    columns = columns or max(8, int(np.ceil(np.sqrt(count * 2))))
    rows = -(-count // columns)
    colours = [FREE_COLOUR] + list(SEQUENCE_PALETTE) + [_faded(c) for c in SEQUENCE_PALETTE]
    palette = len(SEQUENCE_PALETTE)
    colour = np.full(rows * columns, np.nan)  # cells past the pool's end stay empty
    text = np.full(rows * columns, "", dtype=object)
    hover = np.full(rows * columns, "", dtype=object)
    seen = {}
    for block, (refs, holders) in enumerate(zip(ref_counts, owners)):
        colour[block] = 0
        if refs:
            first = holders[0] if holders else "?"
            index = SEQUENCE_PALETTE.index(sequence_colour(first))
            faded = highlight is not None and highlight not in holders
            colour[block] = 1 + index + (palette if faded else 0)
            text[block] = f"{SHARED_MARK}{refs}" if refs > 1 else ""
            for holder in holders:
                seen.setdefault(holder, None)
        holders_text = ", ".join(f"sequence {h}" for h in holders) if holders else "free"
        hover[block] = f"block {block}<br>ref count {refs}<br>{holders_text}"
    steps = len(colours)
    scale = [point for k, c in enumerate(colours) for point in ([k / steps, c], [(k + 1) / steps, c])]
    shape = (rows, columns)
    figure = go.Figure(go.Heatmap(z=colour.reshape(shape), text=text.reshape(shape), texttemplate="%{text}",
                                  hovertext=hover.reshape(shape), hoverinfo="text", colorscale=scale,
                                  showscale=False, xgap=1, ygap=1, zmin=-0.5, zmax=steps - 0.5, showlegend=False))
    legend = sorted(seen, key=lambda s: (not isinstance(s, int), s if isinstance(s, int) else str(s)))
    for seq_id in legend[:max_legend]:
        name = f"sequence {seq_id}" + (" (highlighted)" if seq_id == highlight else "")
        figure.add_scatter(x=[None], y=[None], mode="markers", name=name, legendgroup="sequences",
                           legendgrouptitle_text="held by", marker=dict(symbol="square", size=12,
                                                                        color=sequence_colour(seq_id)))
    figure.add_scatter(x=[None], y=[None], mode="markers", name="free", marker=dict(symbol="square", size=12,
                                                                                    color=FREE_COLOUR))
    for kind, symbol in EVENT_SYMBOLS.items():
        marked = [event for event in events or () if event.kind == kind]
        if marked:
            figure.add_scatter(x=[e.block % columns for e in marked], y=[e.block // columns for e in marked],
                               mode="markers", name=f"{kind} ({len(marked)})", legendgroup="events",
                               legendgrouptitle_text="since the last frame",
                               marker=dict(symbol=symbol, size=11, color="black", line=dict(width=1, color="white")),
                               hovertext=[f"block {e.block}: {kind}" + (f" (sequence {e.seq_id})"
                                                                         if e.seq_id is not None else "")
                                          for e in marked], hoverinfo="text")
    legend_note = f" (legend: the first {max_legend} of {len(legend)} sequences)" if len(legend) > max_legend else ""
    figure.update_layout(title=f"{title}{legend_note}", height=max(260, 26 * rows + 80),
                         margin=dict(l=10, r=10, t=40, b=10), plot_bgcolor="white",
                         yaxis=dict(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False),
                         xaxis=dict(showticklabels=False, showgrid=False, zeroline=False), legend=dict(font_size=11))
    return figure


def pool_occupancy_figure(occupancy: pd.DataFrame, current: int | None = None,
                          title: str = "Pool occupancy over iterations") -> go.Figure:
    """``lab.kv_cache.pool_view.pool_occupancy`` as lines (blocks in use, shared, free but cached, free) against the
    iteration, the pool's size as a dotted line and ``current`` (an iteration) marked."""
    figure = go.Figure()
    for column, name in (("blocks_in_use", "in use"), ("shared_blocks", "shared (ref count > 1)"),
                         ("cached_free_blocks", "free, still cached"), ("free_blocks", "free")):
        figure.add_scatter(x=occupancy["iteration"], y=occupancy[column], name=name, mode="lines", line_shape="hv")
    if len(occupancy):
        figure.add_hline(y=int(occupancy["num_blocks"].iloc[0]), line_dash="dot", line_color="grey",
                         annotation_text=f"pool: {int(occupancy['num_blocks'].iloc[0]):,} blocks")
    if current is not None:
        figure.add_vline(x=current, line_color="black", line_width=1)
    figure.update_yaxes(title_text="blocks", rangemode="tozero")
    figure.update_xaxes(title_text="iteration")
    return figure.update_layout(title=title, height=300, margin=dict(l=10, r=10, t=40, b=10))


def offload_tier_figure(lru_rank: list[int], title: str = "Host offload tier",
                        swapped: list[bool] | None = None) -> go.Figure:
    """Heatmap, one cell per host slot of the offload tier: darker = more recently stored or loaded (the lightest is
    evicted next); with ``swapped`` (the tier shares the host pool with swap preemption) the slots holding swapped-out
    sequences' blocks in orange; free slots blank."""
    count = len(lru_rank)
    columns = max(8, int(np.ceil(np.sqrt(max(count, 1) * 2))))
    rows = max(1, -(-count // columns))
    used = max(1, sum(rank >= 0 for rank in lru_rank))
    recency = np.full(rows * columns, np.nan)
    hover = np.full(rows * columns, "", dtype=object)
    for slot, rank in enumerate(lru_rank):
        if rank >= 0:
            recency[slot] = (rank + 1) / used
            hover[slot] = f"slot {slot}<br>holds an evicted prefix block<br>{rank + 1} of {used} in LRU order"
        elif swapped is not None and swapped[slot]:
            recency[slot] = SWAPPED_SLOT
            hover[slot] = f"slot {slot}<br>holds a swapped-out sequence's block"
        else:
            hover[slot] = f"slot {slot}<br>free"
    shape = (rows, columns)
    colorscale = [[0, "#f4a261"], [0.19, "#f4a261"], [0.2, "#deebf7"], [1, "#08306b"]]
    figure = go.Figure(go.Heatmap(z=recency.reshape(shape), hovertext=hover.reshape(shape), hoverinfo="text",
                                  colorscale=colorscale, showscale=False, xgap=1, ygap=1, zmin=SWAPPED_SLOT, zmax=1))
    figure.update_layout(title=title, height=max(160, 26 * rows + 80), margin=dict(l=10, r=10, t=40, b=10),
                         yaxis=dict(autorange="reversed", showticklabels=False),
                         xaxis=dict(showticklabels=False))
    return figure


SWAPPED_SLOT = -0.25  # the heatmap value of a host slot held by a swapped-out sequence (orange)


def block_table_frame(block_table: list[int], block_size: int, seq_len: int | None = None) -> pd.DataFrame:
    """Logical -> physical mapping of one sequence, with the tokens each block holds when the length is known."""
    frame = pd.DataFrame({"logical_block": np.arange(len(block_table)), "physical_block": block_table})
    frame["first_token"] = frame["logical_block"] * block_size
    if seq_len is not None:
        frame["tokens_held"] = np.clip(seq_len - frame["first_token"], 0, block_size)
    return frame


def paging_diagram() -> go.Figure:
    """Logical blocks of two sequences -> their block tables -> scattered physical blocks, one of them shared."""
    tables = {"A": [7, 1, 4], "B": [7, 3]}
    colours = {"A": "#2563eb", "B": "#f97316"}
    origin = {"A": 0.0, "B": 4.6}
    figure = go.Figure()
    for seq, table in tables.items():
        for logical, physical in enumerate(table):
            x0 = origin[seq] + logical * 1.1
            figure.add_shape(type="rect", x0=x0, x1=x0 + 0.9, y0=3.0, y1=3.7, fillcolor=colours[seq], line_width=0)
            figure.add_annotation(x=x0 + 0.45, y=3.35, text=f"{seq}{logical}", showarrow=False,
                                  font=dict(color="white"))
            figure.add_annotation(x=physical * 1.1 + 0.45, y=1.25, ax=x0 + 0.45, ay=3.0, xref="x", yref="y",
                                  axref="x", ayref="y", showarrow=True, arrowhead=2, arrowwidth=1.5,
                                  arrowcolor=colours[seq], text="")
        figure.add_annotation(x=origin[seq] + 1.5, y=4.0, showarrow=False,
                              text=f"sequence {seq}: logical blocks → block table {table}")
    owners = {block: [seq for seq, table in tables.items() if block in table] for block in range(8)}
    for block, held_by in owners.items():
        colour = "#f1f5f9" if not held_by else colours[held_by[0]] if len(held_by) == 1 else "#a855f7"
        label = f"{block} · ref {len(held_by)}" if len(held_by) > 1 else str(block)
        figure.add_shape(type="rect", x0=block * 1.1, x1=block * 1.1 + 0.9, y0=0.5, y1=1.2, fillcolor=colour,
                         line=dict(color="#475569", width=1))
        figure.add_annotation(x=block * 1.1 + 0.45, y=0.85, text=label, showarrow=False,
                              font=dict(color="white" if held_by else "#334155"))
    figure.add_annotation(x=4.4, y=0.2, showarrow=False,
                          text="physical blocks (block 7 is shared by A and B: ref count 2; white = free)")
    figure.update_layout(height=300, xaxis=dict(visible=False, range=[-0.3, 8.9]),
                         yaxis=dict(visible=False, range=[0, 4.3]), margin=dict(l=10, r=10, t=10, b=10),
                         plot_bgcolor="white")
    return figure


def log_ticks(values) -> dict:
    """Ticks for a log axis over ``values``: 1, 2 and 5 of each decade (1 alone past four decades), labelled in
    human form (a log axis's own labels read "10, 5, 2, 1, 5, 2, 0.1"). Keywords for ``update_xaxes/yaxes``."""
    positive = [float(v) for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return {}
    low, high = min(positive), max(positive)
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    mantissas = (1,) if last - first > 4 else (1, 2, 5)
    ticks = [m * 10.0 ** e for e in range(first, last + 1) for m in mantissas
             if low / 2.5 <= m * 10.0 ** e <= high * 2.5]
    return {"tickvals": ticks, "ticktext": [human_number(t) for t in ticks]}


def kernel_time_figure(table: pd.DataFrame) -> go.Figure:
    """Median time per kernel vs context, one line per (kernel, batch), the repeats' spread (fastest to slowest
    call) as error bars where the table has it."""
    frame = table.assign(series=table["kernel"] + " · batch " + table["batch"].astype(str))
    spread = {}
    if {"min_ms", "max_ms"} <= set(frame.columns):
        frame = frame.assign(above=frame["max_ms"] - frame["median_ms"], below=frame["median_ms"] - frame["min_ms"])
        spread = {"error_y": "above", "error_y_minus": "below"}
    figure = px.line(frame, x="context", y="median_ms", color="series", markers=True, log_y=True, log_x=True,
                     title="Decode attention time (median; bars: fastest to slowest call)", **spread,
                     labels={"median_ms": "time per call (ms)", "context": "context (tokens)", "series": "kernel"})
    values = list(frame["median_ms"]) + (list(frame["min_ms"]) + list(frame["max_ms"]) if spread else [])
    figure.update_yaxes(**log_ticks(values))
    contexts = sorted(frame["context"].unique())
    figure.update_xaxes(tickvals=contexts, ticktext=[human_number(c) for c in contexts])  # the contexts measured
    return figure.update_layout(height=380)


def kernel_bandwidth_figure(table: pd.DataFrame) -> go.Figure:
    """Achieved KV bandwidth per kernel, grouped by shape."""
    frame = table.assign(shape="b" + table["batch"].astype(str) + "×" + table["context"].astype(str))
    figure = px.bar(frame, x="shape", y="kv_gb_per_s", color="kernel", barmode="group",
                    title="Achieved KV bandwidth", labels={"kv_gb_per_s": "K/V read (GB/s)",
                                                           "shape": "batch × context (tokens)"})
    return figure.update_layout(height=380)


def engine_live_figure(steps: pd.DataFrame) -> go.Figure:
    """Sequences (running / waiting / swapped) above, KV blocks in use (device and host) below: two counts of
    different things, each on its own axis, over the run's time."""
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    panels = ((1, (("num_running", "running"), ("num_waiting", "waiting"), ("num_swapped", "swapped out"))),
              (2, (("blocks_in_use", "KV blocks on the device"), ("cpu_blocks_in_use", "swapped KV blocks on the host"),
                   ("tier_blocks_in_use", "offload tier blocks on the host"))))
    for row, series in panels:
        for column, name in series:
            if column in steps and (column in ("num_running", "num_waiting", "blocks_in_use") or steps[column].any()):
                figure.add_scatter(x=steps["elapsed_s"], y=steps[column], name=name, mode="lines", row=row, col=1)
    figure.update_yaxes(title_text="sequences", rangemode="tozero", row=1, col=1)
    figure.update_yaxes(title_text="KV blocks", rangemode="tozero", row=2, col=1)
    figure.update_xaxes(title_text="time since the run started (s)", row=2, col=1)
    figure.update_layout(title="Engine state over time", height=420, margin=dict(l=10, r=10, t=40, b=10))
    return figure


def format_bytes(num_bytes: float) -> str:
    """``920 MiB``, ``1.9 GiB``: short enough for a metric tile."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:,.0f} {unit}"
    return f"{num_bytes:.0f} B"


def histogram_edges(values, max_bins: int = 40) -> np.ndarray:
    """Bin edges for a histogram of ``values``: numpy's ``"auto"`` rule (Sturges or Freedman-Diaconis, whichever
    gives narrower bins), at least 5 and at most ``max_bins`` bins over the values' range, and a range around the
    value when they are all equal (one bin over everything drew the TPOT histogram as one solid block)."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return np.array([0.0, 1.0])
    low, high = float(values.min()), float(values.max())
    if high - low <= 1e-9 * max(abs(high), 1.0):
        width = max(abs(low) * 0.05, 1e-6)
        return np.linspace(low - width, high + width, 6)
    bins = len(np.histogram_bin_edges(values, bins="auto")) - 1
    return np.linspace(low, high, min(max(bins, 5), max_bins) + 1)


LATENCY_TITLES = {"vllm:time_to_first_token_seconds": "Time to first token (TTFT)",
                  "vllm:inter_token_latency_seconds": "Inter-token latency (ITL)",
                  "vllm:e2e_request_latency_seconds": "End-to-end request latency (E2E)"}


def latency_histograms(latencies: dict, title: str = "Latency distributions") -> go.Figure:
    """vLLM's latency histograms side by side (``lab.engine.serving_metrics.HISTOGRAMS``: arrays of seconds), in
    milliseconds, each binned by ``histogram_edges``; hover gives the bin and its count."""
    from plotly.subplots import make_subplots

    names = [name for name in LATENCY_TITLES if name in latencies]
    figure = make_subplots(rows=1, cols=len(names) or 1, subplot_titles=[LATENCY_TITLES[n] for n in names])
    for col, name in enumerate(names, 1):
        ms = np.asarray(latencies[name], dtype=float) * 1e3
        edges = histogram_edges(ms)
        counts, _ = np.histogram(ms, edges)
        unit = "tokens" if "inter_token" in name else "requests"
        figure.add_bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges) * 0.95, name=name,
                       customdata=np.stack([edges[:-1], edges[1:]], axis=1),
                       hovertemplate=f"%{{customdata[0]:.1f}}–%{{customdata[1]:.1f}} ms: %{{y}} {unit}<extra>{name}"
                                     "</extra>", row=1, col=col)
        figure.update_xaxes(title_text="milliseconds", row=1, col=col)
        figure.update_yaxes(title_text=unit, rangemode="tozero", row=1, col=col)
    return figure.update_layout(title=title, height=340, showlegend=False, bargap=0,
                                margin=dict(l=10, r=10, t=70, b=10))


def serving_gauges_figure(gauges: pd.DataFrame, title: str = "vLLM metrics over time") -> go.Figure:
    """vLLM's gauges over the run (``lab.engine.serving_metrics.GAUGES``): KV-cache usage and prefix-cache hit rate
    (%), requests running / waiting / swapped, preemptions so far; each panel its own axis, one time axis."""
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07)
    panels = ((1, (("vllm:kv_cache_usage_perc", "KV-cache usage"), ("vllm:prefix_cache_hit_rate",
                                                                     "prefix-cache hit rate (so far)")), 100.0),
              (2, (("vllm:num_requests_running", "running"), ("vllm:num_requests_waiting", "waiting"),
                   ("vllm:num_requests_swapped", "swapped")), 1.0),
              (3, (("vllm:num_preemptions_total", "preemptions (so far)"),), 1.0))
    for row, series, scale in panels:
        for column, label in series:
            figure.add_scatter(x=gauges["t_s"], y=gauges[column] * scale, name=f"{label} ({column})", mode="lines",
                               line_shape="hv", row=row, col=1)
    figure.update_yaxes(title_text="% ", range=[0, 105], row=1, col=1)
    figure.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    figure.update_yaxes(title_text="preemptions", rangemode="tozero", row=3, col=1)
    figure.update_xaxes(title_text="time since the run started (s)", row=3, col=1)
    return figure.update_layout(title=title, height=560, margin=dict(l=10, r=10, t=40, b=10),
                                legend=dict(orientation="h", y=-0.12))


PHASE_COLOURS = {"queue": "#bab0ac", "prefill": "#f58518", "decode": "#4c78a8"}


def request_timeline_figure(timeline: pd.DataFrame, title: str = "Requests over time") -> go.Figure:
    """A Gantt chart of ``lab.engine.serving_metrics.request_timeline``: one row per request (first arrival at the
    top), its queue, prefill and decode phases as bars on the run's clock."""
    order = timeline.groupby("request_id")["start_s"].min().sort_values().index
    labels = {request: f"request {request}" for request in order}
    figure = go.Figure()
    for phase, colour in PHASE_COLOURS.items():
        rows = timeline[timeline["phase"] == phase]
        figure.add_bar(y=rows["request_id"].map(labels), x=rows["end_s"] - rows["start_s"], base=rows["start_s"],
                       orientation="h", name=phase, marker_color=colour,
                       customdata=np.stack([rows["start_s"], rows["end_s"]], axis=1) if len(rows) else None,
                       hovertemplate=f"%{{y}}: {phase} %{{customdata[0]:.3f}}–%{{customdata[1]:.3f}} s<extra></extra>")
    figure.update_yaxes(categoryorder="array", categoryarray=[labels[r] for r in order], autorange="reversed",
                        title_text=None)
    figure.update_xaxes(title_text="time since the run started (s)")
    return figure.update_layout(title=title, barmode="overlay", height=min(max(260, 16 * len(order) + 120), 1600),
                                margin=dict(l=10, r=10, t=40, b=10), legend=dict(orientation="h", y=1.02, x=0.5))


def facet_names(figure: go.Figure) -> go.Figure:
    """A faceted plotly express figure's panel titles as the values alone (``TTFT``, not ``metric=TTFT``)."""
    return figure.for_each_annotation(lambda note: note.update(text=note.text.split("=", 1)[-1]))


def static_batching_note(table: pd.DataFrame) -> str:
    """Why HF static batching beat the paged engine, when it did (empty otherwise)."""
    rate = dict(zip(table["system"], table["output_tok_s"]))
    if "hf-static" not in rate or "paged-engine" not in rate or rate["hf-static"] <= rate["paged-engine"]:
        return ""
    return (f"HF static batching served {rate['hf-static']:,.0f} output tokens/s against the paged engine's "
            f"{rate['paged-engine']:,.0f}. On a small load that fits one batch this is expected: a static batch runs "
            "one padded forward per step with no scheduling, while this engine is Python that builds block tables "
            "and slot mappings every step. Paging pays off when requests of mixed lengths arrive and finish at "
            "different times: a static batch then waits for its longest member and cannot admit new requests, "
            "which is the README's 64-request benchmark.")


def system_comparison_figure(table: pd.DataFrame) -> go.Figure:
    """Output tokens/s per serving system."""
    figure = px.bar(table, x="system", y="output_tok_s", color="system", title="Output tokens/s",
                    labels={"output_tok_s": "tokens/s"})
    return figure.update_layout(height=320, showlegend=False)


HEADLINE_RATIO_SHOWN = 5.0


def headline_figure(table: pd.DataFrame) -> go.Figure:
    """Each headline figure as a multiple of its goal (inverted where lower is better), so the line at 1 is the
    goal for all of them: green bars meet it, red ones do not."""
    data = table.dropna(subset=["latest_over_goal"])
    colours = ["#16a34a" if met else "#dc2626" for met in data["met"]]
    text = [f"{human_number(value)} {unit} (goal {goal})" for value, unit, goal in
            zip(data["latest"], data["unit"], data["goal"])]
    # a figure past HEADLINE_RATIO_SHOWN times its goal (or infinitely past it: a zero where lower is better) is drawn
    # that long; its label says the figure
    ratios = np.minimum(data["latest_over_goal"].to_numpy(dtype=float), HEADLINE_RATIO_SHOWN)
    figure = go.Figure(go.Bar(x=ratios, y=data["benchmark"], orientation="h", marker_color=colours,
                              customdata=text, hovertemplate="%{y}<br>%{customdata}<extra></extra>"))
    # each figure written right of its bar or of the goal line, whichever ends later: never crossed by the line
    label_x = np.maximum(ratios, 1.0) * 1.02
    figure.add_trace(go.Scatter(x=label_x, y=data["benchmark"], mode="text", text=text, textposition="middle right",
                                hoverinfo="skip", showlegend=False))
    figure.add_vline(x=1.0, line_dash="dash", line_color="black", annotation_text="goal",
                     annotation_position="bottom right")
    figure.update_layout(title="Latest figure against its goal (≥ 1 meets it)", height=120 + 40 * len(data),
                         xaxis=dict(title="latest / goal (goal / latest where lower is better)",
                                    range=[0, 1.9 * max(1.0, float(label_x.max()))]),
                         yaxis=dict(autorange="reversed"), margin=dict(l=10, r=10, t=40, b=10), showlegend=False)
    return figure

import streamlit as st

import pandas as pd

from lab.report.charts import (block_pool_figure, block_pool_frame, block_table_frame, offload_tier_figure,
                               pool_occupancy_figure)
from lab.engine.live import throttled
from lab.kv_cache.pool_view import EVENT_KINDS, pool_events, pool_occupancy
from lab.report.results import settings_of
from simulator.views.pool_frames import PoolRunConfig, busiest_frame, record_pool_frames
from lab.errors import user_errors
from app_pages._ui import chart, csv_download, data_table, setting, show_error

st.title("Block pool")
st.caption("Every physical KV block, coloured by the sequence that holds it (the legend and the hover name it); "
           "● marks shared blocks with their reference count; grey blocks are free. Symbols mark what happened to a "
           "block since the previous frame: " + "; ".join(f"{kind}: {text.split(': ', 1)[-1]}"
                                                          for kind, text in EVENT_KINDS.items()) + ".")

with st.sidebar:
    source = setting(st.radio, "Drive the pool with", key="pool_source", value="simulator (paged)",
                     options=["simulator (paged)", "runtime engine"])
    num_blocks = setting(st.slider, "Physical blocks", key="num_blocks", value=160, min_value=16, max_value=1024,
                         step=16)
    block_size = setting(st.select_slider, "Block size", key="pool_block_size", value=16, options=[1, 2, 4, 8, 16, 32])
    num_requests = setting(st.slider, "Requests", key="pool_requests", value=24, min_value=1, max_value=200)
    n = setting(st.slider, "Parallel samples n (forks + copy-on-write)", key="pool_n", value=2, min_value=1, max_value=4)
    shared_prefix = setting(st.slider, "Shared prompt prefix (tokens; prefix caching)", key="pool_prefix", value=64,
                            min_value=0, max_value=256, step=16)
    every = setting(st.slider, "Record a frame every … iterations", key="pool_every", value=2, min_value=1,
                    max_value=20)
    preemption = setting(st.radio, "Preemption", key="pool_preemption", value="recompute",
                         options=["recompute", "swap"], horizontal=True,
                         help="swap: preempted sequences move to a host pool, shown below the device pool")
    offload = setting(st.slider, "Host offload tier (blocks)", key="offload_blocks", value=0, min_value=0,
                      max_value=512, step=16,
                        help="prefix blocks the device pool evicts are kept in host memory and loaded back when a "
                             "later prompt shares them (0: no tier); shown below the device pool. With swap "
                             "preemption the tier and swapped-out sequences share one host pool (the swap space "
                             "plus these blocks; swapped sequences first)")
    run = st.button("Run", type="primary", key="run")


config = PoolRunConfig(source="simulator" if source.startswith("simulator") else "engine", num_blocks=num_blocks,
                       block_size=block_size, num_requests=num_requests, n=n, shared_prefix_tokens=shared_prefix,
                       preemption_mode=preemption, frame_every=every, kv_offload_blocks=offload)

if run or "pool_frames" not in st.session_state:
    live = st.empty()

    def draw_frame(frame):
        iteration, pool = frame
        live.plotly_chart(block_pool_figure(pool.ref_counts, pool.owners, title=f"iteration {iteration}"))

    try:
        frames = record_pool_frames(config, throttled(draw_frame, 0.25))  # at most 4 redraws a second
        st.session_state.update(pool_frames=frames, pool_index=busiest_frame(frames),
                                pool_settings=settings_of(config))  # open on the fullest frame
    except user_errors() as exc:
        show_error(exc)
        st.stop()
    live.empty()

frames, settings = st.session_state["pool_frames"], st.session_state["pool_settings"]
occupancy = pd.DataFrame(pool_occupancy(frames))
every_sequence = sorted({seq for _, pool in frames for seq in pool.block_tables},
                        key=lambda seq: (not isinstance(seq, int), seq if isinstance(seq, int) else 0, str(seq)))
# Outside the fragment: toggling Play reruns the page, which redefines the fragment to rerun on a timer only while
# playing (a timer that always runs kept a core 70 % busy with the page sitting idle).
playing = st.toggle("Play", key="pool_play", help="Step through the recorded frames, about 2 a second")


@st.fragment(run_every=0.4 if playing else None)
def player():
    if playing:
        st.session_state["pool_index"] = (st.session_state["pool_index"] + 1) % len(frames)
    index = st.slider("Frame", 0, len(frames) - 1, key="pool_index")
    iteration, pool = frames[index]
    events = pool_events(frames[index - 1][1], pool) if index else []
    cols = st.columns(5)
    cols[0].metric("iteration", iteration)
    cols[1].metric("free blocks", f"{pool.num_free_blocks:,} of {len(pool.ref_counts):,}")
    cols[2].metric("shared blocks", sum(count > 1 for count in pool.ref_counts))
    cols[3].metric("sequences", len(pool.block_tables))
    cols[4].metric("events since the last frame", len(events))
    highlight = st.selectbox("Highlight a sequence (its blocks keep their colour; its block table below)",
                             [None, *every_sequence], format_func=lambda s: "none" if s is None else f"sequence {s}",
                             key="pool_highlight")
    chart(block_pool_figure(pool.ref_counts, pool.owners, highlight=highlight, events=events,
                            title=f"{settings['source']}, {len(pool.ref_counts):,} blocks of {pool.block_size} "
                                  f"tokens, iteration {iteration}"), "pool_heatmap")
    chart(pool_occupancy_figure(occupancy, iteration), "pool_occupancy")
    if highlight is not None and highlight not in pool.block_tables:
        st.caption(f"Sequence {highlight} holds no blocks at iteration {iteration} (not yet admitted, preempted or "
                   "finished).")
    elif highlight is not None:
        seq = highlight
        table = block_table_frame(pool.block_tables[seq], pool.block_size, pool.seq_lens.get(seq))
        data_table(table)
        csv_download(table, f"block-table-{seq}", {**settings, "iteration": iteration}, "dl_block_table",
                     "Download this block table (CSV)")
    csv_download(block_pool_frame(pool.ref_counts, pool.owners), "block-pool", {**settings, "iteration": iteration},
                 "dl_pool", "Download this frame (CSV)")
    host, tier = pool.host_pool, pool.offload
    if host is not None and (tier is None or not tier.shares_host_pool):
        st.caption(f"Host pool (swap space): {len(host.ref_counts) - host.num_free_blocks} of "
                   f"{len(host.ref_counts)} blocks hold swapped-out sequences")
        chart(block_pool_figure(host.ref_counts, host.owners, title=f"host pool, iteration {iteration}"),
              "host_pool_heatmap")
    if tier is not None:
        stats, shared = tier.stats, tier.shares_host_pool
        swapped = [bool(owners) for owners in host.owners] if shared else None
        where = (f"Host pool, one budget of {len(tier.lru_rank)} blocks: {sum(swapped)} hold swapped-out "
                 f"sequences (orange), {tier.num_used_slots} the offload tier's prefix blocks" if shared else
                 f"Host offload tier: {tier.num_used_slots} of {len(tier.lru_rank)} slots hold prefix blocks")
        st.caption(f"{where}, evicted by the device pool; so far {stats.stored_blocks} stored, "
                   f"{stats.loaded_blocks} loaded back for prompts that shared them (blue, darker: used more "
                   f"recently; the lightest is evicted next)")
        chart(offload_tier_figure(tier.lru_rank, f"host {'pool' if shared else 'offload tier'}, iteration "
                                  f"{iteration}", swapped), "offload_tier_heatmap")

player()


def vllm_prefix_cache() -> None:
    """vLLM's own prefix cache, from the KV events of the vLLM twin page's last run."""
    import plotly.express as px

    from lab.peer.server import prefix_cache_timeline

    st.subheader("vLLM's prefix cache (KV events of the vLLM twin page's last run)")
    twin = st.session_state.get("vllm_twin")
    run = twin.snapshot() if twin is not None else None
    if run is None or run.events.empty:
        st.caption("Run a workload on the vLLM twin page with a server started there: its KV-cache events "
                   "(blocks stored and evicted, published over ZMQ) are drawn here.")
        return
    timeline, totals = prefix_cache_timeline(run)
    cols = st.columns(3)
    cols[0].metric("blocks stored", f"{totals['stored_blocks']:,}")
    cols[1].metric("blocks evicted", f"{totals['removed_blocks']:,}")
    cols[2].metric("prefix-cache hit rate", f"{totals['hit_rate']:.1%}",
                   help=f"{totals['hit_tokens']:,.0f} of {totals['queried_tokens']:,.0f} prompt tokens found cached")
    # cached last, dashed: drawn over "stored so far", which it equals until the first eviction
    long = timeline.melt(id_vars="t_s", value_vars=["stored_blocks", "removed_blocks", "cached_blocks"],
                         var_name="series", value_name="blocks")
    long["series"] = long["series"].map({"cached_blocks": "cached now", "stored_blocks": "stored so far",
                                         "removed_blocks": "evicted so far"})
    chart(px.line(long, x="t_s", y="blocks", color="series", line_shape="hv", line_dash="series",
                  line_dash_map={"cached now": "dash", "stored so far": "solid", "evicted so far": "solid"},
                  color_discrete_map={"cached now": "#1f77b4", "stored so far": "#2ca02c",
                                      "evicted so far": "#d62728"},
                  labels={"t_s": "seconds from the run's first request", "blocks": f"blocks ({twin.config.block_size} tokens each)"},
                  title=f"{twin.workload.name}: {len(twin.workload)} requests"), "vllm_prefix_cache")
    csv_download(timeline, "vllm-prefix-cache", {**settings_of(twin.config), "workload": twin.workload.name},
                 "dl_vllm_prefix_cache", "Download the prefix-cache timeline (CSV)")


vllm_prefix_cache()

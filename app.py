"""MiniPaged Lab — `streamlit run app.py`."""
from pathlib import Path

import streamlit as st

# A local file: a Material icon as the page icon made the browser fetch it from a font server
st.set_page_config(page_title="MiniPaged Lab", page_icon=str(Path(__file__).parent / "static" / "favicon.png"),
                   layout="wide")

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon=":material/home:", default=True),
    st.Page("pages/memory_simulator.py", title="Memory simulator", icon=":material/stacked_bar_chart:"),
    st.Page("pages/block_pool.py", title="Block pool", icon=":material/grid_view:"),
    st.Page("pages/kernel_lab.py", title="Kernel lab", icon=":material/memory:"),
    st.Page("pages/runtime.py", title="Qwen3 runtime", icon=":material/smart_toy:"),
    st.Page("pages/twin.py", title="Digital twin", icon=":material/compare:"),
    st.Page("pages/vllm_twin.py", title="vLLM twin", icon=":material/dns:"),
    st.Page("pages/paper.py", title="vLLM paper", icon=":material/science:"),
    st.Page("pages/sweeps.py", title="Sweeps & planning", icon=":material/grid_on:"),
    st.Page("pages/benchmarks.py", title="Benchmarks", icon=":material/table_chart:"),
]
st.navigation(PAGES).run()

"""MiniPaged Lab — `streamlit run app.py`."""
import streamlit as st

st.set_page_config(page_title="MiniPaged Lab", page_icon="🧱", layout="wide")

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon="🧱", default=True),
    st.Page("pages/memory_simulator.py", title="Memory simulator", icon="📊"),
    st.Page("pages/block_pool.py", title="Block pool", icon="🟦"),
    st.Page("pages/kernel_lab.py", title="Kernel lab", icon="⚙️"),
    st.Page("pages/runtime.py", title="Qwen3 runtime", icon="🤖"),
    st.Page("pages/benchmarks.py", title="Benchmarks", icon="📋"),
]
st.navigation(PAGES).run()

"""MiniPaged Lab — `streamlit run app.py`."""
import streamlit as st

from lab.hardware import describe_hardware

st.set_page_config(page_title="MiniPaged Lab", page_icon="🧱", layout="wide")
st.title("MiniPaged Lab")
st.write("See and measure what paging the KV cache buys: a paged Qwen3 runtime, paged attention kernels and a "
         "KV memory simulator.")
st.subheader("This machine")
st.table(describe_hardware())

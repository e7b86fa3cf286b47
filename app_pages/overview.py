import streamlit as st

from lab.report.charts import paging_diagram
from lab.hardware import describe_hardware
from lab.report.results import settings_of
from app_pages._ui import PAGES, chart, csv_download

hardware = st.cache_data(describe_hardware)

st.title("MiniPaged Lab")
st.markdown(
    "A language model keeps, for every request it serves, the keys and values of every token seen so far: the **KV "
    "cache**. Giving each request one contiguous slab of GPU memory wastes most of it; **paging** the cache into "
    "small fixed blocks, as vLLM does, wastes almost none, so more requests fit at once. This lab shows how much, "
    "on your workload and your hardware.")
st.page_link("app_pages/memory_simulator.py", label="Start here: the Memory simulator answers “what does paging buy?” "
             "at its defaults", icon=":material/arrow_forward:")
st.markdown(
    "**Paged KV cache.** A sequence's keys and values live in fixed-size *blocks* of the GPU's KV pool. A per-sequence "
    "*block table* maps its logical blocks to physical ones, so a sequence only holds the blocks it has filled, "
    "blocks need not be contiguous, and sequences can *share* blocks (a common prompt, parallel samples) with "
    "reference counts and copy-on-write.\n\n"
    "**Paged attention.** The decode kernel walks each sequence's block table and reads K/V block by block, with an "
    "online softmax — one thread block per (sequence, KV head) serving every query head of its GQA group.")
chart(paging_diagram(), "paging_diagram")
st.subheader("Pages")
for page in PAGES[1:]:
    st.page_link(page.path, label=f"{page.title} — {page.blurb}", icon=page.icon)
st.subheader("This machine")
st.dataframe(hardware(), hide_index=True)
csv_download(hardware(), "hardware", settings_of(), "dl_hardware")

"""MiniPaged Lab — `streamlit run app.py`."""


def main() -> None:
    from pathlib import Path

    import streamlit as st

    # A local file: a Material icon as the page icon made the browser fetch it from a font server
    st.set_page_config(page_title="MiniPaged Lab", page_icon=str(Path(__file__).parent / "static" / "favicon.png"),
                       layout="wide")

    PAGES = [
        st.Page("app_pages/overview.py", title="Overview", icon=":material/home:", default=True),
        st.Page("app_pages/memory_simulator.py", title="Memory simulator", icon=":material/stacked_bar_chart:"),
        st.Page("app_pages/block_pool.py", title="Block pool", icon=":material/grid_view:"),
        st.Page("app_pages/kernel_lab.py", title="Kernel lab", icon=":material/memory:"),
        st.Page("app_pages/runtime.py", title="Qwen3 runtime", icon=":material/smart_toy:"),
        st.Page("app_pages/twin.py", title="Digital twin", icon=":material/compare:"),
        st.Page("app_pages/vllm_twin.py", title="vLLM twin", icon=":material/dns:"),
        st.Page("app_pages/paper.py", title="vLLM paper", icon=":material/science:"),
        st.Page("app_pages/sweeps.py", title="Sweeps & planning", icon=":material/grid_on:"),
        st.Page("app_pages/benchmarks.py", title="Benchmarks", icon=":material/table_chart:"),
    ]
    st.navigation(PAGES).run()


# Streamlit runs this script as __main__; the simulator's worker processes (multiprocessing) import it again as
# __mp_main__, where starting the app would cost each worker streamlit's import and a page run
if __name__ == "__main__":
    main()

import streamlit as st

from lab.results import read_recorded, recorded_results
from pages._ui import USER_ERRORS, csv_download, results_store, show_error

st.title("Benchmarks")
st.caption("Every result produced in this session — simulations, kernel sweeps, runtime runs — side by side, and the "
           "benchmark results recorded in this repository.")
store = results_store()

upload = st.file_uploader("Load a previously exported CSV", type=["csv"])
if upload is not None and st.session_state.get("loaded_upload") != upload.file_id:
    try:
        store.load_csv(upload.getvalue(), upload.name)
        st.session_state["loaded_upload"] = upload.file_id
    except USER_ERRORS as exc:
        show_error(exc)


def session_results():
    if not store.names():
        st.info("No results yet: run the memory simulator, the kernel lab or the runtime, load a CSV, or add a "
                "recorded result below.")
        return
    st.dataframe(store.listing(), hide_index=True)
    csv_download(store.listing(), "results_listing.csv", "dl_listing", "Download this list (CSV)")
    chosen = st.multiselect("Compare", store.names(), default=store.names()[-2:])
    if chosen:
        table = store.side_by_side(chosen)
        st.dataframe(table, hide_index=True)
        csv_download(table, "comparison.csv", "dl_comparison", "Download the comparison CSV")
    for index, name in enumerate(store.names()):
        with st.expander(name):
            st.dataframe(store.results[name].table, hide_index=True)
            csv_download(store.results[name].table, f"result_{index}.csv", f"dl_result_{index}")


def recorded():
    st.subheader("Recorded in this repository")
    listing = recorded_results()
    if listing.empty:
        st.info("No recorded results (benchmarks/results/ is missing).")
        return
    st.caption("The figures the README quotes, from `benchmarks/results/`; each file's command reruns it.")
    st.dataframe(listing, hide_index=True)
    file = st.selectbox("Show", listing["file"], key="recorded_file")
    try:
        table = read_recorded(file)
    except USER_ERRORS as exc:
        show_error(exc)
        return
    st.dataframe(table, hide_index=True)
    csv_download(table, file.replace("/", "_"), "dl_recorded")
    if st.button("Add to this session's results (to compare)", key="add_recorded"):
        store.add("recorded", f"recorded: {file}", table)
        st.rerun()


session_results()
recorded()

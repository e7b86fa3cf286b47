import streamlit as st

from lab.report.charts import headline_figure
from lab.report.results import headline_results, read_recorded, recorded_results, settings_of
from lab.errors import user_errors
from lab.report.trust import table_problems
from app_pages._ui import chart, csv_download, data_table, results_store, setting, show_error, trust_warning

st.title("Benchmarks")
st.caption("The lab's headline figures as last recorded in this repository, each against its goal; then every "
           "result of this session side by side.")
store = results_store()


def headlines():
    table = headline_results()
    met = table["met"].dropna()
    st.subheader(f"Headline figures: {int(met.sum())} of {len(met)} goals met")
    stale = table[table["current"].eq(False)]
    if len(stale):
        st.warning(f"{len(stale)} of {len(table)} figures were measured on code that has changed since (or name no "
                   "commit): they may no longer hold. Rerun each one's command to measure this checkout.")
    problems = []
    for file in table["file"].dropna().unique():  # the files the figures come from, judged as the figures are
        try:
            problems += [f"{file}: {problem}" for problem in table_problems(read_recorded(file))]
        except user_errors():
            continue  # a missing file is the table's own "currency" column's business
    trust_warning(problems)
    chart(headline_figure(table), "headlines")
    shown = table[["benchmark", "latest", "unit", "goal", "met", "current", "measured_on", "currency", "command", "file",
                   "commit_of", "code"]]  # whether a figure still holds, before where it came from
    st.dataframe(shown, hide_index=True, column_config={
        "latest": st.column_config.NumberColumn("latest", format="localized"),
        "met": st.column_config.CheckboxColumn("goal met"),
        "benchmark": st.column_config.TextColumn("benchmark", width="large"),
        "measured_on": st.column_config.TextColumn("measured on (commit)"),
        "commit_of": st.column_config.TextColumn("commit of (figure or file)"),
        "current": st.column_config.CheckboxColumn("code unchanged since"),
        "currency": st.column_config.TextColumn("currency"),
        "code": st.column_config.TextColumn("code it measures")})
    st.caption("Read from the CSVs in `benchmarks/results/` (each `command` writes its file), so they survive the "
               "browser session; `benchmarks/results/HISTORY.md` says what moved each figure.")
    csv_download(table, "headline-figures", settings_of(), "dl_headlines", "Download the headline figures (CSV)")

upload = st.file_uploader("Load a previously exported CSV (kept for this session only, not in a shared link)",
                          type=["csv"])
if upload is not None and st.session_state.get("loaded_upload") != upload.file_id:
    try:
        store.load_csv(upload.getvalue(), upload.name)
        st.session_state["loaded_upload"] = upload.file_id
    except user_errors() as exc:
        show_error(exc)


def session_results():
    st.subheader("This session's results")
    if not store.names():
        st.info("No results yet: run the memory simulator, the kernel lab or the runtime, load a CSV, or add a "
                "recorded result below.")
        return
    data_table(store.listing())
    csv_download(store.listing(), "results-listing", settings_of(), "dl_listing", "Download this list (CSV)")
    latest = store.results[store.names()[-1]]
    same_kind = [name for name, result in store.results.items() if result.kind == latest.kind][-2:]
    chosen = st.multiselect("Compare", store.names(), default=same_kind,
                            help="by default the two latest results of the latest result's kind")
    if chosen:
        data_table(store.side_by_side(chosen))
        csv_download(store.side_by_side(chosen, settings=True), "comparison", settings_of(), "dl_comparison",
                     "Download the comparison CSV (each result with its settings)")
    for index, name in enumerate(store.names()):
        with st.expander(name, key=f"result_box_{name}"):
            trust_warning(table_problems(store.results[name].table))
            data_table(store.results[name].table)
            result = store.results[name]
            csv_download(result.table, result.kind, settings_of(result.settings, result=name),
                         f"dl_result_{index}")


def recorded():
    st.subheader("Recorded in this repository")
    listing = recorded_results()
    if listing.empty:
        st.info("No recorded results (benchmarks/results/ is missing).")
        return
    st.caption("The figures the README quotes, from `benchmarks/results/`; each file's command reruns it.")
    data_table(listing)
    file = setting(st.selectbox, "Show", key="recorded_file", value=listing["file"].iloc[0],
                   options=list(listing["file"]))
    try:
        table = read_recorded(file)
    except user_errors() as exc:
        show_error(exc)
        return
    trust_warning(table_problems(table))
    data_table(table)
    csv_download(table, "recorded-" + file.removesuffix(".csv").replace("/", "-"), settings_of(source=file),
                 "dl_recorded")
    if st.button("Add to this session's results (to compare)", key="add_recorded"):
        store.add("recorded", f"recorded: {file}", table, settings_of(source=file))
        st.rerun()


headlines()
session_results()
recorded()

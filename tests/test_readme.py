"""The README fits a page and quotes the recorded figures as they are."""
import re
from pathlib import Path

from lab.report.results import headline_markdown, history_known

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_fits_a_page():
    lines = README.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
    assert not [n for n, line in enumerate(lines, 1) if len(line) > 200]


def test_the_readme_s_headline_table_is_the_recorded_one():
    """`python -m lab headlines` prints the table from benchmarks/results/; rerun it after a benchmark, and after a
    change to code a figure measures (its "measured on" cell then turns stale: the README cannot claim it holds)."""
    if history_known():
        assert headline_markdown() in README
    else:  # a shallow clone cannot tell which figures are stale: the figures themselves still must match
        assert all(line.rsplit("|", 2)[0] in README for line in headline_markdown().splitlines()[2:])


def test_every_link_into_docs_resolves():
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", README):
        assert (ROOT / target).exists(), target


def test_the_two_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "pip install -r requirements.txt && python -m pytest" in README
    assert ci[-1] == "pip install -r requirements.txt && python -m pytest"
    assert "pip install -r requirements.txt && streamlit run app.py" in README


def test_the_readme_s_answer_at_the_defaults_is_what_the_simulator_gives():
    """The figures of 'What paging buys, at the app's defaults', recomputed."""
    import simulator
    from simulator.views import report

    summary, _ = simulator.default_comparison()
    versus = report.paged_vs_best_contiguous(summary).set_index("Figure")
    share = versus.loc["Allocated KV holding tokens (%)", "Paged"]
    contiguous = report.headline(summary)[summary["allocator"] != "paged"]["Allocated KV holding tokens (%)"]
    assert f"**{share:.1f} %**" in README
    assert f"against {contiguous.min():.0f}–{contiguous.max():.0f} %" in README
    assert f"**{versus.loc['Mean running sequences', 'Paged / contiguous']:.2f} ×** more requests" in README
    assert f"**{versus.loc['Throughput (output tokens/s)', 'Paged / contiguous']:.2f} ×** the best" in README
    assert versus["Contiguous run"].iloc[0] == "contiguous-oracle"  # "the oracle" in the sentence
    d = simulator.APP_DEFAULTS
    assert f"{d['num_requests']:,} ShareGPT-like requests at {d['rate']:g} per second" in README

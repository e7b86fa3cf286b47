"""Every recorded figure says on which commit it was measured, and the headline table, the CLI and the Benchmarks page
mark one whose code changed since as stale: a figure cannot go on claiming a speed the code no longer has."""
import math
import subprocess

import pandas as pd
import pytest

from lab.report import results
from lab.report.results import (currency, headline_markdown, headline_results, history_known, lab_commit,
                                settings_of)

pytestmark = pytest.mark.skipif(lab_commit() == "unknown" or not history_known(),
                                reason="needs this checkout's git history (no git, or a shallow clone)")


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=results.ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_every_result_records_the_commit_it_ran_on():
    commit = settings_of()["lab_commit"]
    assert commit.removesuffix("-dirty").startswith(_head()[:7])


def test_a_figure_of_an_older_commit_is_stale_when_its_code_changed_since():
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=results.ROOT, capture_output=True,
                           text=True, check=True).stdout.split()[0]
    assert currency(first, "simulator.csv") == (False, "stale: its code changed since")
    assert currency(None, "simulator.csv") == (False, "no commit recorded")
    assert currency("0123456789ab", "simulator.csv")[0] is None  # a commit this history lacks: cannot tell


def test_a_figure_of_this_commit_is_current_unless_measured_on_uncommitted_code():
    head = _head()
    clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "lab", "simulator", "paged_kernels"],
                           cwd=results.ROOT).returncode == 0
    if not clean:
        pytest.skip("this checkout has uncommitted changes to the code")
    assert currency(head, "e2e_cpu.csv") == (True, "current")
    assert currency(head + "-dirty", "e2e_cpu.csv") == (False, "measured on uncommitted changes")


def test_the_headline_table_reads_each_figure_s_commit(tmp_path, monkeypatch):
    head = _head()
    (tmp_path / "launches.csv").write_text(pd.DataFrame(
        {"lab_commit": [head], "step": ["decode"], "per_layer": [10]}).to_csv(index=False))
    (tmp_path / "e2e_cpu.csv").write_text(pd.DataFrame(  # no commit column: the file's own commit bounds it
        {"system": ["paged-engine"], "speedup_vs_hf_continuous": [3.0], "scheduler_share": [0.01]}).to_csv(index=False))
    monkeypatch.setattr(results, "recorded_in", lambda path: None)  # not committed, as a fresh file
    table = headline_results(tmp_path).set_index("file")
    launches = table.loc["launches.csv"]
    assert launches["measured_on"] == head and launches["commit_of"] == "figure"
    assert table.loc["e2e_cpu.csv", "currency"].iloc[0] == "no commit recorded"
    assert not table.loc["e2e_cpu.csv", "current"].iloc[0]
    markdown = headline_markdown(tmp_path)
    assert "| measured on |" in markdown and "⚠ none" in markdown
    assert "| measured on |" not in headline_markdown(tmp_path, currency=False)


def test_the_contention_bound_is_every_core_quiet_over_one_thread_loaded():
    """The bound beside the contention row: the fixed counts' rows of the same run, the most threads' quiet speed
    over one thread's loaded speed; nan when the run has no such pair."""
    from lab.report.results import _contention_bound

    table = pd.DataFrame({"system": ["paged engine (threads measured)", "paged engine (1 thread)",
                                     "paged engine (4 threads)", "paged engine (2 threads)", "hf-continuous"],
                          "quiet_tok_s": [9.0, 6.0, 12.0, 9.0, 1.0], "loaded_tok_s": [6.0, 5.0, 2.0, 3.0, 0.8]})
    assert _contention_bound(table) == 12.0 / 5.0
    assert math.isnan(_contention_bound(table[table["system"] != "paged engine (1 thread)"]))
    assert math.isnan(_contention_bound(table[table["system"] == "paged engine (1 thread)"]))

"""The real app in a real browser, the pages that run an engine: the digital twin, the vLLM twin against a real vLLM
server, and the Qwen3 runtime's vLLM metrics and live run. How the browser and the server run:
tests/browser_support.py."""
import os
import re

import pytest

from benchmarks.app_flow import runs_started, settle, started_by
from tests.browser_support import (  # noqa: F401 (browser, server, shots: the shared fixtures)
    BROWSER_MARKS, assert_no_traceback, browser, no_exception, plotly_traces, server, shots)

pytestmark = BROWSER_MARKS


def test_the_twin_calibrates_and_runs_both_ways(server, browser, shots):
    page = browser.new_page(viewport={"width": 1400, "height": 2000})  # tall: the error table and the charts
    page.goto(f"{server}/twin", timeout=60_000)
    settle(page, False)
    # the quick grid keeps CI short; screenshots for the README calibrate on the full grid, a real fit
    grid = "full" if os.environ.get("MINIPAGED_SCREENSHOT_DIR") else "quick"
    runs = runs_started(page)
    page.locator('[data-testid="stSidebar"] label').filter(has_text=grid).click()
    settle(page, False, after=runs if grid == "quick" else None)  # full is the default: no rerun
    page.get_by_role("button", name="Calibrate on this machine").click()
    page.get_by_role("button", name="Run the twin").wait_for(timeout=180_000)
    settle(page, False)
    no_exception(page)
    page.get_by_role("button", name="Run the twin").click()
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=180_000)
    settle(page, True)
    no_exception(page)
    alerts = page.locator('[data-testid="stAlert"]').all_inner_texts()  # a quick grid's fit also draws a warning
    assert any("Identical schedules" in alert for alert in alerts), alerts
    assert page.locator(".js-plotly-plot").count() == 4  # blocks, tokens/s, TTFT and TPOT CDFs
    page.screenshot(path=str(shots / "twin_run.png"), full_page=True)
    page.close()



def test_the_vllm_twin_runs_live_and_feeds_the_block_pool_page(server, browser, shots):
    """A real vLLM server started from the page (the peer environment), a workload with a shared system prompt, the
    twin drawn beside it and scored; then the Block pool page, in the same session, draws vLLM's prefix cache from
    the run's KV events. The server is gone when the run is."""
    from lab.peer.client import missing_reason

    if missing_reason():
        pytest.skip(missing_reason())
    page = browser.new_page(viewport={"width": 1400, "height": 2200})
    page.goto(f"{server}/vllm_twin", timeout=60_000)
    settle(page, False)
    runs = runs_started(page)
    page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').filter(has_text="Workload").click()
    page.get_by_role("option", name="Shared system prompt").click()
    settle(page, False, after=runs)
    runs = runs_started(page)
    requests = page.locator('[data-testid="stSidebar"] [data-testid="stNumberInput"]').filter(
        has_text="Requests").locator("input").first
    requests.fill("16")  # one wave of max_num_seqs: the run is the test's, not its length
    requests.press("Enter")
    settle(page, False, after=runs)
    runs = runs_started(page)
    rounds = page.locator('[data-testid="stSidebar"] [data-testid="stNumberInput"]').filter(
        has_text="Server calibration rounds").locator("input").first
    rounds.fill("1")  # the calibration is the CLI test's to repeat (tests/test_vllm_twin.py)
    rounds.press("Enter")
    settle(page, False, after=runs)
    page.get_by_role("button", name="Run", exact=True).click()
    progress = page.locator('[data-testid="stProgress"]')
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid=\"stProgress\"]')].some("
                           "e => /done:|failed/.test(e.innerText))", timeout=300_000, polling=500)
    settle(page, True)
    no_exception(page)
    assert "done:" in progress.inner_text(), page.locator('[data-testid="stAlert"]').all_inner_texts()
    assert page.locator(".js-plotly-plot").count() == 4  # KV usage, queues, tokens/s, latency CDFs
    assert "How close the twin came" in page.locator("h3").all_inner_texts()
    assert page.get_by_role("button", name="Stop").is_disabled()
    page.screenshot(path=str(shots / "vllm_twin_run.png"), full_page=True)
    page.get_by_role("link", name="Block pool").click()
    page.get_by_text("vLLM's prefix cache (KV events").wait_for(timeout=60_000)
    settle(page, True)
    no_exception(page)
    metrics = page.locator('[data-testid="stMetric"]').all_inner_texts()
    assert any("prefix-cache hit rate" in text and "%" in text for text in metrics), metrics
    page.screenshot(path=str(shots / "block_pool_vllm_prefix_cache.png"), full_page=True)
    page.close()
    assert not started_by(server, "vllm.entrypoints"), "the page's vLLM server outlived its run"



def test_the_runtime_page_draws_vllm_s_metrics_and_runs_live(server, browser, shots):
    """Issue 67 in a real browser: the runtime page's vLLM-named panels (gauges over time, TTFT / ITL / E2E
    histograms of several bins each, the per-request Gantt); then a run from the page, the browser drawing it live,
    ends with its output tokens/s on a tile. (Its pace against the same run from a script is a timing:
    ``python -m benchmarks.app_parity``; docs/app.md.)"""
    page = browser.new_page(viewport={"width": 1400, "height": 3000})  # tall: every panel in the screenshot
    page.goto(f"{server}/runtime", timeout=60_000)
    settle(page, True)
    no_exception(page)
    gauges = plotly_traces(page, "vLLM metrics over time")
    assert {"KV-cache usage (vllm:kv_cache_usage_perc)", "running (vllm:num_requests_running)",
            "waiting (vllm:num_requests_waiting)", "preemptions (so far) (vllm:num_preemptions_total)"} <= {
        t["name"] for t in gauges}
    histograms = plotly_traces(page, "Latency distributions")
    assert [t["name"] for t in histograms] == ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                                               "vllm:e2e_request_latency_seconds"]
    assert all(t["n"] >= 5 and sum(1 for y in t["y"] if y) >= 2 for t in histograms), histograms  # not one block
    timeline = plotly_traces(page, "Requests over time")
    assert [t["name"] for t in timeline] == ["queue", "prefill", "decode"] and all(t["n"] == 16 for t in timeline)
    page.screenshot(path=str(shots / "runtime_vllm_metrics.png"), full_page=True)
    runs = runs_started(page)
    page.get_by_role("button", name="Run", exact=True).click()
    settle(page, True, after=runs)
    no_exception(page)
    tile = page.locator('[data-testid="stMetric"]').filter(has_text="Output tokens/s").first.inner_text()
    assert float(re.search(r"([\d,]+)\s*$", tile).group(1).replace(",", "")) > 0, tile
    page.close()


def test_the_server_log_has_no_traceback():
    """Every page and action above left no traceback in the server's log (the app shows messages, not stacks)."""
    assert_no_traceback()

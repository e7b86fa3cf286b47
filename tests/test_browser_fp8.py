"""The KV precision controls (issue 71) in a real browser, as tests/test_browser.py drives the app: the memory
simulator's FP8 cards, the runtime page's and the kernel lab's comparisons. Screenshots go to a temp dir, or to
$MINIPAGED_SCREENSHOT_DIR."""
from pathlib import Path

import pytest

from benchmarks.app_flow import CHROMIUM, launch, runs_started, settle
from tests.browser_support import browser, no_exception, server, shots  # noqa: F401 (the shared fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                                                                 "(apt-get install chromium)")]


def test_the_simulator_s_fp8_control_shows_paging_fp8_and_both(server, browser, shots):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{server}/memory_simulator", timeout=60_000)
    settle(page, True)
    assert page.get_by_text("paging ×").count() == 0
    runs = runs_started(page)
    page.get_by_role("radio", name="fp8_e4m3", exact=True).click()
    settle(page, True, after=runs)
    no_exception(page)
    cards = page.locator('[data-testid="stMetric"]').filter(has_text="fp8_e4m3")
    assert cards.count() == 2
    for text in (cards.nth(0).inner_text(), cards.nth(1).inner_text()):
        assert "paging ×" in text and "FP8 ×" in text and "together ×" in text
    page.get_by_text("paging ×").first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "memory_simulator_fp8.png"), full_page=True)
    page.close()


@pytest.mark.parametrize("path, download", [("runtime", "Download the KV precision comparison (CSV)"),
                                            ("kernel_lab", "Download the KV precision table (CSV)")])
def test_the_precision_comparison_runs_from_the_page_and_exports_the_dtype(server, browser, shots, path, download):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{server}/{path}", timeout=60_000)
    settle(page, True)
    assert page.get_by_role("button", name=download).count() == 0
    runs = runs_started(page)
    page.get_by_role("button", name="Compare KV precision").click()
    settle(page, True, after=runs)
    no_exception(page)
    button = page.get_by_role("button", name=download)
    button.wait_for(timeout=300_000)
    with page.expect_download() as downloaded:
        button.click()
    text = Path(downloaded.value.path()).read_text()
    assert "kv_cache_dtype" in text.splitlines()[0] and "fp8_e4m3" in text
    button.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / f"{path}_fp8.png"), full_page=True)
    page.close()

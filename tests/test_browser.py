"""The real app in a real browser: `streamlit run app.py` on a free loopback port, every page driven by Playwright in
Debian's Chromium (never a downloaded browser). Screenshots go to a temp dir, or to $MINIPAGED_SCREENSHOT_DIR."""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
PAGES = {"": "MiniPaged Lab", "memory_simulator": "Memory simulator", "block_pool": "Block pool",
         "kernel_lab": "Kernel lab", "runtime": "Qwen3 runtime", "twin": "Digital twin", "paper": "The vLLM paper",
         "sweeps": "Sweeps & capacity planning", "benchmarks": "Benchmarks"}
CHART_PAGES = {"", "memory_simulator", "block_pool", "kernel_lab", "runtime", "paper"}

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def streamlit_server():
    """``streamlit run app.py`` on a free loopback port; yields its URL once it answers."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.address",
         "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise RuntimeError("streamlit did not start") from None
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server():
    with streamlit_server() as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    target = os.environ.get("MINIPAGED_SCREENSHOT_DIR")
    path = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def settle(page, charts: bool) -> None:
    """Wait for the script run to end (and for a chart to draw)."""
    page.wait_for_selector('[data-testid="stApp"]', timeout=60_000)
    if charts:
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=120_000)
    for _ in range(2):  # a run can report idle between its script and fragment reruns: check twice
        page.wait_for_function(
            "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"
            " || !document.querySelector('[data-testid=\"stStatusWidget\"]').innerText.includes('Running')",
            timeout=120_000)
        page.wait_for_timeout(1500)


def no_exception(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


@pytest.mark.parametrize("path", list(PAGES))
def test_page_renders_without_exception(server, browser, shots, path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{server}/{path}", timeout=60_000)
    settle(page, path in CHART_PAGES)
    no_exception(page)
    assert PAGES[path] in page.locator("h1").first.inner_text()
    page.screenshot(path=str(shots / f"{path or 'overview'}.png"), full_page=True)
    page.close()


def test_moving_a_slider_reruns_the_simulator(server, browser, shots):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{server}/memory_simulator", timeout=60_000)
    settle(page, True)
    handle = page.locator('[data-testid="stSidebar"] [data-testid="stSlider"] input[type="range"]').first
    before = handle.input_value()
    handle.focus()
    for _ in range(5):
        handle.press("PageUp")
    page.wait_for_timeout(1000)
    settle(page, True)
    assert handle.input_value() != before
    no_exception(page)
    page.screenshot(path=str(shots / "memory_simulator_after_slider.png"), full_page=True)
    page.close()


def test_the_twin_calibrates_and_runs_both_ways(server, browser, shots):
    page = browser.new_page(viewport={"width": 1400, "height": 2000})  # tall: the error table and the charts
    page.goto(f"{server}/twin", timeout=60_000)
    settle(page, False)
    # the quick grid keeps CI short; screenshots for the README calibrate on the full grid, a real fit
    grid = "full" if os.environ.get("MINIPAGED_SCREENSHOT_DIR") else "quick"
    page.locator('[data-testid="stSidebar"] label').filter(has_text=grid).click()
    settle(page, False)
    page.get_by_role("button", name="Calibrate on this machine").click()
    page.get_by_role("button", name="Run the twin").wait_for(timeout=180_000)
    settle(page, False)
    no_exception(page)
    page.get_by_role("button", name="Run the twin").click()
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=180_000)
    settle(page, True)
    no_exception(page)
    assert "Identical schedules" in page.locator('[data-testid="stAlert"]').first.inner_text()
    assert page.locator(".js-plotly-plot").count() == 4  # blocks, tokens/s, TTFT and TPOT CDFs
    page.screenshot(path=str(shots / "twin_run.png"), full_page=True)
    page.close()


def test_a_deep_link_on_a_fresh_server_goes_through_the_app_s_navigation(browser):
    with streamlit_server() as url:  # no session has run app.py yet
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/kernel_lab", timeout=60_000)
        settle(page, True)
        no_exception(page)
        assert "Kernel lab" in page.locator("h1").first.inner_text()
        navigation = page.locator('[data-testid="stSidebarNav"]').inner_text()
        assert "Digital twin" in navigation and "Memory simulator" in navigation  # app.py's titles, not file names
        assert "ui" not in navigation.split()
        page.close()

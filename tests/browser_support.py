"""What the browser tests share (tests/test_browser*.py): the app on a free loopback port (`streamlit run app.py`),
Debian's Chromium driven by Playwright (never a downloaded browser), screenshots in a temp dir or
$MINIPAGED_SCREENSHOT_DIR. Each test file starts its own server, so that pytest-xdist's two workers can take a file
each."""
import contextlib
import os
import tempfile
from pathlib import Path

import pytest

from benchmarks.app_flow import CHROMIUM, launch
from benchmarks.app_flow import streamlit_server as app_server

PAGES = {"": "MiniPaged Lab", "memory_simulator": "Memory simulator", "block_pool": "Block pool",
         "kernel_lab": "Kernel lab", "runtime": "Qwen3 runtime", "twin": "Digital twin", "paper": "The vLLM paper",
         "sweeps": "Sweeps & capacity planning", "benchmarks": "Benchmarks", "vllm_twin": "vLLM twin"}
CHART_PAGES = {"", "memory_simulator", "block_pool", "kernel_lab", "runtime", "paper"}

BROWSER_MARKS = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None,
                                 reason="Debian's chromium is not installed (apt-get install chromium)")]

SERVER_PIDS: dict[str, int] = {}  # url -> the server's process id
SERVER_LOGS: dict[str, Path] = {}  # url -> what the server printed


@contextlib.contextmanager
def streamlit_server():
    """The app on a free loopback port (``benchmarks.app_flow.streamlit_server``), its log kept for
    ``assert_no_traceback``; yields its URL."""
    log = Path(tempfile.mkdtemp(prefix="minipaged-streamlit-")) / "server.log"
    with app_server(log) as (url, pid):
        SERVER_PIDS[url], SERVER_LOGS[url] = pid, log
        yield url


@pytest.fixture(scope="module")
def server():
    with streamlit_server() as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with playwright_api.sync_playwright() as playwright:
        browser = launch(playwright)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    target = os.environ.get("MINIPAGED_SCREENSHOT_DIR")
    path = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def no_exception(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plotly_traces(page, title: str) -> list[dict]:
    """The traces (name, number of x values, x and y) of the plotly chart on ``page`` whose title contains
    ``title``."""
    return page.evaluate("""title => [...document.querySelectorAll('.js-plotly-plot')]
        .filter(el => ((el.layout || {}).title || {}).text && el.layout.title.text.includes(title))
        .flatMap(el => el._fullData.map(t => ({name: t.name || '', n: t.x ? t.x.length : 0,
                                                 x: t.x ? Array.from(t.x) : [], y: t.y ? Array.from(t.y) : []})))""",
                         title)  # _fullData: the arrays decoded (plotly sends numpy arrays base64-encoded)


def assert_no_traceback() -> None:
    """Every server this process started left no traceback in its log (the app shows messages, not stacks)."""
    assert SERVER_LOGS, "no server ran"
    for url, log in SERVER_LOGS.items():
        text = log.read_text()
        assert "Traceback" not in text, f"{url}:\n{text[-3000:]}"

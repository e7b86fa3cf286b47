"""The core flow in a real browser: how long the Memory simulator takes to be current again after a change.

    python -m benchmarks.app_flow [--repeats 5] [--baseline REV] [--out benchmarks/results/app_flow.csv]
                                  [--server-log PATH]

Starts ``streamlit run app.py`` on a free loopback port, opens the Memory simulator in Debian's Chromium at the
defaults, then changes the arrival rate, the paged block sizes and the allocator set, ``--repeats`` times each, and
times each change from the input to the page being current (the app's script idle and no element stale). Prints a
table (median and spread per change), writes it as CSV. The browser helpers are the browser tests' too.

``--baseline REV`` is an A/B in one run: a second server runs commit REV (a git worktree of it, removed after), and
every change is made on both pages in turn (which goes first alternates), so both meet the same machine.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # the browser tests skip, and this module says so when run
    PlaywrightTimeout = TimeoutError

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
RUNS_STARTED = """() => {
    const app = document.querySelector('[data-testid="stApp"]');
    if (window.__runsStarted === undefined) {
        window.__runsStarted = 0;
        new MutationObserver(() => {
            if (app.getAttribute('data-test-script-state') === 'running') window.__runsStarted++;
        }).observe(app, {attributes: true, attributeFilter: ['data-test-script-state']});
    }
    return window.__runsStarted;
}"""
IDLE = """() => {
    const app = document.querySelector('[data-testid="stApp"]');
    return app && app.getAttribute('data-test-script-state') === 'notRunning'
        && !document.querySelector('[data-stale="true"]');
}"""


APP_SERVER_ENV = "MINIPAGED_APP_SERVER_PORT"


def started_by(url: str, command: str) -> list[int]:
    """The processes whose command line holds ``command`` and that the app server at ``url`` (one
    ``streamlit_server`` started) or a process under it started: its mark is in their environment."""
    mark = f"{APP_SERVER_ENV}={url.rsplit(':', 1)[1]}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if command.encode() in (proc / "cmdline").read_bytes() and \
                    mark in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def streamlit_server(log: Path | None = None, root: Path = ROOT):
    """``streamlit run app.py`` of the checkout at ``root`` on a free loopback port, its output to ``log``; yields
    ``(url, pid)`` once it answers, and stops it on the way out."""
    port = free_port()
    out = log.open("w") if log else subprocess.DEVNULL
    # APP_SERVER_ENV marks the server and every process it starts (a vLLM server too, even once orphaned)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               **{APP_SERVER_ENV: str(port)})
    process = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.address",
         "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if log:
            out.close()


def runs_started(page) -> int:
    """How many script runs the page has started since it was first watched (a MutationObserver on the app's
    ``data-test-script-state``, which Streamlit sets to ``running`` for every run)."""
    page.wait_for_selector('[data-testid="stApp"]', timeout=60_000)
    return page.evaluate(RUNS_STARTED)


def settle(page, charts: bool, after: int | None = None, recheck_ms: int = 500) -> None:
    """Wait until the page is current: the script is not running and no element is stale (Streamlit marks the
    previous run's elements ``data-stale`` while a rerun goes on). ``after``: a ``runs_started`` count taken before
    an action, so that the wait first sees the action's own run begin (it may not have started yet)."""
    runs_started(page)
    if after is not None:
        try:
            page.wait_for_function(f"() => window.__runsStarted > {after}", timeout=10_000)
        except PlaywrightTimeout:  # the action's rerun joined a run already going (no new start): wait for it below
            pass
    if charts:  # a page's first chart may wait for the C++ extension's first build (minutes on 2 busy cores)
        try:
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=300_000)
        except PlaywrightTimeout as exc:  # say what the page showed instead
            raise AssertionError(f"no chart on {page.url} after 300 s; {_page_state(page)}") from exc
    for _ in range(2 if recheck_ms else 1):  # a run can report idle between its script and fragment reruns
        page.wait_for_function(IDLE, timeout=180_000, polling=20)
        if recheck_ms:
            page.wait_for_timeout(recheck_ms)


def wait_for_chart(page, text: str, timeout_ms: int = 240_000) -> None:
    """Wait until a plotly chart whose text holds ``text`` is drawn (a run a click started may begin late on a busy
    machine, after a first ``settle`` saw the page idle); ``AssertionError`` with what the page showed instead."""
    try:
        page.locator(".js-plotly-plot").filter(has_text=text).first.wait_for(timeout=timeout_ms)
    except PlaywrightTimeout as exc:
        raise AssertionError(f"no chart with {text!r} on {page.url} after {timeout_ms / 1000:.0f} s; "
                             f"{_page_state(page)}") from exc


def run_until_chart(page, button: str, text: str, timeout_ms: int = 240_000) -> None:
    """Click the button named ``button`` and wait for its chart (``wait_for_chart``). A click can be lost on a busy
    machine (seen in CI: the page idle, no sweep started, its box open): when the page is idle a minute after the
    click without the chart, it is clicked once more, and the chart must come then."""
    runs = runs_started(page)
    page.get_by_role("button", name=button).click()
    settle(page, True, after=runs)
    try:
        wait_for_chart(page, text, timeout_ms=60_000)
        return
    except AssertionError as exc:
        print(f"clicked {button!r} again: {exc}")
    settle(page, True)
    runs = runs_started(page)
    page.get_by_role("button", name=button).click()
    settle(page, True, after=runs)
    wait_for_chart(page, text, timeout_ms)


def _page_state(page) -> str:
    """What a page shows, for a failure message: whether its script runs, its alerts, exceptions and headings."""
    def texts(selector: str) -> list[str]:
        return [text[:300] for text in page.locator(selector).all_inner_texts()]

    state = page.evaluate("() => document.querySelector('[data-test-script-state]')"
                          "?.getAttribute('data-test-script-state')")
    runs = page.evaluate("() => window.__runsStarted")
    return (f"script state {state!r}, runs started {runs}, headings {texts('h1, h2, h3')}, "
            f"alerts {texts('[data-testid=stAlert]')}, exceptions {texts('[data-testid=stException]')}, "
            f"charts {page.locator('.js-plotly-plot').count()}, open boxes {_open_expanders(page)}")


def _open_expanders(page) -> list[str]:
    """The labels of the page's expanders that are open (a chart drawn in a closed one is not visible)."""
    return page.evaluate("() => [...document.querySelectorAll('[data-testid=stExpander] details[open] summary')]"
                         ".map(s => s.innerText.slice(0, 60))")


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def _timed(page, action) -> float:
    """Seconds from ``action()`` to the page being current again."""
    runs = runs_started(page)
    started = time.perf_counter()
    action()
    settle(page, True, after=runs, recheck_ms=0)
    return time.perf_counter() - started


def _sidebar(page, testid: str, text: str):
    return page.locator(f'[data-testid="stSidebar"] [data-testid="{testid}"]').filter(has_text=text)


def _toggle_option(page, widget: str, option: str) -> None:
    """Add ``option`` to a sidebar multiselect, or remove it when it is chosen."""
    page.locator("h1").first.click()  # close a dropdown an earlier change left open (it swallows the next click)
    box = _sidebar(page, "stMultiSelect", widget)
    remove = box.get_by_role("button", name=f"Remove {option}", exact=True)
    if remove.count():
        remove.click()
        return
    box.locator("input").click()
    page.keyboard.type(option)
    page.get_by_role("option", name=option, exact=True).click()
    page.keyboard.press("Escape")


def resolve_commit(rev: str) -> str:
    """The full hash of commit ``rev`` of this repository; ``ValueError`` naming ``rev`` when there is none."""
    commit = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True)
    if commit.returncode:
        raise ValueError(f"--baseline {rev!r} is not a commit of this repository")
    return commit.stdout.strip()


@contextlib.contextmanager
def worktree(commit: str):
    """A checkout of ``commit`` of this repository in a temporary folder (``git worktree``), removed after."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="app_flow_baseline_") as folder:
        path = Path(folder) / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), commit], cwd=ROOT, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


def commit_of(root: Path) -> str:
    """The short commit of the checkout at ``root``, ``+`` when it has changes not committed."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


class FlowPage:
    """The Memory simulator of one server in a browser tab, and the changes the benchmark makes to it."""

    BLOCK_SIZES = ["32", "64", "128", "8", "4", "256", "2", "1"]
    ALLOCATORS = ["contiguous-max", "contiguous-pow2", "contiguous-grow", "contiguous-pow2-total", "contiguous-max"]

    def __init__(self, browser, url: str):
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.url = url

    def load(self) -> float:
        """Seconds to open the page until it is current (the first visit: its run included)."""
        return self._loaded(lambda: self.page.goto(f"{self.url}/memory_simulator", timeout=60_000))

    def reload(self) -> float:
        """Seconds to reload the page until it is current (a new session on a warm server)."""
        return self._loaded(self.page.reload)

    def _loaded(self, navigate) -> float:
        started = time.perf_counter()
        navigate()
        settle(self.page, True, recheck_ms=0)
        return time.perf_counter() - started

    def change(self, name: str, i: int) -> float:
        """Seconds until the page is current after the ``i``-th change called ``name`` (each one a configuration
        the page has not run yet)."""
        try:
            return _timed(self.page, lambda: self._make(name, i))
        except PlaywrightTimeout as error:
            self.page.screenshot(path="app_flow_timeout.png", full_page=True)
            raise RuntimeError(f"'{name}' (change {i + 1}) did not rerun the page; see app_flow_timeout.png"
                               ) from error

    def _make(self, name: str, i: int) -> None:
        if name == CHANGES[0]:
            rate = _sidebar(self.page, "stNumberInput", "Arrival rate").locator("input").first  # typed, not a slider
            rate.fill(f"{float(rate.input_value()) + 0.01:.2f}")
            rate.press("Enter")
        elif name == CHANGES[1]:
            _toggle_option(self.page, "block sizes", self.BLOCK_SIZES[i % len(self.BLOCK_SIZES)])
        else:
            _toggle_option(self.page, "Allocators", self.ALLOCATORS[i % len(self.ALLOCATORS)])


CHANGES = ("arrival rate (+0.01 requests/s)", "paged block sizes (add one)", "allocator set (remove or add one)")


def run(repeats: int, server_log: Path | None = None, baseline: str | None = None) -> list[dict]:
    """One row per timing: ``code`` (``this checkout`` or ``baseline``), ``commit``, ``change``, ``seconds``."""
    from playwright.sync_api import sync_playwright

    rows = []
    with contextlib.ExitStack() as stack:
        roots = {"this checkout": ROOT}
        if baseline is not None:
            roots["baseline"] = stack.enter_context(worktree(resolve_commit(baseline)))
        servers = {code: stack.enter_context(streamlit_server(server_log if code == "this checkout" else None, root))
                   for code, root in roots.items()}
        browser = launch(stack.enter_context(sync_playwright()))
        pages = {code: FlowPage(browser, url) for code, (url, _) in servers.items()}
        commits = {code: commit_of(root) for code, root in roots.items()}

        def record(code: str, change: str, seconds: float) -> None:
            rows.append({"code": code, "commit": commits[code], "change": change, "seconds": seconds})

        for code, page in pages.items():
            record(code, "page load (fresh server)", page.load())
        for name in CHANGES:
            for i in range(repeats):
                for code in (list(pages) if i % 2 == 0 else list(pages)[::-1]):  # who goes first alternates
                    record(code, name, pages[code].change(name, i))
        for code in list(pages)[::-1]:
            record(code, "page load (warm server)", pages[code].reload())
        browser.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Median, min and max per (code, change); with a baseline, each change's median over the baseline's."""
    by_change: dict[tuple, list[float]] = {}
    for row in rows:
        by_change.setdefault((row["code"], row["commit"], row["change"]), []).append(row["seconds"])
    table = [{"code": code, "commit": commit, "change": change, "median_s": statistics.median(times),
              "min_s": min(times), "max_s": max(times), "repeats": len(times)}
             for (code, commit, change), times in by_change.items()]
    baseline = {row["change"]: row["median_s"] for row in table if row["code"] == "baseline"}
    for row in table:
        if baseline:
            row["vs_baseline"] = row["median_s"] / baseline[row["change"]]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.app_flow", description=__doc__.split("\n\n")[0])
    from lab.cli.args import output_csv, positive_int

    parser.add_argument("--repeats", type=positive_int, default=5, help="times each change is made (median)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="A/B in one run: also serve commit REV and make every change on both, in turn")
    parser.add_argument("--server-log", type=Path, default=None,
                        help="write the Streamlit server's output here (what a change that times out met)")
    parser.add_argument("--out", type=output_csv, default="benchmarks/results/app_flow.csv",
                        help="results CSV (checked writable before the browser starts)")
    args = parser.parse_args(argv)
    if args.baseline is not None:
        try:
            resolve_commit(args.baseline)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if CHROMIUM is None:
        print("error: Debian's chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    import pandas as pd

    table = pd.DataFrame(summarize(run(args.repeats, args.server_log, args.baseline)))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.assign(cpus=os.cpu_count()).to_csv(args.out, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

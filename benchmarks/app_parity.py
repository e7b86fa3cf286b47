"""The app tells what the command line tells: the Qwen3 runtime page's figures against the same runs from the CLI.

    python -m benchmarks.app_parity [--repeats 3] [--out benchmarks/results/app_parity.csv]

Two pairs, each run alternately ``--repeats`` times (page first in even rounds, second in odd ones), the page driven
headless by Streamlit's ``AppTest`` (the browser adds nothing to an engine's speed):

* **Compare**: the page's engine comparison (6 requests, the CLI's prompt and output ranges, paged engine and HF
  continuous batching) against ``python -m lab bench e2e`` on the same workload: the paged engine / HF continuous
  batching ratio of each (issue 67: the page once showed 0.45x where the CLI gave 6.7x).
* **Live run**: the page's live run (its defaults, 32 requests of 64-128 new tokens) against the same
  ``run_runtime`` from a plain script: output tokens/s of each (the page once served ~27-30 tokens/s where the script
  served ~720).

Prints a table (median, min and max per side and the median of the per-round ratios, which should lie within ±25 %
of 1) and writes it as CSV with the commit. Exit status 1 when a median ratio lies outside that band.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
BAND = 0.25  # |page / CLI - 1| of the median ratio: wider than this machine's run-to-run spread, far below 2x
LIVE_RUN_SCRIPT = """
import json, sys
from lab.engine import EngineConfig
from lab.engine.live import RuntimeRunConfig, run_runtime
num_requests, low, high = map(int, sys.argv[1:4])
engine = EngineConfig(block_size=16, num_blocks=256, enable_prefix_caching=True, attention_backend="auto",
                      max_num_seqs=32, scheduling="vllm", max_num_batched_tokens=4096, preemption_mode="recompute")
run = run_runtime(RuntimeRunConfig(model="tiny", num_requests=num_requests, prompt_len_range=(16, 128),
                                   max_tokens_range=(low, high), engine=engine), frame_every=0)  # no frames, as the page
print(json.dumps(run.summary))
"""
COMPARE_REQUESTS = 6
LIVE_REQUESTS, LIVE_TOKENS = 32, (64, 128)


def runtime_page():
    """The Qwen3 runtime page, loaded headless (``AppTest``)."""
    from streamlit.testing.v1 import AppTest

    app = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    app.run()
    app.switch_page("app_pages/runtime.py")
    app.run()
    return app


def _checked(app) -> None:
    if app.exception or app.error:
        raise RuntimeError(f"the runtime page failed: {[e.value for e in (*app.exception, *app.error)]}")


def set_compare_workload(app, num_requests: int = COMPARE_REQUESTS) -> None:
    """The page's comparison on the CLI's workload: ``num_requests``, prompts 16-512, outputs 16-256 tokens, paged
    engine and HF continuous batching."""
    app.slider[0].set_value(num_requests)
    app.slider[1].set_value((16, 512))
    app.slider[2].set_value((16, 256))
    app.radio(key="compare_workload").set_value("this page's request mix")
    app.multiselect[0].set_value(["paged-engine", "hf-continuous"])


def page_compare(app) -> pd.DataFrame:
    """One click of the page's Compare: its table, by system."""
    app.button(key="compare").click().run()
    _checked(app)
    return app.session_state["runtime_compare"].set_index("system")


def cli_compare(num_requests: int = COMPARE_REQUESTS) -> pd.DataFrame:
    """``python -m lab bench e2e`` on the same workload: its table, by system."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "e2e.csv"
        done = subprocess.run([sys.executable, "-m", "lab", "bench", "e2e", "--num-requests", str(num_requests),
                               "--systems", "paged-engine,hf-continuous", "--repeats", "1", "--out", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"lab bench e2e failed: {done.stderr[-3000:]}")
        return pd.read_csv(out).set_index("system")


def speedup(table: pd.DataFrame) -> float:
    rate = table["output_tok_s"]
    return float(rate["paged-engine"] / rate["hf-continuous"])


def page_live_run(app) -> float:
    """The page's live run at 32 requests of 64-128 new tokens: output tokens/s."""
    app.slider[0].set_value(LIVE_REQUESTS)
    app.slider[2].set_value(LIVE_TOKENS)
    app.button(key="run").click().run()
    _checked(app)
    return float(app.session_state["runtime_run"].summary["output_tok_s"])


def script_live_run() -> float:
    """The same run from a plain script: output tokens/s."""
    return float(script_run(LIVE_REQUESTS, *LIVE_TOKENS)["output_tok_s"])


def script_run(num_requests: int, low: int, high: int) -> dict:
    """``run_runtime`` from a plain script, the page's engine settings: its run summary."""
    done = subprocess.run([sys.executable, "-c", LIVE_RUN_SCRIPT, str(num_requests), str(low), str(high)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"the script's run failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _alternate(page, cli, repeats: int) -> tuple[list[float], list[float]]:
    pages, clis = [], []
    for round_ in range(repeats):
        for side in (("page", "cli") if round_ % 2 == 0 else ("cli", "page")):
            (pages if side == "page" else clis).append(page() if side == "page" else cli())
    return pages, clis


def _row(case: str, unit: str, pages: list[float], clis: list[float]) -> dict:
    ratios = [p / c for p, c in zip(pages, clis)]
    return {"case": case, "unit": unit, "page_median": statistics.median(pages), "page_min": min(pages),
            "page_max": max(pages), "cli_median": statistics.median(clis), "cli_min": min(clis),
            "cli_max": max(clis), "page_over_cli": statistics.median(ratios),
            "within_band": abs(statistics.median(ratios) - 1) <= BAND}


def run(repeats: int) -> pd.DataFrame:
    app = runtime_page()
    set_compare_workload(app)
    compare = _alternate(lambda: speedup(page_compare(app)), lambda: speedup(cli_compare()), repeats)
    app = runtime_page()
    live = _alternate(lambda: page_live_run(app), script_live_run, repeats)
    return pd.DataFrame([_row("Compare: paged engine / HF continuous batching", "ratio", *compare),
                         _row("Live run: output tokens/s", "tokens/s", *live)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.app_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of each pair (default 3)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "app_parity.csv"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    from lab.report.results import print_and_save, settings_of

    table = run(args.repeats)
    print_and_save(table, args.out, settings=settings_of(vars(args), band=BAND))
    return 0 if table["within_band"].all() else 1


if __name__ == "__main__":
    sys.exit(main())

"""Sweeps and plans on Ray in a child process, for a long-lived host (the app's server).

A Ray driver started from a server's worker thread outlives the script that started it badly: about a minute after
a sweep Ray reported "Failed to connect to GCS … The program will terminate" and took the Streamlit server down with
it (ray-project/ray#45570). Here the driver is a child process's main thread: it starts Ray, runs the job, shuts Ray
down and exits, so nothing of Ray lives in the host. Progress comes back as lines on the child's stdout; a stop is a
file the child polls (the job then ends as a stopped sweep does: finished runs kept); the result is a pickle.

    python -m simulator.experiments.isolated FOLDER   # FOLDER/request.pickle -> FOLDER/result.pickle
"""
from __future__ import annotations

import pickle
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from lab.errors import LabError
from lab.files import write_bytes_atomically

JOBS = ("sweep", "plan")


class IsolatedJobError(LabError):
    """The child process failed; the message holds the end of its error output."""


def run_isolated(job: str, kwargs: dict, on_progress: Callable[[int, int], bool | None] | None = None,
                 poll_s: float = 0.2):
    """Run ``simulator.experiments.sweep.run_sweep(**kwargs)`` (``job="sweep"``) or ``simulator.experiments.plan.plan_capacity(**kwargs)``
    (``"plan"``) in a child process and return its result. ``on_progress(done, total)`` is called as runs finish;
    when it returns True the job stops (what finished is kept). The lab's errors in the child are raised here as
    ``IsolatedJobError`` with their message."""
    if job not in JOBS:
        raise IsolatedJobError(f"unknown job {job!r}; one of {', '.join(JOBS)}")
    with tempfile.TemporaryDirectory(prefix="minipaged-job-") as folder:
        folder = Path(folder)
        (folder / "request.pickle").write_bytes(pickle.dumps((job, kwargs)))
        root = Path(__file__).resolve().parents[2]
        child = subprocess.Popen([sys.executable, "-m", "simulator.experiments.isolated", str(folder)], cwd=root,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True)
        reader.start()
        errors: list[str] = []
        error_reader = threading.Thread(target=lambda: errors.extend(child.stderr), daemon=True)
        error_reader.start()
        try:
            while child.poll() is None or not lines.empty():
                try:
                    line = lines.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if line.startswith("progress ") and on_progress is not None:
                    done, total = map(int, line.split()[1:3])
                    if on_progress(done, total):
                        (folder / "stop").touch()
        except BaseException:  # the host's own interrupt (a widget change reruns the page): end the child too
            (folder / "stop").touch()
            _end(child)
            raise
        reader.join(timeout=5)
        error_reader.join(timeout=5)
        result_path = folder / "result.pickle"
        if not result_path.exists():
            tail = "".join(errors)[-1500:].strip() or "no error output"
            raise IsolatedJobError(f"the {job} process exited with code {child.returncode}: {tail}")
        status, payload = pickle.loads(result_path.read_bytes())
    if status == "error":
        raise IsolatedJobError(payload)
    return payload


def _end(child: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Give the child time to stop on its own (it shuts Ray down), then kill it."""
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _child(folder: Path) -> int:
    job, kwargs = pickle.loads((folder / "request.pickle").read_bytes())
    stop = folder / "stop"

    def report(done: int, total: int) -> bool:
        print(f"progress {done} {total}", flush=True)
        return stop.exists()

    try:
        if job == "sweep":
            from .sweep import run_sweep

            result = ("ok", run_sweep(**kwargs, progress=False, should_stop=report))
        else:
            from .plan import plan_capacity

            result = ("ok", plan_capacity(**kwargs, progress=False, on_progress=report))
    except LabError as exc:
        result = ("error", str(exc))
    finally:
        if "ray" in sys.modules:
            import ray

            ray.shutdown()
    write_bytes_atomically(folder / "result.pickle", pickle.dumps(result))  # whole or not at all
    return 0


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1])))

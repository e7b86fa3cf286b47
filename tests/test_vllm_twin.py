"""A twin of a real vLLM server, end to end and bounded (tens of requests): vLLM's server started from the peer on the
tiny checkpoint, loaded over its OpenAI API with /metrics and KV events recorded; the simulator, calibrated on
vLLM's engine and on the server's own calibration requests, predicting held-out workloads; the server killed
mid-run. Without the peer (``bash scripts/vllm_peer.sh``) these skip with that command as the reason."""
import math
import threading
from dataclasses import replace

import pytest
import torch

from lab.models.qwen3 import save_checkpoint
from lab.peer.client import missing_reason
from lab.profiling.profile import RANGE_QUANTITIES
from lab.peer.server import VLLMServer, check_server, http, run_server_workload, server_cache_config
from simulator.twins.vllm_twin import VLLMTwinConfig, make_twin_workload, run_vllm_twin, server_requests

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
CONFIG = VLLMTwinConfig(workloads=("all-at-once", "prefix"), num_requests=24, grid="quick", profile_repeats=1,
                        calibration_repeats=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "checkpoint", torch.float32))


@pytest.fixture(scope="module")
def server(checkpoint):
    with VLLMServer(CONFIG.peer_settings(checkpoint)) as running:
        yield running
    assert running.process.poll() is not None  # stopped on the way out


def test_the_server_reports_its_pool_and_the_client_records_a_run(server):
    assert check_server(server.url)
    assert server_cache_config(server.url) == {"block_size": 32, "num_gpu_blocks": CONFIG.num_blocks,
                                               "enable_prefix_caching": True}
    assert server.pinned  # the engine core beside its worker
    workload = make_twin_workload("prefix", CONFIG, seed=11)
    run = run_server_workload(server.url, server_requests(workload, 1000, seed=11), events=server.events,
                              poll_s=0.05)
    assert run.complete, run.problems
    requests = run.requests
    assert (requests["output_tokens"] == workload.output_tokens).all()
    assert (requests["first_token_s"] > requests["sent_s"]).all()
    metrics = run.metrics
    assert len(metrics) >= 3 and metrics["kv_usage"].max() > 0
    assert metrics["prefix_hits"].iloc[-1] > metrics["prefix_hits"].iloc[0]  # the shared prompt hit
    stored = run.events[run.events["kind"] == "stored"]
    assert len(stored) > 0 and stored["blocks"].sum() >= workload.shared_prefix_tokens // 32


def test_the_twin_is_scored_against_the_server_on_held_out_workloads(checkpoint, server):
    result = run_vllm_twin(replace(CONFIG, url=server.url), checkpoint, progress=lambda _: None)
    table = result.table.set_index(["workload", "metric"])
    print(result.summary().to_string())
    for workload in ("all-at-once", "prefix"):
        assert table.loc[(workload, "preemptions"), "error"] == 0
        assert table.loc[(workload, "prefix_hit_rate"), "error"] <= 1.0
        # Every latency predicted and scored; how close is a timing, and timings are the benchmark's
        # (`python -m simulator twin --peer vllm --repeats 5`, docs/benchmarks.md): a bound here failed 2 of 2 runs
        # on a busy 2-core machine, where the server's own p50 moved 5.1 / 6.8 / 9.0 ms back to back.
        for metric in ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s", "ttft_p90_s", "tpot_p90_s", "e2e_p90_s"):
            real, error = table.loc[(workload, metric), ["real", "error"]]
            assert real > 0 and math.isfinite(error), (workload, metric)
    assert table.loc[("prefix", "prefix_hit_rate"), "real"] > 50
    calibration = result.calibration
    assert math.isfinite(calibration.step_overhead_s) and calibration.request_overhead_s >= 0
    # each run priced with the overhead probed around it (this VM's drift), which the summary gives per workload
    per_run = result.table.groupby(["workload", "run"])["run_step_overhead_s"].nunique()
    assert (per_run == 1).all() and (result.table["run_step_overhead_s"] >= 0).all()
    assert result.summary()["run_step_overhead_s"].notna().all()
    assert set(result.simulated) == set(result.runs)  # each run's prediction kept: where it extrapolated is said
    assert all(note.split(" up to ")[0] in RANGE_QUANTITIES for note in result.extrapolation().values())


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (``/proc/*/stat``; the server's supervisor leads its own group)."""
    from pathlib import Path

    members = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    members.append(int(proc.name))
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
    return members


def test_a_server_whose_lab_process_is_killed_leaves_no_process(checkpoint):
    """The lab's process killed outright (no cleanup runs): vLLM's API, engine-core and worker processes all go (they
    outlived a killed API process before ``SUPERVISOR``). Only that server's process group is watched: another
    worker's vLLM processes may come and go meanwhile."""
    import subprocess
    import sys
    import time

    script = ("import os, signal; from lab.peer.client import PeerSettings; from lab.peer.server import VLLMServer; "
              f"s = VLLMServer(PeerSettings({checkpoint!r}), events=False); print(s.url, s.process.pid, flush=True); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.stdout.startswith("http://127.0.0.1:"), done.stderr[-2000:]
    group = int(done.stdout.split()[1])
    deadline = time.monotonic() + 30
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_members(group), "vLLM's server outlived the lab process that started it"


def test_a_server_killed_mid_run_ends_the_run_with_what_was_measured(server):
    """Last in this module: it kills the module's server."""
    import os
    import signal
    import time

    from prometheus_client.parser import text_string_to_metric_families

    def finished() -> float:  # the server's finished requests so far (earlier tests' included)
        text = http("GET", f"{server.url}/metrics", 5).text
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == "vllm:request_success_total")

    def kill_after_a_finish(before: float) -> None:  # a fixed 0.8 s found none finished on a busy machine
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and finished() <= before:
            time.sleep(0.05)
        os.killpg(server.process.pid, signal.SIGKILL)

    workload = make_twin_workload("poisson", VLLMTwinConfig(num_requests=40, rate=20.0), seed=3)
    killer = threading.Thread(target=kill_after_a_finish, args=(finished(),))
    killer.start()
    run = run_server_workload(server.url, server_requests(workload, 1000, seed=3), poll_s=0.05, read_timeout_s=5)
    killer.join()
    requests = run.requests
    assert not run.complete and run.problems
    assert requests["finish_s"].notna().any()  # requests done before the kill are kept
    assert requests["error"].str.len().gt(0).any()
    assert not math.isnan(run.wall_s) and run.wall_s < 30

"""The engine's CPU steps reuse the memory the last step freed (``lab/worker/host_memory.py``) instead of faulting
fresh pages in every step."""
import subprocess
import sys

import pytest

STEADY_PREFILL_FAULTS = r"""
import resource, sys
import lab.worker.host_memory as host_memory
host_memory.RETAIN = sys.argv[1] == "1"
from lab.engine import LLMEngine
from lab.engine.sampler import SamplingParams

engine = LLMEngine("tiny", block_size=32, num_blocks=300, max_num_batched_tokens=2048)
faults = []
for salt in range(8):  # each step prefills eight prompts of 256 tokens, then they finish
    for i in range(8):
        engine.add_request([(7 * j + 13 * i + salt) % 1000 for j in range(256)],
                           SamplingParams(max_tokens=2, ignore_eos=True))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    while engine.has_unfinished():
        engine.step()
print(host_memory.retain_freed_memory(), sorted(faults[2:])[len(faults[2:]) // 2])
"""


def _steady_faults(retain: bool) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", STEADY_PREFILL_FAULTS, "1" if retain else "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    applied, faults = done.stdout.split()[-2:]
    return applied, int(faults)


def test_prefill_steps_reuse_the_last_step_s_pages():
    """On glibc, prefill steps of 2,048 tokens after two alike fault in under a thousand pages, the median of six
    (with glibc's defaults, 5,000-13,000 were seen: about a third of the step's time). The median, not the worst:
    some steps fault 256 pages more, or twice or three times that, on a loaded machine most (1 MiB at a time, the
    size of CPython's object-allocator arenas), with the same retained memory as the others."""
    if not sys.platform.startswith("linux"):
        pytest.skip("page-fault counts and glibc's mallopt are Linux's")
    applied, faults = _steady_faults(retain=True)
    if applied != "True":
        pytest.skip("not glibc: the allocator's thresholds are left as they are")
    assert faults < 1000, f"{faults} page faults in the median steady prefill step"

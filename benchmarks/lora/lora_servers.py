"""Multi-LoRA serving: `tokenloom serve --enable-lora` against llama.cpp's `llama-server --lora`, same
adapters, same client, one server at a time, alternated (docs/lora.md).

The load is lora_throughput.py's W1 shape: --requests requests sent at t=0 (prompts of 64-512 random
token ids, seeded; --tokens output tokens each, greedy, ignore_eos), spread round-robin over four
random rank-8 PEFT adapters on every target and the base model (one request in five on the base).
Each engine also serves the same requests all on the base model from a server started without
adapters, so each engine's own LoRA cost ratio shows beside the cross-engine comparison:

* `tokenloom`: `tokenloom serve MODEL` (the defaults: a quantized GGUF stays quantized), with
  `--enable-lora --max-loras 4 --max-lora-rank R --lora-modules a1=DIR ...` in the LoRA runs; a
  request names its adapter in `model`.
* `llama.cpp`: `llama-server -m MODEL -t T -np N -c N*1024 --no-repack` (repack/AMX kernels die with
  SIGILL on the AMX Xeon), with `--lora a1.gguf ... --lora-init-without-apply` in the LoRA runs (the
  adapters converted by llama.cpp's convert_lora_to_gguf.py, f32); a request sets its adapter's scale
  in the per-request `lora` field (`[{"id": i, "scale": 1.0}]`, the others 0; the base: all 0).

The client (stdlib http.client, one thread per request: aiohttp could not talk to llama-server here,
see benchmarks/real_models/multi_stream.py) streams /v1/completions and takes every chunk's arrival
time; TTFT is the first chunk with text, ITL the gaps between text chunks, output tok/s the completion
tokens over the wall time of the whole load.

Before timing, a few greedy requests (a text prompt, --check-tokens tokens) go to each adapter and the
base on both LoRA servers, once with the timed adapters and once with four stronger ones (B's entries
--check-b-scale instead of 0.01, so every adapter changes the text: a conversion that dropped or
misplaced a delta would show); the script prints both engines' texts, whether they agree, and whether
each adapter's text differs from the base's.

    flock /tmp/tokenloom-bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/lora/lora_servers.py \\
        --llama-server ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-server \\
        --converter ~/.cache/tokenloom-anchors/src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_lora_to_gguf.py \\
        --hf-config ~/.cache/tokenloom-anchors/smollm2-hf --rounds 3 --json docs/figures/lora_servers.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.lora.lora_throughput import w1_prompts, write_adapter
from benchmarks.real_models.multi_stream import free_port, wait_ready
from tokenloom.workload.metrics import percentile as pct

NUM_ADAPTERS = 4
CHECK_PROMPT = "The three most important things to know about the ocean are"


def hf_shapes(hf_dir: Path) -> SimpleNamespace:
    """The fields write_adapter reads, from a Hugging Face config.json (the converter needs the same)."""
    c = json.loads((hf_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return SimpleNamespace(num_attention_heads=c["num_attention_heads"], head_dim=head_dim,
                           num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                           hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                           num_hidden_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"])


def convert_to_gguf(converter: Path, hf_dir: Path, adapter: Path) -> Path:
    out = adapter.with_suffix(".gguf")
    llama_cpp = converter.parent  # its `conversion` package and gguf-py sit beside it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama_cpp / "gguf-py"), str(llama_cpp)]))
    subprocess.run([sys.executable, str(converter), "--base", str(hf_dir), "--outtype", "f32", "--outfile", str(out),
                    str(adapter)], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


class Engine:
    """How to start one engine's server and name an adapter (0: the base, i >= 1: adapter i) in a body."""

    def __init__(self, name: str, args: argparse.Namespace, model: str, adapters: list[Path],
                 ggufs: list[Path]) -> None:
        self.name, self.args, self.model, self.adapters, self.ggufs = name, args, model, adapters, ggufs

    def command(self, port: int, with_lora: bool) -> list[str]:
        a = self.args
        if self.name == "tokenloom":
            cmd = [str(Path(sys.executable).parent / "tokenloom"), "serve", self.model, "--port", str(port),
                   "--served-model-name", "base"]
            if with_lora:
                cmd += ["--enable-lora", "--max-loras", str(NUM_ADAPTERS), "--max-lora-rank", str(a.rank),
                        "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(self.adapters, 1))]
            return cmd
        cmd = [a.llama_server, "-m", self.model, "-t", str(a.threads), "-np", str(a.requests),
               "-c", str(1024 * a.requests), "--port", str(port), "--no-repack", "-a", "base"]
        if with_lora:
            for g in self.ggufs:
                cmd += ["--lora", str(g)]
            cmd.append("--lora-init-without-apply")
        return cmd

    def body_fields(self, adapter: int) -> dict:
        if self.name == "tokenloom":
            return {"model": f"a{adapter}" if adapter else "base"}
        return {"model": "base", "lora": [{"id": i, "scale": 1.0 if i + 1 == adapter else 0.0}
                                          for i in range(len(self.ggufs))]}


def stream_one(port: int, body: dict) -> dict:
    """One streamed completion: arrival times (s, from the send) of the chunks with text, the text, and
    the completion tokens (the usage chunk's count when the server sends one)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times, text, usage = [], [], None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        obj = json.loads(line[5:])
        if obj.get("usage"):
            usage = obj["usage"].get("completion_tokens")
        choices = obj.get("choices") or []
        if choices and choices[0].get("text"):
            times.append(time.perf_counter() - t0)
            text.append(choices[0]["text"])
    conn.close()
    return {"times": times, "text": "".join(text), "tokens": usage if usage is not None else len(times)}


def run_load(port: int, bodies: list[dict]) -> dict:
    """All requests at once (one thread each); output tok/s over the wall time, TTFT / ITL percentiles."""
    records: list[dict | None] = [None] * len(bodies)
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            records[i] = stream_one(port, bodies[i])
        except Exception as exc:  # noqa: BLE001 - reported with the figures
            errors.append(repr(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in records if r is not None and r["times"]]
    if errors or len(ok) != len(bodies):
        raise RuntimeError(f"{len(bodies) - len(ok)} requests failed: {errors[:3]}")
    ttft = [r["times"][0] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False)]
    return {"out_tok_s": sum(r["tokens"] for r in ok) / wall, "wall_s": wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99)}


class Server:
    def __init__(self, cmd: list[str], port: int) -> None:
        self.cmd, self.port = cmd, port

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def check_outputs(engines: list[Engine], tokens: int, label: str) -> dict:
    """Greedy texts of the base and each adapter on both LoRA servers."""
    texts: dict[str, list[str]] = {}
    for eng in engines:
        port = free_port()
        with Server(eng.command(port, with_lora=True), port):
            texts[eng.name] = [stream_one(port, {"prompt": CHECK_PROMPT, "max_tokens": tokens, "temperature": 0.0,
                                                 **eng.body_fields(k)})["text"] for k in range(NUM_ADAPTERS + 1)]
    result = {"prompt": CHECK_PROMPT, "texts": texts}
    if len(engines) == 2:
        a, b = (texts[e.name] for e in engines)
        result["agree"] = [x == y for x, y in zip(a, b, strict=True)]
    result["adapter_differs_from_base"] = {
        name: [t != ts[0] for t in ts[1:]] for name, ts in texts.items()}
    for k in range(NUM_ADAPTERS + 1):
        who = f"a{k}" if k else "base"
        for name, ts in texts.items():
            print(f"check {label} {who:4s} {name:9s}: {ts[k]!r}", flush=True)
    print(f"check {label}: engines agree {result.get('agree')}, adapter differs from base "
          f"{result['adapter_differs_from_base']}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the shipped SmolLM2-135M Q4_1)")
    ap.add_argument("--hf-config", required=True, type=Path,
                    help="the base model's Hugging Face directory (config.json): the adapters' shapes, the converter")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (without it only tokenloom runs)")
    ap.add_argument("--converter", type=Path, default=None, help="llama.cpp's convert_lora_to_gguf.py")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t (tokenloom uses the machine's cores)")
    ap.add_argument("--check-tokens", type=int, default=24)
    ap.add_argument("--check-b-scale", type=float, default=0.05, help="B's spread in the stronger check adapters")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.llama_server and a.converter is None:
        ap.error("--llama-server needs --converter (the adapters are converted to GGUF for it)")
    from tokenloom.model.paths import resolve_model_path

    model = str(resolve_model_path(a.model))
    shapes = hf_shapes(a.hf_config)
    tmp = Path(tempfile.mkdtemp(prefix="tokenloom-lora-servers-"))
    adapters = [write_adapter(tmp / f"a{i}", shapes, a.rank, seed=i) for i in range(1, NUM_ADAPTERS + 1)]
    ggufs = [convert_to_gguf(a.converter, a.hf_config, p) for p in adapters] if a.llama_server else []
    engines = [Engine("tokenloom", a, model, adapters, ggufs)]
    if a.llama_server:
        engines.append(Engine("llama.cpp", a, model, adapters, ggufs))
    check = {"timed adapters": check_outputs(engines, a.check_tokens, "timed")}
    strong = [write_adapter(tmp / f"s{i}", shapes, a.rank, seed=100 + i, b_scale=a.check_b_scale)
              for i in range(1, NUM_ADAPTERS + 1)]
    strong_ggufs = [convert_to_gguf(a.converter, a.hf_config, p) for p in strong] if a.llama_server else []
    check["strong adapters"] = check_outputs([Engine(e.name, a, model, strong, strong_ggufs) for e in engines],
                                             a.check_tokens, "strong")

    prompts = w1_prompts(a.requests, shapes.vocab_size, seed=20251129)
    spread = [i % (NUM_ADAPTERS + 1) for i in range(a.requests)]  # adapters 1-4 then the base, round-robin
    spread = [k + 1 if k < NUM_ADAPTERS else 0 for k in spread]
    runs = [(eng, lora) for eng in engines for lora in (False, True)]
    results: dict[str, list[dict]] = {f"{eng.name} {'lora' if lora else 'base'}": [] for eng, lora in runs}
    for r in range(a.rounds):
        for eng, lora in runs if r % 2 == 0 else runs[::-1]:
            key = f"{eng.name} {'lora' if lora else 'base'}"
            bodies = [{"prompt": p["prompt_token_ids"], "max_tokens": a.tokens, "temperature": 0.0,
                       "ignore_eos": True, **eng.body_fields(k if lora else 0)} for p, k in zip(prompts, spread,
                                                                                                strict=True)]
            port = free_port()
            with Server(eng.command(port, with_lora=lora), port):
                warm = [dict(b, prompt=b["prompt"][::-1][:64], max_tokens=4) for b in bodies[:NUM_ADAPTERS + 1]]
                run_load(port, warm)  # first-use costs: kernels, the adapters' first load
                row = run_load(port, bodies)
            results[key].append(row)
            print(f"round {r} {key:14s}: {row['out_tok_s']:6.1f} out tok/s, TTFT p50 {row['ttft_p50_ms']:7.0f} "
                  f"p99 {row['ttft_p99_ms']:7.0f} ms, ITL p50 {row['itl_p50_ms']:6.1f} p99 {row['itl_p99_ms']:6.1f} ms",
                  flush=True)
    if not a.rounds:  # the output check alone
        return
    summary = {key: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for key, rows in results.items()}
    for eng in engines:
        ratios = [x["out_tok_s"] / y["out_tok_s"] for x, y in zip(results[f"{eng.name} lora"],
                                                                 results[f"{eng.name} base"], strict=True)]
        summary[f"{eng.name} lora/base"] = {"per_round": ratios, "median": statistics.median(ratios)}
    if a.llama_server:
        summary["lora tokenloom/llama.cpp"] = statistics.median(
            x["out_tok_s"] / y["out_tok_s"] for x, y in zip(results["tokenloom lora"], results["llama.cpp lora"],
                                                           strict=True))
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                     for k, v in vars(a).items()},
                                            "check": check, "rounds": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()

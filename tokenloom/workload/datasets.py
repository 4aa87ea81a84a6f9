"""Benchmark workloads: what to send, and when.

A workload is a list of `BenchRequest`. Three sources:

- `random_requests`: lengths drawn around `input_len` / `output_len` (vLLM's `--random-*` flags),
  prompts as random token ids from an ordinary-vocab range (exact lengths) or as words (lengths
  estimated).
- `load_sharegpt`: first human turn as the prompt, first assistant turn's length as max_tokens.
- `load_jsonl`: one request per line (`id, arrival_s, prompt_token_ids, max_tokens, ignore_eos`), so a
  frozen workload (`--save-workload`, benchmarks/scheduler/mixed_workload.py) is replayed exactly, arrival times
  included.

Arrival times are a separate step (`assign_arrivals`), so any workload can be replayed at any rate.
Everything is deterministic for a given seed (numpy's PCG64 via `default_rng`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np

# SmolLM2's ids 0..16 are special tokens (<|endoftext|>, <|im_start|>, ...); keep random prompts out of
# them so a random prompt never contains an accidental end-of-text. Same range as the JSONL workloads of benchmarks/.
DEFAULT_VOCAB_RANGE = (17, 49151)
# Rough English BPE ratio, used only when no tokenizer is given and the server does not report usage.
CHARS_PER_TOKEN = 4.0
SAMPLE_SHAREGPT = "sharegpt_sample.json"

Tokenize = Callable[[str], list[int]]


@dataclass
class BenchRequest:
    id: str
    prompt: str | list[int]  # text, or token ids sent as-is in `prompt`
    prompt_len: int  # exact for token ids / with a tokenizer, else an estimate
    max_tokens: int
    ignore_eos: bool = False
    arrival_s: float = 0.0  # offset from the benchmark start
    priority: int = 0  # for --scheduling-policy priority (lower first, as vLLM)


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


# ---------------------------------------------------------------------------------------------- random


def sample_lengths(rng: np.random.Generator, n: int, mean_len: int, range_ratio: float) -> list[int]:
    """Uniform integers in [mean*(1-r), mean*(1+r)], at least 1 (vLLM >= 0.10 semantics)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(mean_len * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "can",
    "has",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "token",
    "batch",
    "cache",
    "memory",
    "request",
    "server",
    "latency",
    "schedule",
    "budget",
    "prefill",
    "decode",
    "stream",
    "river",
    "mountain",
    "garden",
    "window",
    "kitchen",
    "yellow",
    "quiet",
    "music",
    "paper",
    "number",
    "little",
    "people",
    "because",
    "between",
    "another",
    "question",
    "system",
    "program",
    "project",
    "market",
    "history",
    "science",
    "energy",
    "language",
]


def random_requests(
    num: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    *,
    prefix_len: int = 0,
    seed: int = 0,
    vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
    as_text: bool = False,
    ignore_eos: bool = True,
) -> list[BenchRequest]:
    """`num` requests of random prompts; `prefix_len` tokens shared by all (for prefix caching)."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num, input_len, range_ratio)
    out_lens = sample_lengths(rng, num, output_len, range_ratio)
    lo, hi = vocab_range
    if as_text:
        # ~one token per common word; an estimate, which usage.prompt_tokens corrects later
        pick = lambda n: " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n))
        prefix_text = pick(prefix_len) + " " if prefix_len else ""
        return [
            BenchRequest(f"random-{i}", prefix_text + pick(n), prefix_len + n, o, ignore_eos)
            for i, (n, o) in enumerate(zip(in_lens, out_lens))
        ]
    prefix = [int(t) for t in rng.integers(lo, hi + 1, size=prefix_len)]
    return [
        BenchRequest(
            f"random-{i}",
            prefix + [int(t) for t in rng.integers(lo, hi + 1, size=n)],
            prefix_len + n,
            o,
            ignore_eos,
        )
        for i, (n, o) in enumerate(zip(in_lens, out_lens))
    ]


# -------------------------------------------------------------------------------------------- sharegpt


def read_sharegpt(path: str | Path | None = None) -> list[dict]:
    """The conversations of a ShareGPT JSON file, or of the sample shipped with tokenloom."""
    if path is None:
        # tokenloom/data is plain package data (no __init__), so resolve it from the parent package
        text = resources.files("tokenloom").joinpath("data", SAMPLE_SHAREGPT).read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{path or SAMPLE_SHAREGPT}: expected a JSON list of conversations")
    return data


def _first_exchange(conv: dict) -> tuple[str, str] | None:
    turns = conv.get("conversations") or conv.get("conversation") or []
    if len(turns) < 2:
        return None
    human, gpt = turns[0], turns[1]
    if human.get("from") not in ("human", "user") or gpt.get("from") not in ("gpt", "assistant", "chatgpt"):
        return None
    return str(human.get("value", "")), str(gpt.get("value", ""))


def load_sharegpt(
    path: str | Path | None = None,
    num: int | None = None,
    *,
    seed: int = 0,
    output_len: int | None = None,
    tokenize: Tokenize | None = None,
    send_token_ids: bool = False,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    ignore_eos: bool = False,
) -> list[BenchRequest]:
    """vLLM's ShareGPT sampling: shuffle with `seed`, keep first exchanges within the length limits.

    max_tokens is the assistant turn's length unless `output_len` fixes it. Lengths come from
    `tokenize` when given, else from a characters-per-token estimate. When `num` exceeds the usable
    conversations they are reused in a seeded order (vLLM oversamples the same way), ids stay unique.
    """
    if send_token_ids and tokenize is None:
        raise ValueError("sending ShareGPT prompts as token ids needs a tokenizer")
    count: Callable[[str], int] = (lambda s: len(tokenize(s))) if tokenize else estimate_tokens
    rng = np.random.default_rng(seed)
    convs = read_sharegpt(path)
    order = rng.permutation(len(convs))
    usable: list[BenchRequest] = []
    for idx in order:
        pair = _first_exchange(convs[int(idx)])
        if pair is None:
            continue
        prompt, completion = pair
        p_len = count(prompt)
        o_len = output_len if output_len is not None else count(completion)
        if p_len < min_len or o_len < min_len or p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        conv_id = str(convs[int(idx)].get("id", idx))
        body: str | list[int] = tokenize(prompt) if send_token_ids and tokenize else prompt
        usable.append(BenchRequest(conv_id, body, p_len, o_len, ignore_eos))
    if not usable:
        raise ValueError(f"{path or SAMPLE_SHAREGPT}: no conversation passed the length filters")
    if num is None or num <= len(usable):
        chosen = usable[: num if num is not None else len(usable)]
    else:
        extra = rng.choice(len(usable), size=num - len(usable), replace=True)
        chosen = usable + [usable[int(i)] for i in extra]
    return [replace(r, id=f"sharegpt-{i}-{r.id}") for i, r in enumerate(chosen)]


# ----------------------------------------------------------------------------------------------- jsonl


def load_jsonl(path: str | Path, num: int | None = None) -> list[BenchRequest]:
    """The JSONL workload format, one request per line; `prompt` (text) is accepted too."""
    out: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "prompt_token_ids" in obj:
                prompt: str | list[int] = [int(t) for t in obj["prompt_token_ids"]]
                p_len = len(prompt)
            elif "prompt" in obj:
                prompt = str(obj["prompt"])
                p_len = int(obj.get("prompt_len") or estimate_tokens(prompt))
            else:
                raise ValueError(f"{path}:{lineno}: needs prompt_token_ids or prompt")
            out.append(
                BenchRequest(
                    id=str(obj.get("id", f"req-{len(out)}")),
                    prompt=prompt,
                    prompt_len=p_len,
                    max_tokens=int(obj["max_tokens"]),
                    ignore_eos=bool(obj.get("ignore_eos", False)),
                    arrival_s=float(obj.get("arrival_s", 0.0)),
                )
            )
            if num is not None and len(out) >= num:
                break
    return out


def write_jsonl(requests: Iterable[BenchRequest], path: str | Path) -> None:
    """Inverse of `load_jsonl` (token-id prompts, the same keys), to freeze a workload."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict = {"id": r.id, "arrival_s": round(r.arrival_s, 6)}
            if isinstance(r.prompt, list):
                obj["prompt_token_ids"] = r.prompt
            else:
                obj["prompt"] = r.prompt
                obj["prompt_len"] = r.prompt_len
            obj.update(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")


# -------------------------------------------------------------------------------------------- arrivals


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets of n arrivals: the first at 0, then gamma-distributed gaps.

    Like vLLM: shape = burstiness, scale = 1 / (rate * burstiness), so the mean gap is always 1/rate;
    burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular. rate inf: all at 0.
    """
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


def assign_arrivals(
    requests: list[BenchRequest], request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[BenchRequest]:
    times = arrival_times(len(requests), request_rate, burstiness, seed)
    return [replace(r, arrival_s=t) for r, t in zip(requests, times)]

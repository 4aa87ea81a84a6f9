"""`tokenloom bench serve` and `tokenloom plot timeline|bench`.

`register(subparsers)` adds the `bench` and `plot` groups. Further `bench` sub-commands (the lead's
`bench sweep`) plug in without editing this file: any module listed in `BENCH_EXTENSIONS` that exists
gets `register(bench_subparsers)` called, the same way tokenloom/cli.py loads each room.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from typing import Any

from tokenloom import envs
from tokenloom.workload.options import add_arrival_args, add_dataset_args

BENCH_EXTENSIONS = ["tokenloom.bench.throughput", "tokenloom.bench.sweep"]
# literal copies of client.py's constants: importing client would pull aiohttp into every `tokenloom` run
COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    add_serve_parser(bench_sub)
    for module_name in BENCH_EXTENSIONS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        module.register(bench_sub)
    bench.set_defaults(func=lambda args: _missing(bench))
    plot = subparsers.add_parser("plot", help="draw step traces and benchmark results")
    plot_sub = plot.add_subparsers(dest="plot_command", metavar="PLOT_COMMAND")
    add_plot_parsers(plot_sub)
    plot.set_defaults(func=lambda args: _missing(plot))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, but not the uninformative None/False ones."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.help is None:
            return action.help or ""
        return super()._get_help_string(action)


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# ----------------------------------------------------------------------------------------- bench serve


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="measure TTFT/TPOT/ITL/E2E and throughput of a serving endpoint (like `vllm bench serve`)",
        description="Stream a workload at a server and report latency percentiles and throughput.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root")
    g.add_argument("--model", default=None, help="model name; default: the first one /v1/models lists")
    g.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT_COMPLETIONS], help="API")
    g.add_argument("--api-key", default=envs.OPENAI_API_KEY, help="Authorization: Bearer KEY")
    g.add_argument("--request-timeout", type=float, default=600.0, help="hard limit per request, seconds")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    g = p.add_argument_group("workload")
    add_dataset_args(g)
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (random: always)")
    g.add_argument(
        "--random-prompt-format",
        choices=["token-ids", "text"],
        default="token-ids",
        help="text: common words, lengths estimated",
    )
    g.add_argument("--save-workload", default=None, help="write the workload (with arrivals) as jsonl")

    g = p.add_argument_group("load")
    add_arrival_args(g)
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")

    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs: ttft, tpot, e2el")
    g.add_argument(
        "--metric-percentiles",
        default="50,90,95,99",
        help="comma-separated percentiles to report",
    )
    g.add_argument("--result-file", default=None, help="write config, aggregates and per-request records")
    g.add_argument("--label", default=None, help="name for this run in the result file and plots")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench_serve)
    return p


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id the server lists, so `--model` can be omitted against a one-model server."""
    import httpx

    from tokenloom.bench.client import endpoint_url

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(endpoint_url(base_url, "/v1/models"), headers=headers, timeout=10.0)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"no --model given and {base_url}/v1/models did not name one ({exc})") from None


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tokenloom.bench.client import run_benchmark
    from tokenloom.workload import datasets as workloads
    from tokenloom.workload.build import workload_from_args
    from tokenloom.workload.metrics import format_summary, parse_goodput

    requests = workload_from_args(args)
    rate = args.request_rate
    if rate is None and args.dataset_name != "jsonl":
        rate = math.inf
    if args.save_workload:
        # the same arrivals run_benchmark will draw, so the file replays this run exactly
        if rate is not None:
            requests = workloads.assign_arrivals(requests, rate, args.burstiness, args.seed)
            rate = None
        workloads.write_jsonl(requests, args.save_workload)
    model = args.model or discover_model(args.base_url, args.api_key)
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    result = run_benchmark(
        args.base_url,
        model,
        requests,
        request_rate=rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        endpoint=args.endpoint,
        api_key=args.api_key,
        seed=args.seed,
        disable_tqdm=args.disable_tqdm,
        request_timeout_s=args.request_timeout,
        extra_body=json.loads(args.extra_body) if args.extra_body else None,
        goodput=parse_goodput(args.goodput),
        percentiles=percentiles,
        num_warmups=args.num_warmups,
        label=args.label,
    )
    result.config["dataset_name"] = args.dataset_name
    result.config["dataset_path"] = args.dataset_path
    print(format_summary(result.metrics, result.config))
    failed = [r for r in result.records if not r.success]
    for rec in failed[:5]:
        print(f"failed {rec.id}: {rec.error}", file=sys.stderr)
    if args.result_file:
        result.save(args.result_file)
        print(f"wrote {args.result_file}")
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------ plots


def add_plot_parsers(sub: Any) -> None:
    t = sub.add_parser(
        "timeline",
        help="draw an engine step trace: tokens per step per request, KV blocks, queues",
        description="Draw a step trace (JSONL, one step per line) as PNG or a self-contained HTML file.",
    )
    t.add_argument("trace", help="step trace JSONL written by the engine or the simulator")
    t.add_argument("-o", "--output", required=True, help="FILE.png or FILE.html (also .svg/.pdf)")
    t.add_argument("--steps", default=None, metavar="A:B", help="only steps A <= step < B")
    t.add_argument(
        "--mode",
        choices=["auto", "requests", "aggregate"],
        default="auto",
        help="one block per request, or prefill/decode totals (auto: by how many requests are in view)",
    )
    t.add_argument("--max-requests", type=int, default=40, help="auto mode aggregates above this many")
    t.add_argument("--title", default=None)
    t.set_defaults(func=cmd_plot_timeline)

    b = sub.add_parser(
        "bench",
        help="compare benchmark result files: latency CDFs and throughput",
        description="Latency CDFs (TTFT, ITL, E2E) per result file and a throughput bar chart.",
    )
    b.add_argument("results", nargs="+", help="result JSON files (tokenloom bench serve or vLLM)")
    b.add_argument("-o", "--output", required=True, help="FILE.png or FILE.html")
    b.add_argument("--labels", nargs="+", default=None, help="one per file (default: file names)")
    b.add_argument("--title", default=None)
    b.set_defaults(func=cmd_plot_bench)


def cmd_plot_timeline(args: argparse.Namespace) -> int:
    from tokenloom.bench import plots

    out = plots.plot_timeline(
        args.trace,
        args.output,
        steps=plots.parse_steps(args.steps),
        mode=args.mode,
        max_requests=args.max_requests,
        title=args.title,
    )
    print(f"wrote {out}")
    return 0


def cmd_plot_bench(args: argparse.Namespace) -> int:
    from tokenloom.bench import plots

    out = plots.plot_bench(args.results, args.output, labels=args.labels, title=args.title)
    print(f"wrote {out}")
    return 0

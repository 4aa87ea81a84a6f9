"""Re-run the figures under docs/figures/ from their manifest (benchmarks/figures/manifest.toml).

    make figures-quick                       # every figure's quick form, into /tmp/tokenloom-figures-quick
    make figure FIGURE=quant_quality.json    # one figure's full run, over docs/figures/
    .venv/bin/python benchmarks/figures/rerun.py --list
    .venv/bin/python benchmarks/figures/rerun.py --quick --only kv_int8_kernel.json --out /tmp/f
    .venv/bin/python benchmarks/figures/rerun.py --check-flags     # every flag a command passes exists

The manifest names, per figure, the doc that cites it, the bash commands that wrote it (`run`) and a
scaled-down form (`quick`) that checks the pipeline still runs and writes a well-formed file in a couple
of minutes; its numbers mean nothing. A full run overwrites the file in docs/figures/ — compare it with
git and read the doc's conditions (most figures were taken on a quiet machine, alternated, under the
bench lock) before committing it. An entry whose `needs` (llama.cpp, vLLM's CPU build, the anchors'
files, the real models, MiniLM, Gemma, root for `chrt`) are missing here is skipped and reported.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).with_name("manifest.toml")
FIGURES = ROOT / "docs" / "figures"
NEEDS = ("llama.cpp", "llama.cpp-avx2", "vllm", "anchors", "real-models", "minilm", "gemma", "root")


@dataclass(frozen=True)
class Figure:
    files: tuple[str, ...]
    doc: str
    run: str
    quick: str | None = None
    needs: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return self.files[0]


def load_manifest(path: Path = MANIFEST) -> list[Figure]:
    with path.open("rb") as f:
        data = tomllib.load(f)
    figures = []
    for i, entry in enumerate(data.get("figure", [])):
        unknown = set(entry) - {"files", "doc", "run", "quick", "needs"}
        if unknown or not entry.get("files") or not entry.get("run") or not entry.get("doc"):
            raise ValueError(f"{path.name}: figure #{i + 1} needs files, doc and run (unknown keys: {sorted(unknown)})")
        bad = set(entry.get("needs", ())) - set(NEEDS)
        if bad:
            raise ValueError(f"{path.name}: figure {entry['files'][0]}: unknown needs {sorted(bad)} (known: {NEEDS})")
        figures.append(Figure(tuple(entry["files"]), entry["doc"], entry["run"].strip(),
                              entry["quick"].strip() if entry.get("quick") else None, tuple(entry.get("needs", ()))))
    return figures


def _real_model(name: str) -> Path | None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.real_models.real_models import model_path

    path = model_path(name)
    return path if path.is_file() else None


def environment(llama_bin: Path | None) -> tuple[dict[str, str], dict[str, str]]:
    """The variables the manifest's commands use, and for each `needs` entry why it is missing ("" = present)."""
    from tokenloom import envs

    anchors = Path(envs.TOKENLOOM_ANCHORS_DIR)
    lb = llama_bin or anchors / "llamacpp-build" / "bin"
    qwen05, qwen15 = _real_model("qwen2.5-coder-0.5b"), _real_model("qwen2.5-coder-1.5b")
    env = dict(os.environ, PY=sys.executable, PYTHONPATH=str(ROOT), LB=str(lb), ANCHORS=str(anchors),
               ANCHORS_SCRIPTS=str(envs.TOKENLOOM_ANCHORS_SCRIPTS), QWEN05=str(qwen05 or ""), QWEN15=str(qwen15 or ""))
    try:
        from tokenloom.model.paths import minilm_model_path

        minilm = "" if minilm_model_path().is_dir() else "MiniLM not unpacked"
    except (FileNotFoundError, ImportError) as e:
        minilm = str(e)
    missing = {
        "llama.cpp": "" if (lb / "llama-bench").is_file() or (lb / "llama-server").is_file()
        else f"no llama.cpp binaries in {lb} (--llama-bin, or ../shared/anchors/setup_llamacpp.sh)",
        "llama.cpp-avx2": "" if (anchors / "llamacpp-avx2" / "bin" / "llama-bench").is_file()
        else f"no AVX2-only llama.cpp in {anchors / 'llamacpp-avx2'} (benchmarks/real_models/setup_llamacpp_avx2.sh)",
        "vllm": "" if Path(envs.TOKENLOOM_VLLM_PYTHON).is_file() else f"no vLLM python at {envs.TOKENLOOM_VLLM_PYTHON}",
        "anchors": "" if (anchors / "workloads").is_dir() and Path(envs.TOKENLOOM_ANCHORS_SCRIPTS).is_dir()
        else f"no anchors' workloads in {anchors} or scripts in {envs.TOKENLOOM_ANCHORS_SCRIPTS}",
        "real-models": "" if qwen05 and qwen15 else "the Qwen2.5-Coder GGUFs are missing: make bench-models",
        "minilm": minilm,
        "gemma": "",  # family_throughput.py fetches or reports it itself (`make bench-setup`)
        "root": "" if os.geteuid() == 0 else "chrt -f needs root",
    }
    return env, missing


def _written(fig: Figure, out: Path, since: float) -> list[str]:
    """The files of `fig` that this run did not (re)write, or wrote unreadable."""
    bad = []
    for name in fig.files:
        path = out / name
        if not path.is_file() or path.stat().st_mtime < since or path.stat().st_size == 0:
            bad.append(f"{name}: not written")
        elif path.suffix == ".json":
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except ValueError as e:
                bad.append(f"{name}: not JSON ({e})")
    return bad


def run_figures(figures: Iterable[Figure], *, quick: bool, out: Path, env: dict[str, str],
                missing: dict[str, str], timeout_s: float) -> int:
    failures = 0
    out.mkdir(parents=True, exist_ok=True)
    for fig in figures:
        script = fig.quick if quick else fig.run
        lacking = [f"{n}: {missing[n]}" for n in fig.needs if missing.get(n)]
        if script is None or lacking:
            why = "no quick form" if script is None else "; ".join(lacking)
            print(f"skip  {fig.name}: {why}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="tokenloom-figure-") as tmp:
            start = time.time()
            print(f"run   {fig.name} ({fig.doc})", flush=True)
            try:
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, timeout=timeout_s,
                                      env=dict(env, OUT=str(out), TMP=tmp), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                rc, log = proc.returncode, proc.stdout
            except subprocess.TimeoutExpired as e:
                rc, log = -1, f"timed out after {timeout_s:.0f} s\n{e.stdout or ''}"
            bad = [f"exit status {rc}"] if rc != 0 else _written(fig, out, start)
            if bad:
                failures += 1
                tail = "\n".join(str(log).splitlines()[-15:])
                print(f"FAIL  {fig.name}: {'; '.join(bad)}\n{tail}", flush=True)
            else:
                print(f"ok    {fig.name}: {', '.join(fig.files)} in {time.time() - start:.0f} s", flush=True)
    return failures


_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*")


def command_flags(script: str) -> list[tuple[str, list[str]]]:
    """(benchmarks/<area>/<x>.py or "tokenloom <subcommand>", the --flags passed to it) for every benchmark
    script or product command a bash snippet runs;
    everything after a bare `--` belongs to another program (serve_ab.py passes it on)."""
    found = []
    for line in script.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        for i, w in enumerate(words):
            program = None
            if re.fullmatch(r"benchmarks/[a-z_]+/[a-z_]+\.py", w):
                program, rest = w, words[i + 1:]
            elif w == "-m" and words[i + 1:i + 2] == ["tokenloom"]:  # a product command: tokenloom bench sweep
                sub = list(itertools.takewhile(lambda x: re.fullmatch(r"[a-z]+", x), words[i + 2:i + 4]))
                program, rest = " ".join(["tokenloom", *sub]), words[i + 2 + len(sub):]
            if program is not None:
                flags = []
                for arg in rest:
                    if arg == "--" or arg in {"&", "&&", "|", ";"}:
                        break
                    m = _FLAG.match(arg)
                    if m:
                        flags.append(m.group(0))
                found.append((program, flags))
    return found


# Runs in one child interpreter: each script's `--help` (and each subcommand's) by runpy, so torch and tokenloom
# are imported once for all of them instead of once per script (38 scripts: ~13 s of start-ups on 2 cores).
# A script that fails this way (it needs to be __main__ of a fresh process) is left out and run on its own.
_HELP_IN_ONE_PROCESS = r"""
import contextlib, io, json, re, runpy, sys
def run(argv):
    out = io.StringIO()
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = list(argv)
    try:
        with contextlib.redirect_stdout(out):
            try:
                if argv[0] == "tokenloom":
                    runpy.run_module("tokenloom", run_name="__main__", alter_sys=True)
                else:
                    sys.path.insert(0, argv[0].rsplit("/", 1)[0])
                    runpy.run_path(argv[0], run_name="__main__")
            except SystemExit:
                pass
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return out.getvalue()
texts = {}
for path in sys.argv[1:]:
    try:
        text = run([*path.split(), "--help"])
        for sub in re.findall(r"\{([a-z,-]+)\}", text.split("\n\n")[0])[:1]:
            for name in sub.split(","):
                text += run([*path.split(), name, "--help"])
        texts[path] = text
    except BaseException:
        texts[path] = None
sys.__stdout__.write("\n@@HELP@@" + json.dumps(texts))
"""


def _help_texts(paths: Sequence[str]) -> dict[str, str]:
    """Each benchmark script's --help text (with its subcommands' options), by the script's path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _HELP_IN_ONE_PROCESS, *paths], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    marker = proc.stdout.rfind("\n@@HELP@@")
    texts: dict[str, str | None] = json.loads(proc.stdout[marker + 9:]) if marker >= 0 else {}
    for path in paths:
        if texts.get(path) is None:  # on its own, as a user runs it
            command = ["-m", *path.split()] if path.startswith("tokenloom") else [path]
            text = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=300, env=env).stdout
            for sub in re.findall(r"\{([a-z,-]+)\}", text.split("\n\n")[0])[:1]:
                for name in sub.split(","):
                    text += subprocess.run([sys.executable, path, name, "--help"], cwd=ROOT, capture_output=True,
                                           text=True, timeout=300, env=env).stdout
            texts[path] = text
    return {path: texts[path] or "" for path in paths}


def unknown_flags(figures: Sequence[Figure]) -> list[str]:
    """Flags the manifest passes to a benchmark script that its --help does not list (a renamed option)."""
    wanted: dict[str, set[str]] = {}
    for fig in figures:
        for script in (fig.run, fig.quick or ""):
            for path, flags in command_flags(script):
                wanted.setdefault(path, set()).update(flags)

    helps = _help_texts(sorted(wanted))
    problems = []
    for path, flags in sorted(wanted.items()):
        if not helps[path].strip():
            problems.append(f"{path}: --help printed nothing")
            continue
        listed = set(re.findall(r"--[a-z0-9][a-z0-9-]*", helps[path]))
        problems += [f"{path}: {flag}" for flag in sorted(flags - listed)]
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the scaled-down forms (a pipeline check)")
    ap.add_argument("--only", nargs="+", metavar="FILE", help="figures by one of their file names")
    ap.add_argument("--out", type=Path, default=None,
                    help="where the files go (default: docs/figures, or /tmp/tokenloom-figures-quick with --quick)")
    ap.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's bin/ (default: the anchors' build)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per figure")
    ap.add_argument("--list", action="store_true", help="list the figures, what they need and whether it is here")
    ap.add_argument("--check-flags", action="store_true", help="check every flag the manifest passes exists")
    args = ap.parse_args(argv)
    figures = load_manifest()
    if args.only:
        by_file = {name: fig for fig in figures for name in fig.files}
        unknown = [name for name in args.only if name not in by_file]
        if unknown:
            raise SystemExit(f"not in {MANIFEST.name}: {unknown} (see --list)")
        figures = list(dict.fromkeys(by_file[name] for name in args.only))
    if args.check_flags:
        problems = unknown_flags(figures)
        print("\n".join(problems) or f"every flag of {len(figures)} figures exists")
        return 1 if problems else 0
    env, missing = environment(args.llama_bin)
    if args.list:
        for fig in figures:
            lacking = [n for n in fig.needs if missing.get(n)]
            state = f"missing {', '.join(lacking)}" if lacking else "ready"
            print(f"{fig.name:48} {'quick' if fig.quick else '     '}  {fig.doc:30} {state}")
        return 0
    out = args.out or (Path(tempfile.gettempdir()) / "tokenloom-figures-quick" if args.quick else FIGURES)
    failures = run_figures(figures, quick=args.quick, out=out.resolve(), env=env, missing=missing,
                           timeout_s=args.timeout)
    print(f"{failures} failed" if failures else "all figures run ran", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

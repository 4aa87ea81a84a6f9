"""Run vLLM's own OpenAI-entrypoint tests against `tokenloom serve` (the peer suite).

    python benchmarks/vllm_peer/run.py --vllm-tests /path/to/vllm/tests \
        entrypoints/openai/chat_completion/test_chat_echo.py ... [-o docs/figures/vllm_peer.md]

It copies the named test files from a vLLM checkout into a scratch tree whose `tests/utils.py` is
`remote_server.RemoteOpenAIServer` (tokenloom instead of `vllm serve`), runs pytest there (vLLM's
assertions untouched), and writes a pass/fail table per file. vLLM's conftest files are not copied
(they set up vLLM's own machinery), except those named with `--support` (copied, not run as tests): a test
directory's conftest.py whose fixtures and helpers the tests import, e.g.
entrypoints/openai/responses/conftest.py (its server fixture goes through the stand-in too). Needs
pytest-asyncio (`pip install -e '.[peer]'`). Slow: every test module starts a server; not part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UTILS = '''"""tests.utils for vLLM's tests, run against tokenloom: only RemoteOpenAIServer is provided."""
from benchmarks.vllm_peer.remote_server import RemoteOpenAIServer  # noqa: F401
'''


def build_tree(vllm_tests: Path, files: list[str], dest: Path, support: list[str] = ()) -> list[Path]:
    """Copy `files` (returned: the tests to run) and `support` (copied only) into dest/tests."""
    (dest / "tests").mkdir(parents=True)
    (dest / "tests" / "__init__.py").write_text("")
    (dest / "tests" / "utils.py").write_text(UTILS)
    copied = []
    for rel in [*support, *files]:
        src = vllm_tests / rel
        target = dest / "tests" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        for parent in target.relative_to(dest).parents:
            init = dest / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
        shutil.copy(src, target)
        if rel in files:
            copied.append(target)
    return copied


def run(dest: Path, copied: list[Path], junit: Path, timeout: int) -> int:
    env = os.environ.copy()
    paths = [str(dest), str(REPO), env.get("PYTHONPATH", "")]
    try:
        import vllm  # noqa: F401
    except ImportError:  # the few vLLM names the tests import for plumbing (model vocabulary)
        paths.insert(1, str(HERE / "vllm_stub"))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
           "--continue-on-collection-errors",
           f"--timeout={timeout}", "-q", "--rootdir", str(dest), f"--junitxml={junit}",
           *[str(p) for p in copied]]
    return subprocess.call(cmd, cwd=dest, env=env)


def table(junit: Path, dest: Path) -> str:
    per_file: dict[str, Counter] = {}
    failures: list[tuple[str, str, str]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname") or case.get("name", "")  # a collection error has no classname
        name = module.replace(".", "/").removeprefix("tests/") + ".py"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "failed" if tag in ("failure", "error") else "skipped"
                if outcome == "failed":
                    msg = (el.get("message") or "").splitlines()[0][:160] if el.get("message") else tag
                    failures.append((name, case.get("name", ""), msg))
                break
        per_file.setdefault(name, Counter())[outcome] += 1
    lines = ["| file | passed | failed | skipped |", "|---|---:|---:|---:|"]
    for name, c in sorted(per_file.items()):
        lines.append(f"| `{name}` | {c['passed']} | {c['failed']} | {c['skipped']} |")
    total = sum(per_file.values(), Counter())
    lines.append(f"| **total** | {total['passed']} | {total['failed']} | {total['skipped']} |")
    if failures:
        lines += ["", "| failing test | first line of the failure |", "|---|---|"]
        lines += [f"| `{f}::{t}` | {m.replace('|', '/')} |" for f, t, m in failures]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-tests", type=Path, required=True, help="the tests/ directory of a vLLM checkout")
    p.add_argument("files", nargs="+", help="test files relative to --vllm-tests")
    p.add_argument("--support", action="append", default=[],
                   help="a file relative to --vllm-tests copied but not run (a conftest.py the tests import); "
                        "repeatable")
    p.add_argument("-o", "--output", type=Path, help="write the markdown table here too")
    p.add_argument("--keep", type=Path, help="build the scratch tree here (kept) instead of a temp dir")
    p.add_argument("--timeout", type=int, default=300, help="per-test timeout, seconds")
    args = p.parse_args()
    dest = args.keep or Path(tempfile.mkdtemp(prefix="vllm-peer-"))
    if dest.exists() and args.keep:
        shutil.rmtree(dest)
    copied = build_tree(args.vllm_tests.resolve(), args.files, dest, args.support)
    junit = dest / "junit.xml"
    os.environ.setdefault("TOKENLOOM_PEER_LOGS", str(dest))
    rc = run(dest, copied, junit, args.timeout)
    text = table(junit, dest)
    print(text)
    if args.output:
        args.output.write_text(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

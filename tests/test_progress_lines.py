"""Long runs say how far they are when nobody watches a terminal (issue 32 item 9): `bench throughput`,
`bench sweep`, `bench serve`, `simulate` print progress lines to stderr (tokenloom/workload/progress.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import tokenloom.workload.progress as progress_mod
from tokenloom.cli import main as cli_main
from tokenloom.workload.progress import Progress


def _ticking(step_s: float):
    t = [0.0]

    def clock() -> float:
        t[0] += step_s
        return t[0]

    return clock


def test_a_line_every_interval_and_one_at_the_end() -> None:
    out = io.StringIO()
    p = Progress("bench throughput continuous", 128, every_s=10.0, stream=out, clock=_ticking(3.0))
    for i in range(1, 129):
        p.update(done=i, tokens=4 * i)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) > 10  # 128 updates, 3 s apart: one line per 10 s
    assert lines[0].startswith("bench throughput continuous: ") and "requests done" in lines[0]
    assert lines[-1].startswith("bench throughput continuous: 128/128 requests done, 512 output tokens, ")


def test_a_short_run_stays_quiet() -> None:
    out = io.StringIO()
    with Progress("x", 3, every_s=10.0, stream=out, clock=_ticking(0.1)) as p:
        for _ in range(3):
            p.update()
    assert out.getvalue() == ""


def test_simulate_prints_progress_lines(tmp_path: Path, capsys, monkeypatch) -> None:
    """Before: silence until the summary, however long the run."""
    from tests.test_sim import _shipped_or_synthetic_profile

    monkeypatch.setattr(progress_mod, "PROGRESS_EVERY_S", 0.0)  # a line per step
    rc = cli_main(["simulate", "--profile", _shipped_or_synthetic_profile(tmp_path), "--workload", "random",
                   "--num-prompts", "12", "--random-input-len", "50", "--random-output-len", "8",
                   "--request-rate", "inf"])
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    lines = [ln for ln in err if ln.startswith("simulate: ")]
    assert lines and lines[-1].startswith("simulate: 12/12 requests done, 96 output tokens")


def test_bench_throughput_prints_progress_lines(tmp_path: Path, capsys, monkeypatch) -> None:
    tiny_models = pytest.importorskip("tests.tiny_models")
    model_dir = tiny_models.make_tiny_hf_model(tmp_path, "llama")
    dataset = tmp_path / "six.jsonl"  # token ids inside the tiny vocabulary (random prompts are not)
    dataset.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [5 + i] * (8 + i), "max_tokens": 4})
                               + "\n" for i in range(6)))
    monkeypatch.setattr(progress_mod, "PROGRESS_EVERY_S", 0.0)
    rc = cli_main(["bench", "throughput", str(model_dir), "--dtype", "float32", "--dataset-path", str(dataset),
                   "--output-len", "4", "--modes", "continuous,static"])
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    assert any(ln.startswith("bench throughput: loading ") for ln in err)
    for mode in ("continuous", "static"):
        lines = [ln for ln in err if ln.startswith(f"bench throughput [1/1] {mode}: ")]
        assert lines and lines[-1].startswith(f"bench throughput [1/1] {mode}: 6/6 requests done, 24 output tokens")


def test_bench_serve_prints_lines_when_stderr_is_not_a_terminal(monkeypatch) -> None:
    from tqdm import tqdm

    from tokenloom.bench.client import progress_bar

    monkeypatch.setattr("sys.stderr", io.StringIO())  # a log file
    assert isinstance(progress_bar(10), Progress)

    class _Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", _Terminal())
    bar = progress_bar(10)
    assert isinstance(bar, tqdm)
    bar.close()
    assert not isinstance(progress_bar(10, disable=True), Progress)  # --disable-tqdm: silent


def test_profile_says_when_it_waits_for_a_busy_cpu(monkeypatch) -> None:
    """Before: up to --max-wait (120 s) of silence before each shape on a busy machine."""
    import tokenloom.sim.quiet as quiet
    from tokenloom.sim.profiler import _busy_note

    monkeypatch.setattr(quiet, "others_busy", lambda interval=0.3: 0.9)
    lines: list[str] = []
    assert quiet.wait_for_quiet(0.0, on_busy=_busy_note(lines.append, 120.0)) is False
    assert lines == ["the CPUs are 90% busy with other work: waiting up to 120 s for them to quiet before timing "
                     "the next shape (--max-wait)"]
    monkeypatch.setattr(quiet, "others_busy", lambda interval=0.3: 0.0)
    assert quiet.wait_for_quiet(5.0, on_busy=lines.append) is True and len(lines) == 1  # quiet: no line

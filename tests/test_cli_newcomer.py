"""What a newcomer hit (issue 32 item 9): the command line's rough edges, each pinned by a test.

Fast: nothing here loads a model (the chat loop runs against a stand-in engine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, usage", [
    (["serve", "--prot", "8001"], "usage: tokenloom serve"),
    (["chat", "--bogus"], "usage: tokenloom chat"),
    (["bench", "throughput", "--bogus"], "usage: tokenloom bench throughput"),
    (["replay", "--bogus", "x.json"], "usage: tokenloom replay"),
])
def test_an_unknown_flag_prints_the_subcommands_usage(argv: list[str], usage: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "unrecognized arguments: --" in err
    assert "COMMAND ..." not in err  # not the top-level usage


def test_an_unknown_flag_before_the_command_still_gets_the_top_level_usage(capsys) -> None:
    with pytest.raises(SystemExit):
        cli_main(["--bogus"])
    assert capsys.readouterr().err.startswith("usage: tokenloom [-h] COMMAND")


def test_python_dash_m_tokenloom_runs_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "tokenloom", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: tokenloom" in out.stdout and "serve" in out.stdout

"""What a newcomer hit (issue 32 item 9): the command line's rough edges, each pinned by a test.

Fast: nothing here loads a model (the chat loop runs against a stand-in engine)."""

from __future__ import annotations

import socket
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


# ------------------------------------------------------------------ serve: a port in use fails first


def test_serve_on_a_port_in_use_fails_before_loading_anything(tmp_path: Path) -> None:
    """Before: the model loaded (32 s for the default one) and then uvicorn failed on the port. The model
    here does not exist, so the old order failed on the model and never named the port."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "tokenloom", "serve", str(tmp_path / "no-such-model"),
                              "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "already in use" in out.stderr and "--port" in out.stderr
    assert "no-such-model" not in out.stderr  # nothing about the model: it was never looked at


def test_bind_socket_names_the_address_in_use_and_binds_a_free_one() -> None:
    from tokenloom.server.listen import PortUnavailableError, bind_socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortUnavailableError, match=f"127.0.0.1:{port}: .*already in use"):
            bind_socket("127.0.0.1", port)
    sock = bind_socket("127.0.0.1", 0)
    assert sock.getsockname()[1] > 0
    sock.close()

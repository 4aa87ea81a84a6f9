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


def test_vllms_dotted_json_flags_set_one_field() -> None:
    """vLLM's FlexibleArgumentParser form of a JSON flag (vLLM's pooling tests serve with `--pooler-config.task
    token_embed`): each dotted field, = or space, JSON values read as JSON, gathered into one object per flag."""
    from tokenloom.cli import build_parser, expand_dotted_args, parse_args

    argv = ["serve", "m.gguf", "--pooler-config.task", "token_embed", "--pooler-config.use_activation=false",
            "--speculative-config.a.b", "3", "--temperature", "-0.5", "--chat-template", "./t.jinja"]
    assert expand_dotted_args(argv) == ["serve", "m.gguf", "--temperature", "-0.5", "--chat-template", "./t.jinja",
                                        "--pooler-config", '{"task": "token_embed", "use_activation": false}',
                                        "--speculative-config", '{"a": {"b": 3}}']
    args = parse_args(build_parser(), ["serve", "/x", "--pooler-config.task", "token_embed"])
    assert args.pooler_config == {"task": "token_embed"}


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


# ------------------------------------------------------------------ chat: how to leave, empty lines


class _Out:
    def __init__(self, request_id: str, text: str) -> None:
        self.request_id = request_id
        self.outputs = [type("Completion", (), {"delta_text": text})()]


class _FakeEngine:
    """The slice of LLMEngine that `tokenloom chat` uses; answers every message with 'ok N'."""

    model_name = "fake-model"

    def __init__(self, interrupt_on: str | None = None) -> None:
        self.prompts: list[list[dict]] = []
        self.pending: list[str] = []
        self.interrupt_on = interrupt_on
        self.tokenizer = self

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.prompts.append([dict(m) for m in messages])
        return [1, 2, 3]

    def add_request(self, request_id, prompt, params) -> str:
        rid = f"r{len(self.prompts)}"
        self.pending.append(rid)
        return rid

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[_Out]:
        if self.interrupt_on and self.prompts[-1][-1]["content"] == self.interrupt_on:
            raise KeyboardInterrupt
        rid = self.pending.pop()
        return [_Out(rid, f"ok {len(self.prompts)}")]


def _chat(monkeypatch, capsys, stdin: str, engine: _FakeEngine | None = None) -> tuple[int, _FakeEngine, str, str]:
    import io

    import tokenloom.engine.cli as engine_cli

    engine = engine or _FakeEngine()
    monkeypatch.setattr(engine_cli, "_make_llm", lambda args: type("LLM", (), {"llm_engine": engine})())
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = cli_main(["chat"])
    out = capsys.readouterr()
    return rc, engine, out.out, out.err


@pytest.mark.parametrize("word", ["/exit", "/quit", "/bye", "exit", "quit", ":q", "  /EXIT  "])
def test_chat_leaves_on_the_usual_words_without_sending_them(word: str, monkeypatch, capsys) -> None:
    rc, engine, out, err = _chat(monkeypatch, capsys, f"hello\n{word}\nnot read\n")
    assert rc == 0
    assert [p[-1]["content"] for p in engine.prompts] == ["hello"]  # the exit word never reached the model
    assert "ok 1" in out


def test_chat_banner_says_how_to_leave(monkeypatch, capsys) -> None:
    rc, _, _, err = _chat(monkeypatch, capsys, "")
    assert rc == 0
    assert "fake-model" in err and "/exit" in err and "Ctrl-D" in err and "Ctrl-C" in err


def test_chat_ignores_empty_lines_and_ends_cleanly_at_eof(monkeypatch, capsys) -> None:
    rc, engine, out, _ = _chat(monkeypatch, capsys, "\n   \nfirst\n\nsecond\n")  # EOF after: Ctrl-D
    assert rc == 0
    assert [p[-1]["content"] for p in engine.prompts] == ["first", "second"]
    assert engine.prompts[1][1] == {"role": "assistant", "content": "ok 1"}  # the history goes on


def test_chat_ctrl_c_leaves_cleanly(monkeypatch, capsys) -> None:
    import tokenloom.engine.cli as engine_cli

    def interrupted(prompt: str) -> str:
        raise KeyboardInterrupt

    assert engine_cli.chat_loop(_FakeEngine(), None, [], read=interrupted) == 0  # at the prompt
    rc, engine, out, _ = _chat(monkeypatch, capsys, "hi\nboom\nnever\n", _FakeEngine(interrupt_on="boom"))
    assert rc == 0 and "[interrupted]" in out  # while the model answers
    assert [p[-1]["content"] for p in engine.prompts] == ["hi", "boom"]

"""Environment variables are read in one place (tokenloom/envs.py, vLLM's envs.py): a test that parses
every module, so a new os.environ read elsewhere fails here instead of hiding from the docs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tokenloom import envs

PACKAGE = Path(__file__).resolve().parents[1] / "tokenloom"
# Not reads of a setting: tokenloom/__init__.py sets libgomp's and oneDNN's own variables before torch
# loads; kernels.py puts the venv's ninja on PATH for torch's builder.
WRITERS = {"tokenloom/__init__.py", "tokenloom/model/kernels.py"}


def environ_reads(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "tokenloom/envs.py" or rel in WRITERS:
            continue
        found += [f"{rel}:{line}" for line in environ_reads(path.read_text())]
    assert not found, "read these through tokenloom/envs.py:\n" + "\n".join(found)


def test_values_are_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_FUSED_DECODE_ROWS", "3")
    assert envs.TOKENLOOM_FUSED_DECODE_ROWS == 3
    monkeypatch.delenv("TOKENLOOM_FUSED_DECODE_ROWS")
    monkeypatch.setenv("TOKENLOOM_GGUF_FUSED_ROWS", "5")  # the older spelling still counts
    assert envs.TOKENLOOM_FUSED_DECODE_ROWS == 5
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "off")
    assert envs.TOKENLOOM_CPU_KERNELS is False
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", "/tmp/x")
    assert Path("/tmp/x") == envs.TOKENLOOM_CACHE_DIR


def test_malformed_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_FUSED_DECODE_ROWS", "nine")
    with pytest.raises(ValueError, match="TOKENLOOM_FUSED_DECODE_ROWS must be an integer"):
        envs.TOKENLOOM_FUSED_DECODE_ROWS  # noqa: B018
    monkeypatch.setenv("TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE", "-1")
    with pytest.raises(ValueError, match="TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE must be > 0"):
        envs.TOKENLOOM_HTTP_TIMEOUT_KEEP_ALIVE  # noqa: B018
    with pytest.raises(AttributeError):
        envs.TOKENLOOM_NOT_A_VARIABLE  # noqa: B018


@pytest.mark.parametrize("raw, value", [("", False), ("0", False), ("1", True), ("2", True), ("true", True),
                                        ("off", False), ("maybe", None)])
def test_vllm_batch_invariant_reads_as_vllm(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool | None) -> None:
    """vLLM's bool(int(...)) (so "2" is on), words too; anything else names the variable."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", raw)
    if value is None:
        with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be 0 or 1, got 'maybe'"):
            envs.VLLM_BATCH_INVARIANT  # noqa: B018
    else:
        assert envs.VLLM_BATCH_INVARIANT is value


def test_benchmark_locations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the benchmarks find the reference set-up outside the repository: a variable, else the old default."""
    for name in ("TOKENLOOM_ANCHORS_DIR", "ANCHORS", "TOKENLOOM_VLLM_PYTHON", "VLLM_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tmp_path / ".cache" / "tokenloom-anchors" == envs.TOKENLOOM_ANCHORS_DIR
    assert str(tmp_path / ".cache/tokenloom-anchors/vllm-venv/bin/python") == envs.TOKENLOOM_VLLM_PYTHON
    monkeypatch.setenv("ANCHORS", str(tmp_path / "old"))  # the name the benchmarks read before
    assert tmp_path / "old" == envs.TOKENLOOM_ANCHORS_DIR
    monkeypatch.setenv("TOKENLOOM_ANCHORS_DIR", str(tmp_path / "new"))
    assert tmp_path / "new" == envs.TOKENLOOM_ANCHORS_DIR
    assert str(tmp_path / "new/vllm-venv/bin/python") == envs.TOKENLOOM_VLLM_PYTHON
    monkeypatch.setenv("TOKENLOOM_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert envs.TOKENLOOM_VLLM_PYTHON == "/opt/vllm/bin/python"
    assert envs.TOKENLOOM_ANCHORS_SCRIPTS.name == "anchors"

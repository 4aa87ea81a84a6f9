"""benchmarks/README.md is the map from a figure to the command that made it: every file under
docs/figures/ is named there, and every script it names exists (so a move or a new figure updates it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "benchmarks" / "README.md"


def test_every_figure_file_is_named_in_the_benchmarks_readme() -> None:
    text = README.read_text(encoding="utf-8")
    figures = sorted(p.relative_to(ROOT / "docs" / "figures").as_posix()
                     for p in (ROOT / "docs" / "figures").rglob("*") if p.is_file())
    assert figures, "docs/figures/ is empty?"
    missing = [name for name in figures if name not in text]
    assert not missing, "name these in benchmarks/README.md (figure -> script -> command):\n" + "\n".join(missing)


def test_every_script_the_readme_names_exists_and_every_script_is_named() -> None:
    text = README.read_text(encoding="utf-8")
    named = set(re.findall(r"benchmarks/([a-z_]+/[a-z_]+\.py)", text))
    named |= {m for m in re.findall(r"`([a-z_]+/[a-z_]+\.py)`", text) if not m.startswith(("tests/", "tokenloom/"))}
    missing = sorted(p for p in named if not (ROOT / "benchmarks" / p).is_file())
    assert not missing, f"benchmarks/README.md names scripts that do not exist: {missing}"
    scripts = sorted(p.relative_to(ROOT / "benchmarks").as_posix() for p in (ROOT / "benchmarks").glob("*/*.py")
                     if p.name != "__init__.py")
    unnamed = [s for s in scripts if Path(s).name not in text]
    assert not unnamed, f"benchmarks/README.md does not describe: {unnamed}"
    flat = [p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py"]
    assert not flat, f"scripts go in an area folder (benchmarks/<area>/), not benchmarks/ itself: {flat}"

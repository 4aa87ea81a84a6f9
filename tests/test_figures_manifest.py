"""benchmarks/figures/manifest.toml is the machine-readable map from each file under docs/figures/ to the
commands that wrote it (`make figures-quick`, `make figure FIGURE=...` run it): every figure file is in
exactly one entry, every command writes the files its entry claims, and every flag a command passes to a
benchmark script or a `tokenloom` subcommand still exists (a renamed option breaks the re-run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.figures.rerun import FIGURES, command_flags, load_manifest, unknown_flags  # noqa: E402


@pytest.fixture(scope="module")
def figures():
    return load_manifest()


def test_every_figure_file_is_in_exactly_one_entry(figures) -> None:
    on_disk = sorted(p.relative_to(FIGURES).as_posix() for p in FIGURES.rglob("*") if p.is_file())
    listed = [name for fig in figures for name in fig.files]
    assert sorted(set(listed)) == sorted(listed), "a file is listed by two entries"
    assert sorted(set(on_disk) - set(listed)) == [], "add these to benchmarks/figures/manifest.toml"
    assert sorted(set(listed) - set(on_disk)) == [], "the manifest lists files docs/figures/ does not have"


def test_every_command_writes_its_files_and_names_real_scripts(figures) -> None:
    for fig in figures:
        assert (ROOT / fig.doc).is_file(), f"{fig.name}: no doc {fig.doc}"
        for kind, script in (("run", fig.run), ("quick", fig.quick)):
            if script is None:
                continue
            for name in fig.files:  # the file, or its stem (`bench sweep -o X` writes X.json and X.png)
                assert name.split(".")[0] in script, f"{fig.name}: its {kind} commands never write {name}"
            for program, _flags in command_flags(script):
                if program.startswith("benchmarks/"):
                    assert (ROOT / program).is_file(), f"{fig.name}: {program} does not exist"


def test_command_flags_reads_scripts_and_product_commands() -> None:
    snippet = ('$PY benchmarks/serving/serve_ab.py --a= --b=--async-scheduling --rounds 2 -- --dataset-name jsonl\n'
               '$PY -m tokenloom bench sweep --dataset-path x.jsonl --sweep a=1,2 -o out\n'
               '$PY -m tokenloom plot timeline "t.jsonl" --steps 0:40 -o p.png')
    assert command_flags(snippet) == [("benchmarks/serving/serve_ab.py", ["--a", "--b", "--rounds"]),
                                      ("tokenloom bench sweep", ["--dataset-path", "--sweep"]),
                                      ("tokenloom plot timeline", ["--steps"])]


def test_every_flag_the_manifest_passes_exists(figures) -> None:
    """Runs each script's --help in one child interpreter (rerun._help_texts): ~3 s."""
    assert unknown_flags(figures) == []

"""benchmarks/scheduler/scheduling_policies_real.py's plumbing on a tiny model, in seconds (no timing asserted):
profile the engine's own runner, run each figure's configurations on the real engine and on the simulator
over the same trace, write the JSON and the tables into a docs block, render them again from the JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "benchmarks" / "scheduler" / "scheduling_policies_real.py"
    spec = importlib.util.spec_from_file_location("tokenloom_scheduling_policies_real", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_time_scale_keeps_the_trace_and_divides_its_times(bench) -> None:
    sizes = bench.Sizes()
    one = bench.figures(sizes, 1.0, "p.json", 49152, 0, ["starvation", "priority", "slo"])
    two = bench.figures(sizes, 2.0, "p.json", 49152, 0, ["starvation", "priority", "slo"])
    for a, b in zip(one, two, strict=True):
        assert [r.id for r in a.requests] == [r.id for r in b.requests], a.name
        assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
        assert [r.max_tokens for r in a.requests] == [r.max_tokens for r in b.requests]
        assert all(x.arrival_s == pytest.approx(2 * y.arrival_s) for x, y in zip(a.requests, b.requests))
    starvation, slo = two[0].variants, two[2].variants
    assert starvation[0] == ("default (vLLM)", {"max_num_batched_tokens": 64, "max_num_seqs": 64})
    assert starvation[1][1]["max_prefill_wait_ms"] == 250  # 500 ms on the reference machine
    controller = dict(slo)["controller: ITL 75 ms"]
    assert controller["target_itl_ms"] == 75 and controller["step_cost_profile"] == "p.json"
    # Token ids beyond a small vocabulary are folded into it, the same trace on both sides.
    tiny = bench.figures(sizes, 1.0, "p.json", 320, 0, ["slo"])[0]
    assert max(t for r in tiny.requests for t in r.prompt) < 320


def test_real_and_simulated_figures_on_a_tiny_model(bench, tmp_path: Path, capsys) -> None:
    model = str(make_tiny_hf_model(tmp_path / "tiny", arch="llama", seed=3))
    docs = tmp_path / "doc.md"
    docs.write_text(f"before\n\n{bench.DOCS_BEGIN}\n\n(placeholder)\n\n{bench.DOCS_END}\n\nafter\n")
    out = tmp_path / "real.json"
    common = ["--model", model, "--dtype", "float32", "--num-blocks", "256", "--size", "smoke"]
    assert bench.main(common + ["--repeats", "1", "--out", str(out), "--update-docs", str(docs)]) == 0
    tables = capsys.readouterr().out
    data = json.loads(out.read_text())

    profile = Path(data["machine"]["profile"])
    assert profile == out.with_suffix(".profile.json") and json.loads(profile.read_text())["coefficients_s"]
    expected_first = {"starvation": "default (vLLM)", "priority_preemption": "priority (vLLM)",
                      "slo_budget": "fixed budget 32"}  # fmt: skip
    for name, first in expected_first.items():
        fig = data[name]
        policies = list(fig["configs"])
        assert policies[0] == first and len(policies) == 2, name
        assert [r["policy"] for r in fig["sim"]] == policies == [r["policy"] for r in fig["real"]], name
        assert [(r["policy"], r["repeat"]) for r in fig["real_runs"]] == [(p, 0) for p in policies]
        assert all(len(r["repeats"]) == 1 for r in fig["real"])
    # Every request finished on both sides, and each row has its figures.
    starv = data["starvation"]
    for row in starv["sim"] + starv["real"]:
        assert row["num_long"] + row["num_chats"] == starv["num_requests"]
        assert row["long_prompt_ttft_p99_ms"] > 0 and row["decode_itl_p99_ms"] > 0
    assert data["priority_preemption"]["configs"]["priority + preemption for waiting"]["enable_priority_preemption"]
    assert all(r["high_priority_ttft_p99_ms"] > 0 for r in data["priority_preemption"]["real"])
    slo = data["slo_budget"]
    assert [r["num_requests"] for r in slo["sim"] + slo["real"]] == [slo["num_requests"]] * 4
    ctl = next(c for p, c in slo["configs"].items() if p.startswith("controller"))
    assert ctl["step_cost_profile"] == str(profile)  # the controller predicts with this runner's profile
    # ... and corrects it with the step times the real engine measured (the fixed budget has no controller).
    runs = {r["policy"]: r for r in slo["real_runs"]}
    corrections = [r["slo_correction"] for p, r in runs.items() if p.startswith("controller")]
    assert corrections and all(c["decode"]["steps"] + c["prefill"]["steps"] > 0 for c in corrections)
    assert "slo_correction" not in runs["fixed budget 32"]

    # The tables went into the docs block (text around it untouched) and render again from the JSON.
    text = docs.read_text()
    assert text.startswith("before\n\n") and text.endswith("\n\nafter\n") and "(placeholder)" not in text
    assert tables in text and "| default (vLLM) |" in tables and "| fixed budget 32 |" in tables
    assert bench.main(["--render", str(out)]) == 0
    assert capsys.readouterr().out == tables

    # The simulator alone, with that profile given (no profiling, no real runs).
    sim_out = tmp_path / "sim.json"
    assert bench.main(common + ["--sim-only", "--figures", "priority", "--step-cost-profile", str(profile),
                                "--out", str(sim_out)]) == 0  # fmt: skip
    sim = json.loads(sim_out.read_text())
    assert "real" not in sim["priority_preemption"] and "starvation" not in sim
    assert sim["priority_preemption"]["sim"] == data["priority_preemption"]["sim"]  # same profile, same trace

    # Real runs the simulator predicts to take longer than --max-minutes are not started.
    late = tmp_path / "late.json"
    assert bench.main(common + ["--figures", "priority", "--step-cost-profile", str(profile), "--max-minutes", "1e-6",
                                "--out", str(late)]) == 3  # fmt: skip
    assert not late.exists()


@pytest.mark.parametrize(("argv", "named"), [
    (["--figures", "starvation,latency"], "--figures"),
    (["--set", "slo.nope=1"], "slo.target_itl_ms"),  # the known fields are listed
    (["--set", "slo.rate=fast"], "must be JSON"),
    (["--set", 'slo.controllers=["itl", "ttft"]'], "controllers"),
])  # fmt: skip
def test_bad_arguments_are_named(bench, capsys, argv: list[str], named: str) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert named in capsys.readouterr().err


def test_settings_change_one_workload_field(bench) -> None:
    sizes = bench.with_settings(bench.Sizes(), ["slo.rate=1.2", 'slo.controllers=["itl", "itl+ttft"]',
                                                "starvation.bounds=[[1000, 16]]"])  # fmt: skip
    assert sizes.slo.rate == 1.2 and sizes.slo.duration_s == bench.Slo().duration_s
    starvation, slo = bench.figures(sizes, 1.0, "p.json", 49152, 0, ["slo", "starvation"])
    names = [name for name, _ in slo.variants]
    assert names[-2:] == ["controller: ITL 150 ms", "controller: ITL 150 ms + TTFT 3000 ms"]
    assert starvation.variants[1][0] == "bound 1000 ms, chunk 16"

"""The explorer: its JSON endpoint (the real scheduler) and the page in a headless Chromium."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenloom.explore.presets import PRESETS
from tokenloom.explore.scenario import run_scenario
from tokenloom.explore.server import start_in_thread

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server, thread = start_in_thread(0)
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _post(url: str, knobs: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/api/run", json.dumps(knobs).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _preset(preset_id: str) -> dict:
    return next(p["knobs"] for p in PRESETS if p["id"] == preset_id)


# ------------------------------------------------------------------------------------- the endpoint


@pytest.mark.parametrize("budget, first_chunk", [(16, 6), (32, 22)])
def test_budget_presets_step1_comes_from_the_scheduler(base_url: str, budget: int, first_chunk: int) -> None:
    status, body = _post(base_url, {**_preset("budget-16"), "B": budget})
    assert status == 200
    assert body["setup_steps"] == 1
    assert body["steps"][1]["prefill"] == {"p": first_chunk}
    assert sum(body["steps"][1]["decode"].values()) == 10


def test_invalid_config_answers_422_with_the_config_error(base_url: str) -> None:
    status, body = _post(base_url, _preset("budget-8-invalid"))
    assert status == 422 and body["kind"] == "ConfigError"
    assert "max_num_batched_tokens (8) must be >= max_num_seqs (32)" in body["error"]
    status, body = _post(base_url, {"B": "lots"})
    assert status == 422 and "max_num_batched_tokens must be an integer" in body["error"]
    status, body = _post(base_url, {"warp_speed": 9})
    assert status == 422 and "unknown knob" in body["error"]


def test_every_preset_runs_or_explains_itself() -> None:
    for preset in PRESETS:
        if "invalid" in preset["title"]:
            with pytest.raises(ValueError, match="must be >= max_num_seqs"):
                run_scenario(preset["knobs"])
        else:
            assert run_scenario(preset["knobs"])["steps"], preset["id"]


def test_presets_show_the_seeds_numbers() -> None:
    group_a = run_scenario(_preset("group-a"))
    assert [s["prefill"].get("p", 0) for s in group_a["steps"][1:5]] == [6, 6, 6, 6]
    assert group_a["prefill_done"] == {"p": 4}
    group_b = run_scenario(_preset("group-b"))
    assert group_b["prefill_done"] == {"p": None}
    assert all(s["bound_by"] == "budget" and "p" not in s["scheduled"] for s in group_b["steps"][1:])
    timeline = run_scenario(_preset("three-requests"))
    assert [s["scheduled"] for s in timeline["steps"]] == [{"A": 4, "B": 2}, {"A": 1, "B": 4, "C": 1},
                                                          {"B": 2, "C": 2}, {"B": 1, "C": 1}, {"B": 1}]  # fmt: skip
    kv = run_scenario(_preset("kv-preemption"))
    assert kv["num_preemptions"] > 0 and kv["prefill_done"]["p"] is not None


# ----------------------------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def page(base_url: str) -> Iterator:
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.goto(base_url + "/")
        yield pg
        browser.close()


def _step1_prefill(pg) -> str:
    return pg.locator('td[data-col="prefill"][data-step="1"]').inner_text()


def test_page_opens_on_the_budget_16_preset_and_follows_the_budget_knob(page, tmp_path: Path) -> None:
    page.wait_for_selector('td[data-col="prefill"][data-step="1"]')
    assert page.locator(".presets button.active").inner_text().startswith("10 decodes + a 24-token prompt · B=16")
    assert _step1_prefill(page) == "6"
    assert "Prefill done in step 4" in page.locator("#headline").inner_text()

    page.fill("#knob-B", "32")
    page.wait_for_function("document.querySelector('td[data-col=\"prefill\"][data-step=\"1\"]').textContent === '22'")
    assert _step1_prefill(page) == "22"

    shot = tmp_path / "explore.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_page_shows_the_config_error_text(page) -> None:
    page.locator('.presets button[data-id="budget-8-invalid"]').click()
    page.wait_for_selector("#error:not(.hidden)")
    text = page.locator("#error").inner_text()
    assert "Invalid configuration" in text and "max_num_batched_tokens (8) must be >= max_num_seqs (32)" in text
    assert page.locator("#result").is_hidden()
    # Back to a valid preset: the error goes, the steps come back.
    page.locator('.presets button[data-id="three-requests"]').click()
    page.wait_for_selector("#error.hidden", state="attached")
    assert page.locator('td[data-col="prefill"][data-step="0"]').inner_text() == "6"

"""benchmarks/real_models/single_stream.py --bandwidth-probe: a round is compared only within one phase of
the VM's memory bandwidth (docs/performance.md, "The VM's two phases"), and a side's share of the bus counts
the bytes a decode step reads, from the GGUF's tensor table."""

from __future__ import annotations

from gguf import GGUFReader

from benchmarks.real_models.single_stream import decode_bytes_per_token, phases
from tokenloom.model.paths import default_model_path


def test_rounds_split_at_the_geometric_mean_of_the_run() -> None:
    probes = [[35.1, 36.0, 35.4, 34.2],  # one CCD's link the whole round
              [57.3, 56.8, 56.4, 49.9],  # two CCDs' links
              [55.8, 34.9, 35.1, 35.9],  # moved during the round: its ratio compares two phases
              [33.0, 35.4, 35.5, 33.4]]
    assert phases(probes) == ["low", "high", "mixed", "low"]


def test_a_run_within_the_spread_is_one_phase() -> None:
    assert phases([[35.0, 36.1], [33.9, 35.5], [34.4, 40.0]]) == ["one", "one", "one"]
    assert phases([[35.0, 36.1], [33.9, 45.0]]) == ["low", "mixed"]  # 45 / 33.9 > 1.25: two phases


def test_a_tied_model_reads_its_whole_embedding_as_the_lm_head() -> None:
    path = str(default_model_path())  # SmolLM2: no output.weight, the LM head is the token embedding
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    assert "output.weight" not in sizes and "token_embd.weight" in sizes
    assert decode_bytes_per_token(path) == sum(sizes.values())


def test_an_untied_model_reads_one_embedding_row_a_token(tmp_path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "untied.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 16), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), dtype=np.float32))
    writer.add_tensor("output.weight", np.zeros((64, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert decode_bytes_per_token(str(path)) == (16 * 16 + 64 * 16) * 4


def test_waiting_for_the_fast_phase_stops_at_the_first_fast_reading_or_the_limit() -> None:
    from benchmarks.real_models.single_stream import wait_for_bandwidth

    now = [0.0]

    def clock() -> float:
        return now[0]

    def probe_from(readings: list[float]):  # noqa: ANN202 - each probe takes a second of the fake clock
        def probe() -> float:
            now[0] += 1.0
            return readings.pop(0)
        return probe

    assert wait_for_bandwidth(probe_from([35.0, 36.0, 55.0, 56.0]), 50.0, 60.0, clock) == 3.0
    now[0] = 0.0
    assert wait_for_bandwidth(probe_from([35.0] * 10), 50.0, 4.0, clock) == 4.0  # gave up: the round runs anyway

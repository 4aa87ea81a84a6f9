"""The config dataclasses are the one source of the engine's knobs: CLI, LLM(**kwargs), sweeps, simulator."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from tokenloom import config as cfg
from tokenloom.config import ConfigError, EngineConfig, engine_args, engine_config_from_kwargs
from tokenloom.engine.args import add_engine_arg, add_engine_args, engine_config_from_args


def test_vllm_names_and_field_names_both_reach_the_config() -> None:
    for name in ("scheduling_policy", "policy"):
        config = engine_config_from_kwargs(**{name: "priority"}, max_num_seqs=8, num_blocks=64, dtype="float32")
        assert config.scheduler.policy == "priority" and config.scheduler.max_num_seqs == 8
        assert config.cache.num_blocks == 64 and config.dtype == "float32"
    with pytest.raises(ConfigError, match="unknown engine argument.*max_num_seq\\b"):
        engine_config_from_kwargs(max_num_seq=8)


def test_a_small_budget_cuts_max_num_seqs_only_when_it_is_left_at_its_default() -> None:
    """vLLM's EngineArgs: max_num_seqs at its default is cut to a smaller max_num_batched_tokens (vLLM's
    test_reset_prefix_cache_e2e runs max_num_batched_tokens=32 alone); one given explicitly is checked."""
    assert engine_config_from_kwargs(max_num_batched_tokens=32).scheduler.max_num_seqs == 32
    assert engine_config_from_kwargs(max_num_batched_tokens=4096).scheduler.max_num_seqs == 128
    assert engine_config_from_kwargs(max_num_batched_tokens=32, max_num_seqs=16).scheduler.max_num_seqs == 16
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(32\) must be >= max_num_seqs \(64\)"):
        engine_config_from_kwargs(max_num_batched_tokens=32, max_num_seqs=64)


def test_cli_flags_parse_into_the_same_config_as_kwargs() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["m.gguf", "--scheduling-policy", "priority", "--no-enable-prefix-caching",
                              "--kv-cache-memory", "1GiB", "-q", "int8", "--watermark", "0.1"])
    assert engine_config_from_args(args) == engine_config_from_kwargs(
        model="m.gguf", scheduling_policy="priority", enable_prefix_caching=False, kv_cache_memory=1 << 30,
        quantization="int8", watermark=0.1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-memory", "lots"])


def test_every_knob_has_help_and_a_flag() -> None:
    flags = [a.flag for a in engine_args()]
    assert len(flags) == len(set(flags))
    assert "--scheduling-policy" in flags and "--policy" not in flags
    assert all(a.help for a in engine_args())


def test_vllms_dtype_names_are_taken_and_float16_runs_as_autos_16_bit_choice(caplog) -> None:
    """vLLM code passes dtype="half" / "float16" / "float"; the kernels have no float16 path, so float16 runs as
    what auto picks on this hardware (bfloat16 where native, else float32), with a warning that says so."""
    import torch

    from tokenloom.model.platform import resolve_dtype

    assert EngineConfig(dtype="half").dtype == "float16" and EngineConfig(dtype="float").dtype == "float32"
    assert engine_config_from_kwargs(dtype="float16").dtype == "float16"
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger="tokenloom.model.platform"):
        assert resolve_dtype("float16", cpu) == resolve_dtype("auto", cpu)
    assert "float16 runs as" in caplog.text
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float64")
    # The command line takes vLLM's spellings too (`vllm serve --dtype half`; vLLM's pooling tests pass it).
    assert cfg.engine_arg("dtype").choices == ("auto", "float32", "bfloat16", "float16", "half", "float")


def test_sweepable_knobs_exclude_those_that_reload_the_model() -> None:
    from tokenloom.bench.sweep import SWEEPABLE
    from tokenloom.workload.sweep import KNOBS

    assert "scheduling_policy" in SWEEPABLE and "block_size" not in SWEEPABLE and "dtype" not in SWEEPABLE
    assert KNOBS["enable_prefix_caching"]("off") is False and KNOBS["kv_cache_memory"]("2KiB") == 2048
    assert "dtype" not in KNOBS and "request_rate" in KNOBS


def test_a_json_and_a_bool_knob_get_their_cli_kinds() -> None:
    """A later knob typed dict (speculative_config) reads JSON; a bool becomes --x/--no-x."""

    @dataclass
    class Extra:
        speculative_config: dict | None = cfg.knob(None, "speculative decoding, as JSON")
        async_scheduling: bool = cfg.knob(False, "overlap scheduling with the forward")

    extra = {a.name: a for a in cfg.knobs_of(Extra, "engine")}
    assert extra["speculative_config"].kind == "json" and extra["async_scheduling"].kind == "bool"
    parser = argparse.ArgumentParser()
    for a in extra.values():
        add_engine_arg(parser, a)
    args = parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 3}', "--async-scheduling"])
    assert args.speculative_config == {"num_speculative_tokens": 3} and args.async_scheduling is True
    assert parser.parse_args([]).async_scheduling is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{3"])
    with pytest.raises(ValueError, match="not JSON"):
        cfg.parse_json("{3")
    assert Extra().speculative_config is None


def test_server_options_come_from_server_config_knobs(monkeypatch) -> None:
    """`tokenloom serve`'s server flags are ServerConfig's knob fields (issue 31): every field but the
    flagless engine_ready_timeout_s has one, no flag is hand-written in server/cli.py, no server flag
    shadows an engine flag, and the parsed flags build the ServerConfig their values say."""
    import dataclasses
    import inspect

    from tokenloom import envs
    from tokenloom.server import cli as serve_cli
    from tokenloom.server.config import ServerConfig, server_args

    knobs = {a.field for a in server_args()}
    assert knobs == {f.name for f in dataclasses.fields(ServerConfig)} - {"engine_ready_timeout_s"}
    assert "add_argument(" not in inspect.getsource(serve_cli.register)
    assert not {a.flag for a in server_args()} & {a.flag for a in engine_args()}
    monkeypatch.setattr(envs, "TOKENLOOM_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--port", "9", "--served-model-name", "a", "b", "--max-waiting-requests", "0",
                              "--max-request-body-bytes", "1MiB", "--shutdown-grace-period", "2.5",
                              "--allowed-origins", '["http://x"]', "--disable-uvicorn-access-log",
                              "--tool-strict-level", "parameter"])
    config = ServerConfig(**{a.field: getattr(args, a.name) for a in server_args()})
    assert config == ServerConfig(port=9, served_model_names=["a", "b"], max_waiting_requests=None,
                                  max_request_body_bytes=1 << 20, shutdown_grace_s=2.5, allowed_origins=["http://x"],
                                  disable_uvicorn_access_log=True, tool_strict_level="parameter", api_key=["from-env"])
    assert not config.access_log
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--allowed-origins", "not json"])


def test_the_automatic_budget_holds_max_model_len_with_chunked_prefill_off() -> None:
    """vLLM's EngineArgs: with chunked prefill off and no max_num_batched_tokens, the budget is at least
    max_model_len (a whole prompt must fit one step); vLLM's LLM(max_model_len=4096, enable_chunked_prefill=False)
    was refused here. An explicit budget below max_model_len is still refused."""
    sched = cfg.SchedulerConfig(enable_chunked_prefill=False, max_model_len=4096)
    assert sched.token_budget_ceiling == 4096
    assert cfg.SchedulerConfig(enable_chunked_prefill=False, max_model_len=1024).token_budget_ceiling == 2048
    assert cfg.SchedulerConfig(max_model_len=4096).token_budget_ceiling == 2048  # chunked: the prompt is split
    with pytest.raises(ConfigError, match="with chunked prefill off"):
        cfg.SchedulerConfig(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)


def test_max_num_seqs_not_given_is_capped_by_a_smaller_token_budget() -> None:
    """vLLM's EngineArgs: max_num_seqs, when not given, is its default capped by max_num_batched_tokens, so
    LLM(max_num_batched_tokens=48, enable_chunked_prefill=True) runs (vLLM's test_async_scheduling.py forces
    chunks so); a max_num_seqs given above the budget is still refused, as vLLM's SchedulerConfig refuses it."""
    assert engine_config_from_kwargs(max_num_batched_tokens=48).scheduler.max_num_seqs == 48
    assert engine_config_from_kwargs(max_num_batched_tokens=4096).scheduler.max_num_seqs == 128
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--max-num-batched-tokens", "48"])).scheduler.max_num_seqs == 48
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(48\) must be >= max_num_seqs \(64\)"):
        engine_config_from_kwargs(max_num_batched_tokens=48, max_num_seqs=64)


def test_vllms_model_source_arguments_are_taken_or_refused_by_name() -> None:
    """vLLM's model_impl, config_format, load_format, hf_token and enable_sleep_mode: what tokenloom honours is
    taken (the CLI too, hf_token's bare flag as vLLM's), the rest refused in words that say why (vLLM's where it
    has them: config_format's unknown value, sleep mode on a platform without it)."""
    for kwargs in (dict(model_impl="vllm"), dict(model_impl="auto"), dict(config_format="hf"), dict(load_format="hf"),
                   dict(hf_token="hf_abc"), dict(hf_token=True), dict(enable_sleep_mode=False)):
        engine_config_from_kwargs(**kwargs)
    for kwargs, words in ((dict(model_impl="transformers"), "Transformers backend"),
                          (dict(model_impl="terratorch"), "TerraTorch backend"),
                          (dict(model_impl="hf"), "model_impl must be one of"),
                          (dict(config_format="mistral"), "params.json"),
                          (dict(config_format="yaml"), "Unknown config format `yaml`."),
                          (dict(load_format="pt"), "load_format 'pt' is vLLM's"),
                          (dict(hf_token=3), "hf_token must be"),
                          (dict(enable_sleep_mode=True), "^Sleep mode is not supported on current platform.$")):
        with pytest.raises(ConfigError, match=words):
            engine_config_from_kwargs(**kwargs)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--hf-token"]).hf_token is True
    assert parser.parse_args(["--hf-token", "hf_x"]).hf_token == "hf_x" and parser.parse_args([]).hf_token is None
    config = engine_config_from_args(parser.parse_args(["--model-impl", "vllm", "--config-format", "hf", "--hf-token"]))
    assert (config.model_impl, config.config_format, config.hf_token) == ("vllm", "hf", True)
    with pytest.raises(SystemExit):  # vLLM's CLI: a Literal's choices
        parser.parse_args(["--model-impl", "other"])
    with pytest.raises(ConfigError, match="Sleep mode"):
        engine_config_from_args(parser.parse_args(["--enable-sleep-mode"]))


def test_load_format_is_checked_against_the_model_path(tmp_path) -> None:
    from tokenloom.engine.core_host import check_load_format

    gguf, hf_dir = tmp_path / "m.gguf", tmp_path / "hf"
    gguf.write_bytes(b"GGUF")
    hf_dir.mkdir()
    for fmt, path in (("auto", gguf), ("auto", hf_dir), ("gguf", gguf), ("hf", hf_dir), ("safetensors", hf_dir)):
        check_load_format(fmt, path)
    with pytest.raises(ConfigError, match="needs a .gguf model file"):
        check_load_format("gguf", hf_dir)
    with pytest.raises(ConfigError, match="is a GGUF file"):
        check_load_format("hf", gguf)


def test_hf_overrides_take_a_dict_or_a_callable_and_the_cli_reads_vllms_json() -> None:
    """vLLM's HfOverrides: a dict, or offline a callable; --hf-overrides is a JSON object (vLLM's parser keeps any
    other text a string, which the config refuses as vLLM's ModelConfig does; malformed JSON fails the parse)."""

    def shrink(config):  # noqa: ANN001, ANN202 - a transformers config
        config.num_hidden_layers = 2
        return config

    assert EngineConfig().hf_overrides == {} and EngineConfig(hf_overrides=None).hf_overrides == {}
    assert engine_config_from_kwargs(hf_overrides={"num_hidden_layers": 2}).hf_overrides == {"num_hidden_layers": 2}
    assert engine_config_from_kwargs(hf_overrides=shrink).hf_overrides is shrink
    for bad, words in (("num_hidden_layers=2", "Input should be a valid dictionary or callable, got str"),
                       ([("a", 1)], "got list"), ({1: 2}, "keys must be config field names")):
        with pytest.raises(ConfigError, match=words):
            engine_config_from_kwargs(hf_overrides=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--hf-overrides", '{"matryoshka_dimensions": [256], "text_config": {"a": 1}}'])
    assert engine_config_from_args(args).hf_overrides == {"matryoshka_dimensions": [256], "text_config": {"a": 1}}
    assert parser.parse_args([]).hf_overrides == {}
    for text in ("[1, 2]", "{not json"):  # not an object's braces: a string, as vLLM's parser leaves it
        with pytest.raises(ConfigError, match="valid dictionary"):
            engine_config_from_args(parser.parse_args(["--hf-overrides", text]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", "{not: json}"])
    with pytest.raises(ValueError, match="cannot be converted to JSON"):
        cfg.parse_hf_overrides("{not: json}")


def test_custom_histogram_buckets_are_checked_in_vllms_words() -> None:
    good = {"request_latency": [0.01, 0.05, 0.1, 0.5], "request_tokens": [1, 10, 100]}
    config = engine_config_from_kwargs(custom_histogram_buckets=good)
    assert config.observability_config.custom_histogram_buckets == good
    assert EngineConfig(custom_histogram_buckets='{"request_params_n": [1, 4]}').custom_histogram_buckets == \
        {"request_params_n": [1.0, 4.0]}
    assert EngineConfig().observability_config.custom_histogram_buckets is None
    for bad, words in (({"bogus": [1.0]}, "unknown bucket family 'bogus'; known families: \\['inter_token_latency'"),
                       ({"request_latency": []}, "bucket list must not be empty"),
                       ({"request_latency": [True, 2]}, "must be a number, not a boolean"),
                       ({"request_latency": [0, 1]}, "bound 0 must be finite and greater than 0"),
                       ({"request_latency": [1, float("inf")]}, "bound inf must be finite"),
                       ({"request_latency": [2, 1]}, "must be strictly increasing"),
                       ({"request_latency": "1,2"}, "must be a list of numbers"),
                       ([1, 2], "must be a JSON object")):
        with pytest.raises(ConfigError, match=words):
            engine_config_from_kwargs(custom_histogram_buckets=bad)

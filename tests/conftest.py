"""Shared fixtures: every test ends with the leak check (tests/leak_check.py)."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`make test` runs one worker per core, up to 4) each worker, and every process it
    starts (servers, TP ranks, Ray), keeps to cores of its own. Sharing cores, two workers' OpenMP teams would
    each wait at every barrier for a thread the other had descheduled; apart, an engine in a worker sees one
    core, sizes its threads to it (tokenloom/model/platform.py) and the two run side by side. Runs before
    torch is imported: its thread pool is sized from this affinity. Without enough cores, nothing is pinned."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    cpus = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cpus) < count:
        return
    share, index = len(cpus) // count, int(worker[2:])
    os.sched_setaffinity(0, cpus[index * share:] if index == count - 1 else cpus[index * share:(index + 1) * share])


_pin_xdist_worker()

import pytest  # noqa: E402

from tests import leak_check  # noqa: E402

# Files whose tests start several engines, servers or worker processes, longest first (each file's summed
# seconds in a `--durations=0` run on the 2-core Zen 1, the files of 10 s and more; the rest follow in
# collection order, alphabetical). `make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`, which
# hands out whole files in this order: longest first evens out the tail, where one worker would otherwise run a
# long file alone while the other has nothing left (xdist's own reordering, by number of tests, put files of one
# long test last: 26 s of one worker idle at the end). The order inside a file is kept.
RUN_FIRST = (
    "test_batch_invariance.py", "test_tool_calls_server.py", "test_vllm_async_llm.py", "test_responses_api.py",
    "test_spec_decode_engine.py", "test_pd_handoff.py", "test_tensor_parallel.py", "test_malformed_sweep.py",
    "test_ray_parallel.py", "test_structured_server.py", "test_vllm_struct_output_generate.py",
    "test_server_beam_search.py", "test_beam_search.py", "test_structured_spec_async_matrix.py",
    "test_fused_float_decode.py", "test_server_load.py", "test_chaos.py", "test_server_pooling.py",
    "test_suffix_decoding.py", "test_server_errors.py", "test_tool_calls_qwen3_server.py",
    "test_tool_calls_pythonic_server.py", "test_bad_words.py", "test_kv_16bit.py", "test_ray_backend.py",
    "test_vllm_llm_engine.py", "test_feature_combinations.py", "test_server_dp_deaths.py",
    "test_server_lifecycle.py", "test_async_engine.py", "test_async_spec_engine.py", "test_startup.py",
    "test_structured_outputs.py", "test_structured_spec_decode.py", "test_engine_start.py",
    "test_logits_processors.py", "test_rejection_sampler.py", "test_stat_logging.py", "test_vllm_context_length.py",
    "test_smollm2_greedy.py", "test_kv_offload_server.py", "test_reasoning_server.py",
    "test_default_quantization.py", "test_cpu_isa.py", "test_kv_int8.py", "test_server_api.py", "test_quant.py",
    "test_vllm_custom_logitsprocs.py", "test_single_stream_phases.py", "test_server_dp.py",
    "test_server_behaviours.py", "test_sim.py", "test_server_lora.py", "test_skip_tokenizer_init.py",
    "test_server_smollm2.py", "test_pooling.py", "test_server.py", "test_soak.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their own order

pytest_plugins = ["pytester"]  # tests/test_leak_check.py runs a planted leak through the real fixture

leak_check.install()


@pytest.fixture(autouse=True)
def engine_leak_check(request):
    """Fail the test that leaves an engine or server with requests, KV blocks or runner state behind."""
    yield
    if request.node.get_closest_marker("allow_leaks"):
        return
    problems = leak_check.collect_leaks()
    if problems:
        pytest.fail("the test left the engine dirty:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def transformers_default_model(request):
    """transformers' own GGUF loader over the default model, float32, eval mode: the reference four
    modules hold the engine to. Loaded once per run; the tests only read it.

    What that loader made is kept in pytest's cache directory (.pytest_cache, `--cache-clear` empties it),
    its config and tensors keyed by the GGUF's bytes and the transformers and torch versions: reading it
    back takes ~1 s where parsing and dequantizing the GGUF takes 10-14 s of a test worker, and the weights
    are the same tensors."""
    import hashlib
    import os
    import shutil
    import tempfile

    import torch
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from tokenloom.model.loader import resolve_model_path

    path = resolve_model_path(None)

    def from_the_gguf() -> Any:
        with _gguf_py_answers_shared():
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)

    if getattr(request.config, "cache", None) is None:  # -p no:cacheprovider: nowhere to keep it
        return from_the_gguf().eval()
    digest = hashlib.sha256(path.read_bytes())
    digest.update(f"{transformers.__version__} {torch.__version__}".encode())
    saved = request.config.cache.mkdir("transformers-default-model") / digest.hexdigest()[:16]
    if not (saved / "config.json").is_file():
        model = from_the_gguf()
        partial = tempfile.mkdtemp(dir=saved.parent)
        # save_pretrained refuses a model its GGUF loader made; its config and tensors (the tied embedding
        # once) read back through from_pretrained as the same float32 weights (checked: equal logits).
        model.config.save_pretrained(partial)
        save_model(model, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
        with contextlib.suppress(OSError):  # another worker saved it first: theirs is the same
            os.rename(partial, saved)
        if os.path.isdir(partial):
            shutil.rmtree(partial)
    model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    model.eval()
    return model


@contextlib.contextmanager
def _gguf_py_answers_shared():
    """transformers' GGUF loader parses the file with gguf-py twice (the config, then the weights: every
    field, 49k vocabulary strings and 48k merges, one numpy view each) and builds gguf-py's tensor-name map
    once per submodule (~400 times). Each gives the same answer every time: cached for this one load, it
    takes 10 s of CPU instead of 21 on this 2-core VM, the weights bit for bit the same (checked)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@pytest.fixture(scope="session")
def tiny_reasoning_model(tmp_path_factory):
    """tests/reasoning_models.py's tiny Qwen3 with Qwen3's reasoning tokens, made once per run (transformers'
    random initialisation and save take several seconds on 2 cores); the reasoning tests only read it."""
    from tests.reasoning_models import make_tiny_reasoning_model

    return make_tiny_reasoning_model(tmp_path_factory.mktemp("tiny-reasoning"))

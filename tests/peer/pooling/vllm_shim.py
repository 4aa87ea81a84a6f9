"""Plumbing that lets vLLM 0.32's pooling tests run against tokenloom: vLLM's test helpers' names and constructor
shapes over tokenloom's, never behaviour. Anything a test asserts is tokenloom's own answer.

    VllmRunner            vLLM's tests/conftest.py runner: a tokenloom.LLM of the named model's stand-in
    HfRunner              the reference: sentence-transformers' SentenceTransformer / CrossEncoder on the same files
    RemoteOpenAIServer    vLLM's tests/utils.py server: `tokenloom serve` of the stand-in (ServerProcess of
                          tests/test_server_harness.py), served under the test's name; vLLM's flags as tokenloom's
    ModelConfig           vLLM's ModelConfig for PoolingParams.verify: tokenloom's PoolingInfo of the stand-in
    get_tokenizer         the stand-in's tokenizer (transformers')

Models come from standins.py (the Hub is out of reach); `ROOT` is where they are built, set by conftest.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.peer.pooling import standins
from tests.peer.remote_openai import RemoteOpenAIClients
from tests.test_server_harness import ServerProcess
from tokenloom import LLM

ROOT: Path | None = None  # the session's stand-in directory (conftest.py)
ROCM_EXTRA_ARGS: list[str] = []  # vLLM's extra flags on ROCm; tokenloom runs on CPU (or CUDA)
_MINILM_NAMES = ("sentence-transformers/all-MiniLM-L12-v2", "sentence-transformers/all-MiniLM-L6-v2")


def model_path(name: str) -> Path:
    """The local directory standing in for a Hub model name."""
    if name in _MINILM_NAMES:  # the real all-MiniLM-L6-v2 (its package is a test extra) for its L12 sibling
        from tokenloom.model.loader import minilm_model_path

        return Path(minilm_model_path())
    assert ROOT is not None, "tests/peer/pooling/conftest.py sets the stand-ins' directory"
    return standins.build(name, ROOT)


class VllmRunner:
    """vLLM's VllmRunner as its pooling tests build it: `.llm` is a tokenloom.LLM of the stand-in. vLLM's GPU
    knobs are dropped (gpu_memory_utilization; enable_chunked_prefill=None, vLLM's "decide for me": tokenloom's
    encoders never chunk), the rest go to LLM as they are."""

    def __init__(self, model_name: str, runner: str = "auto", convert: str = "auto", seed: int = 0,
                 max_model_len: int | None = 1024, dtype: str = "auto", enforce_eager: bool = False,
                 tensor_parallel_size: int = 1, enable_chunked_prefill: bool | None = False,
                 gpu_memory_utilization: float | None = None, **kwargs: Any) -> None:
        del gpu_memory_utilization
        if enable_chunked_prefill is not None:
            kwargs["enable_chunked_prefill"] = enable_chunked_prefill
        if runner != "auto":
            kwargs["runner"] = runner
        if convert != "auto":
            kwargs["convert"] = convert
        self.llm = LLM(str(model_path(model_name)), seed=seed, max_model_len=max_model_len, dtype=dtype,
                       enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size, **kwargs)

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.llm.shutdown()


class HfRunner:
    """vLLM's HfRunner for pooling models: sentence-transformers' own load of the same files (float32, on CPU;
    vLLM's dtype argument is its GPU's)."""

    def __init__(self, model_name: str, dtype: str = "auto", *, is_sentence_transformer: bool = False,
                 is_cross_encoder: bool = False, **kwargs: Any) -> None:
        del dtype, kwargs
        path = str(model_path(model_name))
        if is_sentence_transformer:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(path, device="cpu")
        elif is_cross_encoder:
            from sentence_transformers import CrossEncoder

            self.model = CrossEncoder(path, device="cpu")
        else:
            raise NotImplementedError("the pooling tests' HfRunner is a sentence-transformers model")

    def encode(self, prompts: list[str], *args: Any, **kwargs: Any) -> Any:
        return self.model.encode(prompts, *args, **kwargs)

    def predict(self, prompts: list[list[str]], *args: Any, **kwargs: Any) -> Any:
        return self.model.predict(prompts, *args, convert_to_tensor=True, **kwargs)

    def __enter__(self) -> HfRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class ModelConfig:
    """vLLM's ModelConfig(model, ...) as test_pooling_params.py builds it: what PoolingParams.verify reads
    (pooler_config, embedding_size, is_matryoshka, matryoshka_dimensions, served_model_name) is tokenloom's
    PoolingInfo of the stand-in, read from the engine it builds."""

    def __new__(cls, model: str, **kwargs: Any) -> Any:
        del kwargs  # tokenizer, seed, dtype: the stand-in's own
        llm = LLM(str(model_path(model)), dtype="float32")
        try:
            return llm.llm_engine.pooling_info
        finally:
            llm.shutdown()


def get_tokenizer(tokenizer_name: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path(tokenizer_name)), local_files_only=True, **kwargs)


class RemoteOpenAIServer(RemoteOpenAIClients):
    """vLLM's tests/utils.py RemoteOpenAIServer over `tokenloom serve <stand-in>`: vLLM's flags with underscores
    read as dashes (its parser takes both), --hf-overrides among them; the model served under the test's name."""

    def __init__(self, model: str, vllm_serve_args: list[str], **unused: Any) -> None:
        path = model_path(model)
        args = translate_args(vllm_serve_args)
        log = Path(ROOT or ".") / f"server-{model.replace('/', '--')}.log"
        self.server = ServerProcess(str(path), *args, "--served-model-name", model, log_path=log)
        self.server.start()

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def translate_args(vllm_args: list[str]) -> list[str]:
    """vLLM's flags as `tokenloom serve` spells them (dashes; vLLM's parser reads underscores too)."""
    return ["--" + arg[2:].replace("_", "-") if arg.startswith("--") else arg for arg in vllm_args]


class _Platform:
    """vLLM's current_platform, as its tests probe it: tokenloom runs on CPU (or CUDA), never ROCm or XPU."""

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_xpu() -> bool:
        return False


current_platform = _Platform()
ChatCompletionMessageParam = dict[str, Any]  # vLLM's TypedDict union of chat messages: a dict here

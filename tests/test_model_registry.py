"""The family registry (tokenloom/model/models/registry.py): every architecture the config accepts has
a decoder layer, and a family's file is imported only when a model of that family loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenloom.model.config import SUPPORTED_ARCHITECTURES
from tokenloom.model.layers import LlamaDecoderLayer
from tokenloom.model.models.registry import DECODER_LAYERS, decoder_layer_class


def test_every_supported_architecture_has_a_decoder_layer() -> None:
    assert set(DECODER_LAYERS) == set(SUPPORTED_ARCHITECTURES)
    for arch in SUPPORTED_ARCHITECTURES:
        assert issubclass(decoder_layer_class(arch), LlamaDecoderLayer), arch


def test_families_that_differ_only_by_config_share_the_llama_layer() -> None:
    for arch in ("llama", "qwen2", "mistral", "phi3"):
        assert decoder_layer_class(arch) is LlamaDecoderLayer
    assert decoder_layer_class("gemma3").__name__ == "Gemma3DecoderLayer"
    assert not decoder_layer_class("mixtral").int8_supported and not decoder_layer_class("qwen3_moe").int8_supported
    assert decoder_layer_class("qwen3").int8_supported


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no decoder layer registered for architecture 'gpt2'"):
        decoder_layer_class("gpt2")


def test_family_files_are_imported_on_first_use() -> None:
    code = ("import sys\n"
            "from tokenloom.model.decoder_model import DecoderModel\n"
            "from tokenloom.model.models.registry import decoder_layer_class\n"
            "families = [m for m in sys.modules if m.startswith('tokenloom.model.models.') and m != "
            "'tokenloom.model.models.registry']\n"
            "assert families == [], families\n"
            "decoder_layer_class('gemma2')\n"
            "assert 'tokenloom.model.models.gemma' in sys.modules\n"
            "assert 'tokenloom.model.models.mixtral' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)

"""Local stand-ins for the Hub models vLLM's pooling tests name (this machine has no Hub access), built once per
session: same architecture family, same embedding size, same label names, random weights (the tests compare
tokenloom with sentence-transformers / transformers on the same files, never with the named model's numbers).

    intfloat/multilingual-e5-small        XLMRobertaModel, mean pooling + Normalize (sentence-transformers files),
                                          a Dense 16 -> 384 so its embeddings have e5-small's 384 components;
                                          XLM-R's 250,002-row vocabulary and 514 positions
    BAAI/bge-reranker-base                XLMRobertaForSequenceClassification, one label (a cross-encoder)
    BAAI/bge-base-en-v1.5                 BertModel, CLS pooling + Normalize, a Dense 32 -> 768 (its 768 components)
    Snowflake/snowflake-arctic-embed-m-v1.5   BertModel, CLS + Normalize, 768 components, matryoshka_dimensions
                                          [256] in config.json (what vLLM reads; the test's --hf-overrides says the
                                          same)
    tomaarsen/Qwen3-Reranker-0.6B-seq-cls BertForSequenceClassification, one label: a cross-encoder (tokenloom
                                          runs BERT / RoBERTa cross-encoders, not decoder classification heads)
    jason9693/Qwen2.5-1.5B-apeach         BertForSequenceClassification over Qwen2.5's vocabulary, two labels
                                          "Default" / "Spoiled", a tokenizer that gives Qwen2.5's ids for the tests'
                                          texts, a plain chat template (the same substitution: tokenloom runs no
                                          decoder classification heads)
    sentence-transformers/all-MiniLM-L12-v2   all-MiniLM-L6-v2, the real model (its package is a test extra)

The XLM-R stand-ins share a tokenizer that tokenizes the tests' texts as XLM-R's does: the token ids the tests
list are XLM-R's ids for their pieces ("The" 581, "▁v" "LL" "M" for "vLLM"), each other word of the vendored
files' texts is one piece, and "feline", "Stars", "twinkle", "brightly" are two pieces each, as in XLM-R, which
makes the tests' chat 33 tokens. A WordPiece tokenizer (case kept, punctuation split off, XLM-R's <s> A </s></s>
B </s> template) with every letter as a fallback piece, so any other text tokenizes too. The Qwen2.5 stand-in's
tokenizer is built the same way from Qwen2.5's ids (no special tokens added, as Qwen2.5's adds none).
"""

from __future__ import annotations

import ast
import json
import string
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

# XLM-R's ids for the pieces of the texts the tests list token ids for (their order is the tests' order).
_XLMR_PIECES = {
    "<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, ".": 5, "##s": 7, "de": 8, "a": 10,
    # "The chef prepared a delicious meal."
    "The": 581, "chef": 21861, "prepared": 133888, "##li": 150, "##cious": 60744, "meal": 109911,
    # "The best thing about vLLM is that it supports many different models"
    "best": 2965, "thing": 13580, "about": 1672, "v": 81, "##LL": 23708, "##M": 594, "is": 83, "that": 450,
    "it": 442, "support": 8060, "many": 5941, "different": 12921, "models": 115774,
    # "This product was excellent and exceeded my expectations"
    "This": 3293, "product": 12996, "was": 509, "excellent": 40881, "and": 136, "exceed": 204839, "##ed": 297,
    "my": 759, "expectations": 202702,
    "<mask>": 250001,
}
# Words XLM-R cuts in two (the tests' chat: 33 tokens).
_XLMR_SPLITS = {"feline": ("fel", "##ine"), "Stars": ("Star", "##s"), "twinkle": ("twin", "##kle"),
                "brightly": ("bright", "##ly"), "delicious": ("de", "##li", "##cious"), "vLLM": ("v", "##LL", "##M"),
                "supports": ("support", "##s"), "exceeded": ("exceed", "##ed")}
XLMR_VOCAB_SIZE = 250002


def _test_words() -> set[str]:
    """Every word of the string constants in the vendored files (and their texts' punctuation split off)."""
    words: set[str] = set()
    for path in HERE.glob("test_vllm_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 5000:
                for raw in node.value.split():
                    words.update(w for w in "".join(c if c.isalnum() else " " for c in raw).split() if w)
    return words


def mimic_tokenizer(out: Path, pieces: dict[str, int], splits: dict[str, tuple[str, ...]], free_ids: range,
                    specials: dict[str, str], post: tuple[str, str] | None) -> Any:
    """A WordPiece tokenizer that cuts the tests' texts as the named model's tokenizer does: `pieces` at the
    named tokenizer's ids, `splits` for words it cuts, every other word of the vendored files' texts one piece,
    letters as the fallback; case kept, punctuation split off; `post`: the (single, pair) template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = dict(pieces)
    free = iter(free_ids)
    parts = [p for cut in splits.values() for p in cut]
    letters = list(string.ascii_letters + string.digits + string.punctuation) + ["ñ", "ã", "ç", "é", "í", "ó"]
    for word in sorted(_test_words() - set(splits)) + parts + letters + ["##" + c for c in letters]:
        if word not in vocab:
            vocab[word] = next(free)
    tok = Tokenizer(models.WordPiece(vocab, unk_token=specials["unk_token"], max_input_chars_per_word=200))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    if post is not None:
        ids = {t: vocab[t] for t in (specials["bos_token"], specials["eos_token"])}
        tok.post_processor = processors.TemplateProcessing(single=post[0], pair=post[1],
                                                           special_tokens=list(ids.items()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512,
                                   model_input_names=["input_ids", "attention_mask"], **specials)
    fast.save_pretrained(out)
    return fast


def xlmr_tokenizer(out: Path) -> Any:
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
                "cls_token": "<s>", "pad_token": "<pad>", "mask_token": "<mask>"}
    return mimic_tokenizer(out, _XLMR_PIECES, _XLMR_SPLITS, range(230000, XLMR_VOCAB_SIZE - 1), specials,
                           ("<s> $A </s>", "<s> $A </s> </s> $B </s>"))


# Qwen2.5's ids for the classification tests' texts (Qwen2's byte-level BPE: a word and its leading space are one
# piece; no special tokens are added to a prompt).
_QWEN_PIECES = {
    "<|endoftext|>": 151643, ".": 13,
    "The": 785, "chef": 29706, "prepared": 10030, "a": 264, "delicious": 17923, "meal": 15145,
    "This": 1986, "product": 1985, "was": 572, "excellent": 9073, "and": 323, "exceeded": 33808, "my": 847,
    "expectations": 16665,
}
QWEN_VOCAB_SIZE = 151936


def qwen_tokenizer(out: Path) -> Any:
    specials = {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>"}
    return mimic_tokenizer(out, _QWEN_PIECES, {}, range(140000, 151643), specials, None)


def _random_weights(model_cls: Any, config: Any, out: Path, seed: int) -> None:
    """The model's weights, random (normal, LayerNorm weights around 1), written without running transformers'
    initialisation (slow for a 250,002-row table): the architecture on the meta device gives names and shapes."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = model_cls(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if "LayerNorm.weight" in name:
            state[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif "position_ids" in name or "token_type_ids" in name:
            continue
        else:
            state[name] = 0.2 * torch.randn(p.shape, generator=gen)
    config.architectures = [model_cls.__name__]
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def add_sentence_transformers_files(path: Path, hidden: int, pooling: str, dense_out: int | None,
                                    max_seq_length: int, seed: int) -> None:
    """modules.json (Transformer, Pooling, a Dense projection, Normalize), as sentence-transformers saves them."""
    from safetensors.torch import save_file

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_cls_token": pooling == "cls"}))
    if dense_out is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        (path / "2_Dense").mkdir(exist_ok=True)
        (path / "2_Dense" / "config.json").write_text(json.dumps({
            "in_features": hidden, "out_features": dense_out, "bias": True,
            "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": torch.randn(dense_out, hidden, generator=gen) * 0.3,
                   "linear.bias": torch.randn(dense_out, generator=gen) * 0.1},
                  str(path / "2_Dense" / "model.safetensors"))
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (path / modules[-1]["path"]).mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                               "do_lower_case": False}))


def _xlmr(out: Path, classifier: bool, seed: int) -> Path:
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    xlmr_tokenizer(out)
    config = tf.XLMRobertaConfig(vocab_size=XLMR_VOCAB_SIZE, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, max_position_embeddings=514,
                                 type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=1)
    cls = tf.XLMRobertaForSequenceClassification if classifier else tf.XLMRobertaModel
    _random_weights(cls, config, out, seed)
    return out


def _bert(out: Path, seed: int, **kwargs: Any) -> Path:
    from tests.pooling_models import make_tiny_bert

    path = make_tiny_bert(out, seed=seed, max_position_embeddings=512, **kwargs)
    return path


def build(name: str, root: Path) -> Path:
    """The stand-in directory of a Hub model name (built under `root` the first time)."""
    out = root / name.replace("/", "--")
    if (out / "done").is_file():
        return out
    if name == "intfloat/multilingual-e5-small":
        _xlmr(out, classifier=False, seed=1)
        add_sentence_transformers_files(out, 16, "mean", 384, 512, seed=1)
    elif name == "BAAI/bge-reranker-base":
        _xlmr(out, classifier=True, seed=2)
    elif name in ("BAAI/bge-base-en-v1.5", "Snowflake/snowflake-arctic-embed-m-v1.5"):
        matryoshka = name.startswith("Snowflake")
        # bge-base's seed: random weights rank the tests' Paris document decisively below the Brazil one (0.83
        # against 0.92), so the cases that want a real model's ranking fail by far, not by a rounding
        # (docs/vllm_peer.md, "Pooling").
        path = _bert(out, seed=4 if matryoshka else 14, **({"matryoshka_dimensions": [256]} if matryoshka else {}))
        add_sentence_transformers_files(path, 32, "cls", 768, 512, seed=3)
        out = path
    elif name == "tomaarsen/Qwen3-Reranker-0.6B-seq-cls":
        out = _bert(out, seed=5, classifier=True, num_labels=1)
    elif name == "jason9693/Qwen2.5-1.5B-apeach":
        _qwen_classifier(out, seed=6)
    else:
        raise KeyError(f"no local stand-in for {name!r} (tests/peer/pooling/standins.py)")
    (out / "done").write_text("")
    return out


# The classifier's chat template: vLLM's tests' DUMMY_CHAT_TEMPLATE with a generation prompt (Qwen2.5's ChatML
# template writes a system prompt of its own, whose tokens the stand-in does not have).
CHAT_TEMPLATE = ("{% for message in messages %}{{message['role'] + ': ' + message['content'] + '\\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{'assistant:'}}{% endif %}")


def _qwen_classifier(out: Path, seed: int) -> Path:
    """Qwen2.5-1.5B-apeach's stand-in: a BERT classifier (two labels, Default / Spoiled) over Qwen2.5's
    vocabulary, with a tokenizer that gives Qwen2.5's ids for the tests' texts (and adds no special tokens)."""
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    qwen_tokenizer(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    config = tf.BertConfig(vocab_size=QWEN_VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=512, type_vocab_size=2, num_labels=2,
                           id2label={0: "Default", 1: "Spoiled"}, label2id={"Default": 0, "Spoiled": 1},
                           pad_token_id=151643)
    _random_weights(tf.BertForSequenceClassification, config, out, seed)
    return out

"""Tiny random BERT encoders (embedding and cross-encoder) for the pooling tests, saved as Hugging Face
directories with a WordPiece tokenizer, plus the sentences and the all-MiniLM-L6-v2 locator."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "quick", "brown", "fox", "jumps", "over", "lazy",
         "hello", "world", "model", "vector", "search", "query", "document", "paris", "france", "capital",
         "city", "is", "of", "what", "where", "berlin", "germany", "river", "sun", "moon"]

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Hi",
    "ok",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France, with an estimated population of 2,102,650 "
    "residents in January 2023 in an area of more than 105 km2.",
    "Berlin is the capital and largest city of Germany, both by area and by population.",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors so that similar meanings land close together.",
    "Retrieval-augmented generation looks documents up before answering.",
    "naïve café — ünïcödé and emoji 😀 mixed in",
    "1234567890",
    "SELECT * FROM users WHERE id = 42;",
] + [f"Sentence number {i} talks about {w} and more {w}s, " * (1 + i % 4) for i, w in
     enumerate(("cats", "dogs", "rivers", "mountains", "databases", "compilers", "schedulers", "tokens", "gpus",
                "cpus", "clouds", "trains", "planes", "books", "songs", "films", "games", "cities", "stars",
                "oceans", "forests", "deserts", "islands", "bridges", "castles", "robots", "engines", "poems",
                "maps", "clocks", "lamps", "chairs"))]


def minilm_available() -> bool:
    return (importlib.util.find_spec("all_minilm_l6_v2") is not None
            and importlib.util.find_spec("sentence_transformers") is not None)


def _tokenizer(out: Path) -> Any:
    """A lower-casing WordPiece tokenizer over WORDS and letters, BERT's [CLS] a [SEP] b [SEP] template
    (token type 1 for the pair's second text)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
                               + list("abcdefghijklmnopqrstuvwxyz.,?!")))
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
                                   pad_token="[PAD]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    fast.save_pretrained(out)
    return fast


def make_tiny_bert(tmp_path: Path, classifier: bool = False, num_labels: int = 3, seed: int = 0,
                   sentence_transformers_pooling: str | None = None, **overrides: Any) -> Path:
    """A random tiny BertModel (or BertForSequenceClassification) with every weight random; with
    `sentence_transformers_pooling` ("mean" | "cls"), the sentence-transformers files too."""
    import transformers as tf

    out = Path(tmp_path) / f"tiny-bert-{'cls' if classifier else 'emb'}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out)
    config = tf.BertConfig(**{"vocab_size": len(tok), "hidden_size": 32, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
                              "type_vocab_size": 2, "num_labels": num_labels, **overrides})
    model = (tf.BertForSequenceClassification if classifier else tf.BertModel)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.1 if "LayerNorm" in name else 0.2, generator=gen)
    model.save_pretrained(out, safe_serialization=True)
    if sentence_transformers_pooling:
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]))
        (out / "1_Pooling").mkdir(exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 32,
            "pooling_mode_mean_tokens": sentence_transformers_pooling == "mean",
            "pooling_mode_cls_token": sentence_transformers_pooling == "cls",
        }))
    return out


def _roberta_tokenizer(out: Path) -> Any:
    """A WordPiece tokenizer with RoBERTa's specials and ids (<s> 0, <pad> 1, </s> 2, <unk> 3) and its
    templates (<s> A </s>; <s> A </s></s> B </s>), no token type ids (RoBERTa has one type)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = list(dict.fromkeys(["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + WORDS
                               + list("abcdefghijklmnopqrstuvwxyz.,?!")))
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", pad_token="<pad>", mask_token="<mask>",
                                   model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(out)
    return fast


def make_tiny_roberta(tmp_path: Path, classifier: bool = False, num_labels: int = 1, seed: int = 0,
                      xlm: bool = True) -> Path:
    """A random tiny XLMRobertaModel / XLMRobertaForSequenceClassification (or the Roberta* ones): the
    architecture of bge-m3, multilingual-e5 and the bge rerankers, every weight random."""
    import transformers as tf

    out = Path(tmp_path) / f"tiny-{'xlm-' if xlm else ''}roberta-{'cls' if classifier else 'emb'}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    tok = _roberta_tokenizer(out)
    config_cls = tf.XLMRobertaConfig if xlm else tf.RobertaConfig
    # RoBERTa's table holds padding_idx + 1 unused rows before position 0: 66 rows serve 64 tokens.
    config = config_cls(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, num_labels=num_labels)
    if classifier:
        model_cls = tf.XLMRobertaForSequenceClassification if xlm else tf.RobertaForSequenceClassification
    else:
        model_cls = tf.XLMRobertaModel if xlm else tf.RobertaModel
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.1 if "LayerNorm" in name else 0.2, generator=gen)
    model.save_pretrained(out, safe_serialization=True)
    return out


def add_st_dense(path: Path, layers: list[tuple[int, int, str]], normalize: bool = True, seed: int = 0) -> None:
    """Turn a tiny BERT saved with sentence-transformers mean pooling into one with Dense projection
    modules after the pooling ((in, out, activation class path) each, random weights) and a Normalize."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    modules = json.loads((path / "modules.json").read_text())[:2]
    for i, (fan_in, fan_out, act) in enumerate(layers):
        folder = f"{2 + i}_Dense"
        (path / folder).mkdir(exist_ok=True)
        (path / folder / "config.json").write_text(json.dumps({
            "in_features": fan_in, "out_features": fan_out, "bias": True, "activation_function": act}))
        save_file({"linear.weight": torch.randn(fan_out, fan_in, generator=gen) * 0.3,
                   "linear.bias": torch.randn(fan_out, generator=gen) * 0.1}, str(path / folder / "model.safetensors"))
        modules.append({"idx": 2 + i, "name": str(2 + i), "path": folder, "type": "sentence_transformers.models.Dense"})
    if normalize:
        folder = f"{2 + len(layers)}_Normalize"
        (path / folder).mkdir(exist_ok=True)
        modules.append({"idx": 2 + len(layers), "name": str(2 + len(layers)), "path": folder,
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))

"""Tiny random Llama / Qwen2 models for tests, as Hugging Face directories and as GGUF files.

`make_tiny_hf_model` saves a randomly initialised transformers model (plus a tiny byte-level BPE
tokenizer with a ChatML template) the way `save_pretrained` does; `write_gguf_from_hf` rewrites such a
directory as a GGUF the way llama.cpp's `convert_hf_to_gguf.py` does: its tensor names and metadata keys,
1-D tensors kept in F32, and the q/k row permutation it applies to Llama models. Nothing here uses
tokenloom's loader, so tests can hold the loader against an independent writer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

TINY_VOCAB = 320
TINY_HIDDEN = 64
TINY_INTERMEDIATE = 128
TINY_LAYERS = 2
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_MAX_POSITIONS = 256

# Same special-token layout as SmolLM2: <|endoftext|>=0, <|im_start|>=1 (BOS), <|im_end|>=2 (EOS).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a tiny model that could only count: one, two, three, four, five.",
    "def main():\n    print('hello')\n    return 0\n",
    "naïve café — 日本語のテキスト 😀 emoji and ünïcödé",
] * 4

_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def make_tiny_tokenizer() -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` over TINY_VOCAB ids with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
    )


# What each family's tiny model sets beyond the shared sizes: a sliding window of 8 tokens (two
# blocks of 4) where the family has one, Gemma's alternating sliding/global layers, 4 experts top-2.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=8, head_dim=16),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "gemma2": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"]),
    "gemma3": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(),
}


def make_tiny_hf_model(
    tmp_path: str | Path, arch: str = "llama", tie: bool = False, seed: int = 0, **config_overrides: Any
) -> Path:
    """Save a random tiny `arch` ("llama" | "qwen2") model with tokenizer under `tmp_path`; return the dir.

    Every parameter (norms and biases included) is random, so a tensor loaded into the wrong slot shows.
    `config_overrides` go to the transformers config (e.g. `rope_scaling`, `num_hidden_layers`).
    """
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
               "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
               "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
               "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM), "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM)}
    config_cls, model_cls = classes[arch]
    config = config_cls(**{
        "vocab_size": TINY_VOCAB,
        "hidden_size": TINY_HIDDEN,
        "intermediate_size": TINY_INTERMEDIATE,
        "num_hidden_layers": TINY_LAYERS,
        "num_attention_heads": TINY_HEADS,
        "num_key_value_heads": TINY_KV_HEADS,
        "max_position_embeddings": TINY_MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        **FAMILY_DEFAULTS.get(arch, {}),
        **config_overrides,  # any of the above too (num_hidden_layers, ...)
    })
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by (1 + w): centre those at 0
                param.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.1, generator=gen)
            else:
                param.normal_(0.0, 0.05, generator=gen)
    out = Path(tmp_path) / f"tiny-{arch}{'-tied' if tie else ''}-s{seed}"
    model.save_pretrained(out, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(out)
    # Load it once, as a user's first start would: AutoTokenizer's pick is recorded, so the servers and
    # engine processes the tests start read it as later starts do (tests/test_startup.py covers both).
    from tokenloom.model.tokenizer import load_tokenizer

    load_tokenizer(out)
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# convert_hf_to_gguf.py's architecture names and the tensor names its families add or rename.
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "mixtral": "llama"}  # Mixtral: llama + experts
_GGUF_FAMILY_BLOCK = {
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GGUF_GEMMA_BLOCK = {"pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_attention_layernorm.weight": "post_attention_norm.weight"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """HF tensor name -> llama.cpp tensor name."""
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    if arch.startswith("gemma") and rest in _GGUF_GEMMA_BLOCK:
        return f"blk.{layer}.{_GGUF_GEMMA_BLOCK[rest]}"
    return f"blk.{layer}.{_GGUF_FAMILY_BLOCK.get(rest) or _GGUF_BLOCK[rest]}"


def _stack_experts(tensors: dict[str, torch.Tensor], num_layers: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors -> llama.cpp's stacked ffn_{gate,up,down}_exps (what the converter writes)."""
    mixtral = any(".block_sparse_moe." in n for n in tensors)
    out = {n: t for n, t in tensors.items() if ".experts." not in n}
    if mixtral:  # the router too: block_sparse_moe.gate -> ffn_gate_inp
        out = {n.replace(".block_sparse_moe.gate.", ".mlp.gate."): t for n, t in out.items()}
    for i in range(num_layers):
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            mx = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
            names = [f"model.layers.{i}.block_sparse_moe.experts.{j}.{mx}.weight" if mixtral else
                     f"model.layers.{i}.mlp.experts.{j}.{proj}.weight" for j in range(num_experts)]
            out[f"blk.{i}.ffn_{short}_exps.weight"] = torch.stack([tensors[n] for n in names])
    return out


def write_gguf_from_hf(hf_dir: str | Path, out_path: str | Path, qtype: str = "F32") -> Path:
    """Write the model in `hf_dir` as a GGUF at `out_path`, 2-D weights stored as `qtype`.

    `qtype` is any type `gguf.quants.quantize` can produce (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, ...), or
    IQ4_NL (quantize_iq4_nl).
    The tokenizer, if the directory has one, goes in as llama.cpp's "gpt2" (byte-level BPE) metadata.
    """
    from safetensors.torch import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCH.get(cfg["model_type"], cfg["model_type"])
    writer = gguf.GGUFWriter(str(out_path), arch)
    _write_model_metadata(writer, cfg, hf_dir.name)
    if (hf_dir / "tokenizer.json").is_file():
        _write_tokenizer_metadata(writer, hf_dir)

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if arch == "qwen3moe" or cfg["model_type"] == "mixtral":
        tensors = _stack_experts(tensors, cfg["num_hidden_layers"], cfg.get("num_experts") or cfg["num_local_experts"])
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma converters store 1 + w
        if name.startswith("blk."):  # already llama.cpp-named (stacked experts)
            _add_tensor(writer, name, data, qtype)
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):  # Mixtral's too
            data = llama_cpp_permute(data, heads, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_cpp_permute(data, heads, kv_heads)
        _add_tensor(writer, gguf_name(name, arch), data, qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _write_model_metadata(writer: gguf.GGUFWriter, cfg: dict[str, Any], name: str) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in rope:  # Gemma 3: per layer type; the local base has its own key
        writer.add_float32(f"{writer.arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
    writer.add_name(name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope.get("rope_type", rope.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if cfg.get("sliding_window") and cfg["model_type"] not in ("mistral", "mixtral"):  # llama.cpp keeps none
        writer.add_sliding_window(cfg["sliding_window"])
    if cfg["model_type"] == "gemma3_text":  # one bool per layer: sliding or not
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if cfg.get("attn_logit_softcapping") is not None:
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg["model_type"] == "mixtral":
        writer.add_expert_count(cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg["model_type"] == "qwen3_moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_expert_weights_norm(cfg["norm_topk_prob"])
    if cfg.get("bos_token_id") is not None:
        writer.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        writer.add_eos_token_id(cfg["eos_token_id"])


def _write_tokenizer_metadata(writer: gguf.GGUFWriter, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    config = _tokenizer_config(hf_dir)
    for key, add_id in (("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        if config.get(key) in vocab:
            add_id(vocab[config[key]])
    # Recent transformers save the template to its own file; older versions inline it in the config.
    template_file = hf_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if template:
        writer.add_chat_template(template)


def _tokenizer_config(hf_dir: Path) -> dict[str, Any]:
    config_file = hf_dir / "tokenizer_config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


# IQ4_NL's 16 levels (ggml's kvalues_iq4nl).
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_iq4_nl(data: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks (gguf.quants has no IQ quantizer): per 32 values d = x[argmax |x|] / -127 and each
    value the nearest level (ggml's first guess, without its search for a better d). uint8 [..., bytes]."""
    x = data.reshape(-1, 32).astype(np.float32)
    amax = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]
    d = (amax / -127.0).astype(np.float16)
    inv = np.where(d != 0, 1.0 / d.astype(np.float32), 0.0)
    q = np.abs(x[:, :, None] * inv[:, None, None] - IQ4_NL_LEVELS).argmin(axis=2).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)  # element j: low nibble of byte j, j + 16: its high nibble
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1)
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // 32 * 18)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: str) -> None:
    # Like llama.cpp, keep 1-D tensors (norms, biases) in F32 whatever the file type.
    ggml_type = gguf.GGMLQuantizationType[qtype] if data.ndim > 1 else gguf.GGMLQuantizationType.F32
    if ggml_type == gguf.GGMLQuantizationType.IQ4_NL:
        writer.add_tensor(name, quantize_iq4_nl(data), raw_dtype=ggml_type)
    elif ggml_type == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif ggml_type == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, ggml_type), raw_dtype=ggml_type)


def reference_logprobs(hf_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' own fp32 logits for `token_ids`: row i is the distribution of token
    i + 1 (the reference for the logprobs tokenloom reports)."""
    model = _reference_model(str(hf_dir))
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@functools.lru_cache(maxsize=2)
def _reference_model(hf_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()

"""LoRA on the network's linears: which base linear each PEFT target lives in, and the manager over them.

The network fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (tokenloom/model/llama.py);
a PEFT adapter targets the unfused modules. Each fused linear gets one `LoRALinear` whose slices
name the modules in its output order, so an adapter's q, k and v deltas land in their columns of
the fused output (tokenloom/lora/models.py stacks them for one shrink and one expand).

The delta is added after the base linear's GEMM, whatever its method: float (oneDNN packed or not),
int8 W8A8 (the adapter reads the activation the GEMM read, dequantized) or GGUF blocks. A step that
holds an adapter row runs per op: the fused decode step (fused_decode.py) has no LoRA; steps of
base-only requests keep it.
"""

from __future__ import annotations

from typing import Any

from tokenloom.lora.models import LoRALinear, LoRAModelManager
from tokenloom.lora.punica import PunicaWrapperCPU
from tokenloom.model.lora_kernels import lora_kernels

# Families whose layers are the Llama layer's linears (q/k/v, o, gate/up, down) with the Llama
# attention (which narrows the LoRA mapping to the last layer's output rows).
LORA_ARCHITECTURES = ("llama", "qwen2")


def check_lora_model(architecture: str) -> None:
    if architecture not in LORA_ARCHITECTURES:
        raise ValueError(f"LoRA adapters are supported on {', '.join(LORA_ARCHITECTURES)} models; "
                         f"{architecture} is not supported yet")


def create_lora_manager(model: Any, lora_config: Any) -> LoRAModelManager:
    """Attach a LoRALinear to every target linear of `model` (a LlamaModel) and return the manager.
    `lora_config`: tokenloom.config.LoRAConfig (max_loras, max_lora_rank, max_cpu_loras)."""
    config = model.config
    check_lora_model(config.architecture)
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    target_shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
                     "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                     "down_proj": (inter, hidden)}
    slices = {"qkv_proj": [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)],
              "o_proj": [("o_proj", hidden)],
              "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
              "down_proj": [("down_proj", hidden)]}
    # The compiled kernel runs the small (decode-sized) adapter groups of each linear in one call.
    kernel = lora_kernels() if model.device.type == "cpu" else None
    punica = PunicaWrapperCPU(model.device, kernel)
    lora_linears = []
    for i, layer in enumerate(model.layers):
        for name, lin in layer.linears().items():
            lin.lora = LoRALinear(punica, i, slices[name], *lin.lora_scales)
            lora_linears.append(lin.lora)
    model.lora_punica = punica
    return LoRAModelManager(lora_linears, punica, num_layers=config.num_hidden_layers, target_shapes=target_shapes,
                            max_loras=lora_config.max_loras, max_lora_rank=lora_config.max_lora_rank,
                            max_cpu_loras=lora_config.max_cpu_loras, dtype=model.dtype, device=model.device)

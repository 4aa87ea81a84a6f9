"""Everything that touches torch lives here and nowhere above it.

loader.py (find a model, load and check its weights) with gguf.py (GGUF parser and dequantizers) and
hf.py (Hugging Face safetensors directories); platform.py (device, dtype, CPU threads); config.py
(ModelConfig); decoder_model.py (the network, every family) with layers.py (its blocks) and models/
(one file per family, registry.py naming them); execution_plan.py (which path runs, chosen once at
load: fused_decode.py's fused decode step, oneDNN pre-packing, the KV layout); attention.py (paged KV
cache and attention); kernels.py + csrc/ (compiled CPU kernels); quant.py (int8 W8A8 layers);
sampler.py (with the custom logits processors of tokenloom/sample, over input_batch.py's persistent batch);
tokenizer.py; runner.py (ModelRunner: SchedulerOutput in, sampled tokens out). The GEMM
row buckets (packed_rows, tokenloom/core/gemm_rows.py) sit below, shared with the cost model that
charges them.

May import: tokenloom.config, tokenloom.sampling_params, tokenloom.core (its output types), tokenloom.sample
(the logits processor interface). Never
engine, server or anything above.
"""

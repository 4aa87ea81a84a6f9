"""Pooling in the runners: the encoder runner (BERT-style models, no KV cache) and the pooling of a
decoder's hidden states (ModelRunner with a pooler config), both answering `pooler_output`.

EncoderRunner.execute_model takes the scheduler's step like ModelRunner does, but every request in
it is new and computed whole (the engine turns chunked prefill off for encoders, as vLLM does:
attention is bidirectional, a chunk cannot see the tokens after it). It runs the encoder over the
step's sequences flattened, pools each one and reports it in `ModelRunnerOutput.pooler_output`; the
scheduler then finishes the request and frees its blocks (the blocks are the scheduler's accounting
of the token budget's memory only: no KV is written).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tokenloom import envs
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.model.bert import BertEncoder, load_bert
from tokenloom.model.platform import configure_cpu_threads, resolve_device, resolve_dtype
from tokenloom.model.pooler import (
    PoolingType,
    ResolvedPooler,
    classify_activation,
    embed_head,
    pool_rows,
    step_select,
    to_output,
)
from tokenloom.pooling_params import PoolingParams


def pool_request(rows: torch.Tensor, token_ids: list[int], params: PoolingParams, pooler: ResolvedPooler,
                 classify: Any = None, activation: str | None = None) -> Any:
    """One request's output from its hidden states [L, H] (all its rows; for LAST pooling the last
    row suffices). `classify`: the model's classification head ([N, H] -> [N, labels]), if it has one."""
    task = params.task or "embed"
    ptype = pooler.pooling_type_for(task)
    if task in ("classify", "token_classify"):
        if classify is None:
            raise ValueError(f"task {task!r} needs a classification head; this model has none")
        if ptype in (PoolingType.ALL, PoolingType.STEP):
            logits = classify(rows)
        else:
            logits = classify(pool_rows(rows, ptype).unsqueeze(0))[0]
        logits = pooler.calibrate(logits.float())
        out = classify_activation(logits, activation) if params.use_activation else logits
        if ptype is PoolingType.STEP:
            out = step_select(out, token_ids, params)
        return to_output(out)
    pooled = pool_rows(rows, ptype)
    if ptype is PoolingType.STEP:
        pooled = step_select(pooled, token_ids, params)
    # vLLM's heads project every row with the sentence-transformers Dense modules, token_embed's too (its
    # TokenEmbeddingPoolerHead), then cut and normalise each; rows cut to returned_token_ids' columns are no
    # hidden states to project.
    projectable = not (ptype is PoolingType.STEP and params.returned_token_ids)
    return to_output(embed_head(pooled, params, pooler.dense if projectable else None))


class EncoderRunner:
    """The runner of an encoder-only pooling model; same interface as ModelRunner.execute_model."""

    def __init__(self, path: Path, pooler: ResolvedPooler, *, block_size: int, num_blocks: int,
                 dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
                 loaded: tuple[Any, dict[str, torch.Tensor]] | None = None) -> None:
        if envs.VLLM_BATCH_INVARIANT:  # the encoder's GEMMs are oneDNN's, which pick kernels by row count
            raise ValueError("VLLM_BATCH_INVARIANT=1 does not cover encoder-only models (BERT family) yet: "
                             "their GEMMs need not sum a row alike at every batch size")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cpu":
            configure_cpu_threads()
        config, weights = loaded if loaded is not None else load_bert(path, self.dtype)
        self.model_config = config
        self.model = BertEncoder(config, weights, self.device, self.dtype)
        self.pooler = pooler
        self.block_size, self.num_blocks = block_size, num_blocks
        self.requests: dict[str, Any] = {}  # no per-request state survives a step (executor.reset clears it)
        self.spec_decode = None
        self.vocab_size = config.vocab_size

    def take_draft_token_ids(self) -> None:
        return None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        so = scheduler_output
        failed: dict[str, str] = {}
        for req_id in so.scheduled_cached_reqs.req_ids:
            failed[req_id] = (f"request {req_id!r} is scheduled in chunks; an encoder computes a prompt in one "
                              "step (chunked prefill must be off)")
        batch = []
        max_pos = self.model_config.max_positions
        for new in so.scheduled_new_reqs:
            n = so.num_scheduled_tokens.get(new.req_id, 0)
            tokens = new.prefill_token_ids
            if new.pooling_params is None:
                failed[new.req_id] = "a generation request reached a pooling model"
            elif new.num_computed_tokens != 0 or n != len(tokens):
                failed[new.req_id] = (f"request {new.req_id!r}: an encoder computes its {len(tokens)}-token prompt "
                                      f"in one step, not tokens [{new.num_computed_tokens}, "
                                      f"{new.num_computed_tokens + n})")
            elif len(tokens) > max_pos:
                failed[new.req_id] = f"prompt of {len(tokens)} tokens exceeds the model's {max_pos} positions"
            elif min(tokens) < 0 or max(tokens) >= self.vocab_size:
                failed[new.req_id] = f"token id out of range [0, {self.vocab_size}) in request {new.req_id!r}"
            else:
                batch.append(new)
        pooled: dict[str, Any] = {}
        if batch:
            with torch.inference_mode():
                pooled = self._run(batch)
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[] for _ in req_ids],
            failed=failed,
            execute_time=time.perf_counter() - t0,
            pooler_output=pooled,
        )

    def _run(self, batch: list[Any]) -> dict[str, Any]:
        # Sorted by length: the encoder attends each run of equal lengths as one batch (bert.py).
        batch = sorted(batch, key=lambda new: len(new.prefill_token_ids))
        ids: list[int] = []
        positions: list[int] = []
        types: list[int] = []
        lens = []
        cfg = self.model_config
        for new in batch:
            tokens = new.prefill_token_ids
            n = len(tokens)
            ids.extend(tokens)
            positions.extend(cfg.position_ids(tokens))
            # Cross-encoder pairs: the second text's token type is 1 from this index on (vLLM's
            # compressed_token_type_ids); a model with one token type (RoBERTa) has none.
            split = (new.pooling_params.extra_kwargs or {}).get("compressed_token_type_ids")
            if cfg.type_vocab_size < 2:
                split = None
            types.extend([0] * n if split is None else [0] * split + [1] * (n - split))
            lens.append(n)
        dev = self.device
        hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                                    torch.tensor(types, device=dev), lens)
        out: dict[str, Any] = {}
        classify = self.model.classify if self.model.classifier is not None else None
        activation = self.model_config.activation
        for new, rows in zip(batch, hidden.split(lens)):
            out[new.req_id] = pool_request(rows, new.prefill_token_ids, new.pooling_params, self.pooler, classify,
                                           activation)
        return out

"""A tensor / pipeline-parallel worker: one process per rank, holding its shard of the model and
its KV cache (vLLM's v1/worker/cpu_worker.py with its WorkerProc loop).

Started by the MultiprocExecutor (tokenloom/engine/multiproc_executor.py), forked from the ranks'
forkserver (tokenloom/engine/worker_forkserver.py: an interpreter started with subprocess, so that an engine
core that is itself a daemon process may start it, imports torch once per process and forks each rank into
`main(HOST:PORT AUTHKEY RANK)`; `python -m tokenloom.engine.worker HOST:PORT AUTHKEY RANK` runs the same
rank in an interpreter of its own); a Ray actor of the RayExecutor runs the same loop, `serve`, in its own
process. It connects back
to the executor, says where it runs, receives its `WorkerInit`, pins itself to its cores, joins the
process groups (gloo, tokenloom/distributed), loads the checkpoint, keeps its cut
(tokenloom/model/tp_shard.py), builds a ModelRunner over it, and then runs what the executor sends:
`("execute_model", (scheduler_output,))` every step, in the same order on every rank, so that every
rank's collectives meet. Each call answers ("ok", result) or ("error", text); only the output rank
(TP rank 0 of the last PP stage) sends the ModelRunnerOutput back, the others None.

Every rank samples (the vocab-parallel head all-gathers the logits) with the same seed, as vLLM's
ranks do, so each rank's runner keeps the same per-request tokens without a broadcast under TP.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Client
from typing import Any

logger = logging.getLogger(__name__)


def send(conn: Any, obj: Any) -> None:
    """Plain pickle over the connection: Connection.send's pickler would pass torch tensors as shared
    memory handles, which need a multiprocessing parent the workers (subprocesses) do not have."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


@dataclass
class WorkerInit:
    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dist_init_method: str  # tcp://host:port of the gloo rendezvous
    model_path: str
    dtype: str  # torch dtype name
    device: str
    quantization: str | None
    seed: int
    runner_kwargs: dict[str, Any] = field(default_factory=dict)  # block_size, num_blocks, ...
    speculative_config: Any = None
    max_model_len: int = 0
    cpus: list[int] | None = None
    log_level: str = "WARNING"
    # Every rank on one node: a TP group all-reduces through shared memory there, else over gloo.
    same_node: bool = True
    # Custom logits processors ("module:Class" names; [] still loads installed entry points) and what they get as
    # vLLM's vllm_config (a LogitsProcessorConfig); None: none built (pooling, speculative decoding). Every rank
    # builds and applies them: every rank samples, and must sample the same tokens.
    logits_processors: list[str] | None = None
    logits_processors_config: Any = None
    # The engine's hf_overrides (a dict by now) and disable_sliding_window (model/hf_overrides.py's ModelOverrides):
    # every rank loads the model the engine core sized its KV cache for. None: none.
    model_overrides: Any = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """TP rank 0 of the last pipeline stage: the rank whose outputs the engine core reads."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


class Worker:
    """One rank's runner and what the executor may call on it."""

    def __init__(self, init: WorkerInit) -> None:
        import torch

        from tokenloom.distributed import init_distributed_environment, initialize_model_parallel
        from tokenloom.distributed.parallel_state import get_pp_group, get_tp_group
        from tokenloom.model.loader import load_model
        from tokenloom.model.runner import ModelRunner
        from tokenloom.model.tp_shard import shard_model

        self.init = init
        init_distributed_environment(init.world_size, init.rank, init.dist_init_method)
        initialize_model_parallel(init.tensor_parallel_size, init.pipeline_parallel_size, same_node=init.same_node)
        tp, pp = get_tp_group(), get_pp_group()
        # Every rank draws the same random numbers for requests without a seed: same tokens everywhere.
        torch.manual_seed(init.seed)
        dtype = getattr(torch, init.dtype)
        loaded = load_model(init.model_path, dtype, quantized=init.quantization == "gguf",
                            overrides=init.model_overrides)
        sharded = shard_model(loaded, tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size)
        del loaded
        self.runner = ModelRunner(sharded, dtype=dtype, device=init.device, quantization=init.quantization,
                                  **init.runner_kwargs)
        del sharded
        if init.speculative_config is not None:
            self.runner.enable_speculative_decoding(init.speculative_config, init.max_model_len)
        if init.logits_processors is not None:
            self.runner.enable_logits_processors(init.logits_processors_config, init.logits_processors)
        self.is_output_rank = init.rank == init.output_rank
        self.return_logits = False
        self.step_delay_s = 0.0

    # ----------------------------------------------------------------- what the executor calls

    def execute_model(self, scheduler_output: Any, pipeline_tokens: list[tuple[int, Any]] | None = None) -> Any:
        """pipeline_tokens: a stage before the last gets the tokens of earlier steps here (the runner's
        receive_pipeline_tokens)."""
        if pipeline_tokens:
            self.runner.receive_pipeline_tokens(pipeline_tokens)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = self.runner.execute_model(scheduler_output, return_logits=self.return_logits)
        drafts = self.runner.take_draft_token_ids()
        return (out, drafts) if self.is_output_rank else None

    def reset(self) -> None:
        self.runner.requests.clear()
        self.runner.input_batch.remove_all()
        self.runner.pipeline_unsynced.clear()
        if self.runner.spec_decode is not None:
            self.runner.spec_decode.reset()

    def comm_stats(self) -> dict[str, int]:
        from tokenloom.distributed import comm_stats

        return comm_stats()

    def set_return_logits(self, on: bool) -> None:
        """Debugging and tests: keep each step's fp32 logits (the runner's `last_logits`)."""
        self.return_logits = on

    def set_step_delay(self, seconds_by_rank: dict[int, float]) -> None:
        """Tests: make chosen ranks slow stages (each step waits first), so that whether the stages work
        on two micro-batches at once can be counted without depending on the machine's speed."""
        self.step_delay_s = seconds_by_rank.get(self.init.rank, 0.0)

    def last_logits(self) -> Any:
        return None if self.runner.last_logits is None else self.runner.last_logits.clone()

    def info(self) -> dict[str, Any]:
        import torch

        from tokenloom.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        return {"rank": self.init.rank, "pid": os.getpid(), "threads": torch.get_num_threads(),
                "all_reduce": "none" if tp.world_size == 1 else "shared memory" if tp.shm is not None else "gloo",
                "cpus": sorted(os.sched_getaffinity(0)), "weight_bytes": self.runner.model.weight_bytes(),
                "num_kv_heads": self.runner.model.num_kv_heads, "num_layers": len(self.runner.model.layers),
                "kv_cache_dtype": str(self.runner.kv_caches[0][0].dtype).removeprefix("torch.")}

    def shutdown(self) -> None:
        from tokenloom.distributed import destroy_model_parallel
        from tokenloom.distributed.parallel_state import get_pp_group

        get_pp_group().wait_for_send()  # the last activations in flight reach the next stage
        destroy_model_parallel()


def free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve(address: tuple[str, int], authkey: bytes, rank: int, node_id: str, node_ip: str) -> int:
    """Connect back to the executor, start the rank and answer its calls until shutdown or until the
    executor is gone. The hello says where the rank runs: its node (the executor checks whether every
    rank shares one), the node's address and a free port there (rank 0's host the gloo rendezvous)."""
    conn = Client(address, authkey=authkey)
    send(conn, ("hello", rank, os.getpid(), node_id, node_ip, free_port(node_ip)))
    init: WorkerInit = recv(conn)
    if init.cpus:
        os.sched_setaffinity(0, init.cpus)  # before torch starts its OpenMP team
    logging.basicConfig(level=init.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
    try:
        worker = Worker(init)
    except Exception as exc:
        logger.exception("worker %d failed to start", rank)
        send(conn, ("error", f"worker {rank} start-up failed: {type(exc).__name__}: {exc}"))
        return 1
    send(conn, ("ok", worker.info()))
    while True:
        try:
            method, args = recv(conn)
        except (EOFError, OSError):  # the executor is gone: nothing left to serve
            return 0
        if method == "shutdown":
            worker.shutdown()
            send(conn, ("ok", None))
            return 0
        try:
            result = getattr(worker, method)(*args)
        except Exception as exc:
            logger.error("worker %d: %s failed:\n%s", rank, method, traceback.format_exc())
            send(conn, ("error", f"worker {rank}: {type(exc).__name__}: {exc}"))
            continue
        send(conn, ("ok", result))


def main(argv: list[str]) -> int:
    """A worker process on the executor's node: `HOST:PORT AUTHKEY RANK`."""
    import socket

    address, authkey, rank = argv[0], bytes.fromhex(argv[1]), int(argv[2])
    host, port = address.rsplit(":", 1)
    return serve((host, int(port)), authkey, rank, socket.gethostname(), "127.0.0.1")


if __name__ == "__main__":
    # Importing the tokenloom package first sets the OpenMP variables before torch loads (__init__.py).
    import tokenloom  # noqa: F401

    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))

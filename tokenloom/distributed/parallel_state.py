"""Process groups of tensor and pipeline parallelism (vLLM's vllm/distributed/parallel_state.py).

`init_distributed_environment` joins the world over torch.distributed's gloo backend, rendezvousing
at a TCP store on localhost (or the first node, for ranks on several machines);
`initialize_model_parallel(tp, pp)` cuts it into groups with vLLM's rank layout:

    world rank = pp_rank * tp_size + tp_rank

so the ranks of one TP group are contiguous (one node, when ranks fill nodes in order) and a PP
group strides across them. Each group is a `GroupCoordinator`: its ranks, this rank's place, the
gloo group, and for a TP group whose ranks share a node the shared-memory all-reduce
(tokenloom/distributed/shm_communicator.py), which vLLM's CPU build uses instead of gloo there.
TOKENLOOM_CPU_ALLREDUCE=gloo keeps gloo (for measuring one against the other).

Without initialisation every group is a world of one: the model's collectives are then no-ops, so
the one-process path never touches torch.distributed.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenloom import envs
from tokenloom.distributed.shm_communicator import ShmCommunicator

logger = logging.getLogger(__name__)

# Per-rank slot of the shared-memory all-reduce: a 2,048-token prefill of a 4,096-wide model in
# float32 is 32 MiB, so bigger tensors go in pieces; a decode step's [rows, hidden] fits whole.
SHM_SLOT_BYTES = 4 << 20


@dataclass
class GroupCoordinator:
    """One process group: `ranks` (world ranks, in group order), this process's `rank_in_group`."""

    ranks: list[int]
    rank: int  # world rank of this process
    device_group: Any = None  # the gloo ProcessGroup (None for a world of one)
    shm: ShmCommunicator | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "send": 0,
                                                            "recv": 0, "all_reduce_bytes": 0})
    _send_in_flight: tuple[Any, torch.Tensor] | None = None  # (gloo work, its tensor): send()'s

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place when x is contiguous; returns the sum."""
        if self.world_size == 1:
            return x
        self.counts["all_reduce"] += 1
        self.counts["all_reduce_bytes"] += x.numel() * x.element_size()
        x = x.contiguous()
        if self.shm is not None:
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        self.counts["all_gather"] += 1
        x = x.contiguous()
        if self.shm is not None and x.numel() * x.element_size() <= self.shm.slot_bytes:
            parts = self.shm.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def send(self, x: torch.Tensor, dst_in_group: int) -> None:
        """Returns once the send is under way, not done: gloo's blocking send waits until the receiver
        has posted its recv, which would hold a pipeline stage until the next stage finished its previous
        micro-batch (no two batches in the pipe). The send in flight completes before the next one starts
        (its tensor is kept alive until then), so at most one message per peer is outstanding."""
        self.counts["send"] += 1
        self.wait_for_send()
        x = x.contiguous()
        self._send_in_flight = (dist.isend(x, dst=self.ranks[dst_in_group], group=self.device_group), x)

    def wait_for_send(self) -> None:
        if self._send_in_flight is not None:
            work, _ = self._send_in_flight
            self._send_in_flight = None
            work.wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src_in_group: int) -> torch.Tensor:
        self.counts["recv"] += 1
        out = torch.empty(shape, dtype=dtype)
        dist.recv(out, src=self.ranks[src_in_group], group=self.device_group)
        return out

    def broadcast_object(self, obj: Any, src_in_group: int) -> Any:
        """A picklable object from one rank of the group to all (gloo, one length + one payload)."""
        if self.world_size == 1:
            return obj
        src = self.ranks[src_in_group]
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.device_group)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=src, group=self.device_group)
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)

    def destroy(self) -> None:
        self.shm = None
        self._send_in_flight = None


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def _single() -> GroupCoordinator:
    return GroupCoordinator(ranks=[0], rank=0)


def get_world_group() -> GroupCoordinator:
    return _WORLD if _WORLD is not None else _single()


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _single()


def get_pp_group() -> GroupCoordinator:
    return _PP if _PP is not None else _single()


def model_parallel_is_initialized() -> bool:
    return _TP is not None and _PP is not None


def init_distributed_environment(world_size: int, rank: int, init_method: str, timeout_s: float = 120.0) -> None:
    """Join the world of `world_size` processes (gloo) at `init_method` (tcp://host:port)."""
    global _WORLD
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, world_size=world_size, rank=rank,
                                timeout=timedelta(seconds=timeout_s))
    _WORLD = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD)


def initialize_model_parallel(tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                              same_node: bool = True) -> None:
    """The TP and PP groups of vLLM's layout; every rank must call it (gloo groups are collective)."""
    global _TP, _PP
    world = get_world_group()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp * pp != world.world_size:
        raise ValueError(f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} != world size {world.world_size}")
    rank = world.rank
    for p in range(pp):  # every rank creates every group, in the same order
        ranks = list(range(p * tp, (p + 1) * tp))
        group = dist.new_group(ranks, backend="gloo") if tp > 1 else None
        if rank in ranks:
            _TP = GroupCoordinator(ranks, rank, group)
    for t in range(tp):
        ranks = list(range(t, world.world_size, tp))
        group = dist.new_group(ranks, backend="gloo") if pp > 1 else None
        if rank in ranks:
            _PP = GroupCoordinator(ranks, rank, group)
    assert _TP is not None and _PP is not None
    if _TP.world_size > 1 and same_node and envs.TOKENLOOM_CPU_ALLREDUCE == "shm":
        _TP.shm = _attach_shm(_TP)
    logger.info("rank %d: tp rank %d/%d, pp rank %d/%d, all-reduce over %s", rank, _TP.rank_in_group, tp,
                _PP.rank_in_group, pp, "shared memory" if _TP.shm is not None else "gloo")


def _attach_shm(group: GroupCoordinator) -> ShmCommunicator:
    """Group rank 0 creates the file and broadcasts its path; all map it; rank 0 unlinks it."""
    path = group.broadcast_object(ShmCommunicator.new_path() if group.is_first_rank else None, 0)
    shm = None
    if group.is_first_rank:
        shm = ShmCommunicator(path, 0, group.world_size, SHM_SLOT_BYTES, create=True)
    group.barrier()  # the file exists
    if shm is None:
        shm = ShmCommunicator(path, group.rank_in_group, group.world_size, SHM_SLOT_BYTES, create=False)
    group.barrier()  # every rank mapped it
    if group.is_first_rank:
        shm.unlink()
    return shm


def destroy_model_parallel() -> None:
    global _WORLD, _TP, _PP
    _TP = _PP = _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()

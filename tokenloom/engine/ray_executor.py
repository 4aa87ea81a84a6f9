"""RayExecutor: tensor / pipeline-parallel ranks as Ray actors, on one node or several (vLLM's
v1/executor/ray_executor.py, `--distributed-executor-backend ray`).

Ray does placement only: one placement group per engine with one bundle per rank
(`{"CPU": TOKENLOOM_RAY_CPUS_PER_RANK}`, default 1; strategy PACK as vLLM's, so a TP group fills one
node before the next when it fits), one actor per bundle. Each actor runs the same rank as a worker
process of the MultiprocExecutor (tokenloom/engine/worker.py `serve`): it connects back to this
executor over TCP (an authenticated `multiprocessing.connection`, at this node's address), says which
Ray node it is on, and takes every step over that connection. Everything above the connection is the
MultiprocExecutor's: the batch queue, the gathers in order, the fault handling.

torch.distributed (gloo) rendezvouses at rank 0's node address and a port free there (rank 0's
hello carries both). A TP group all-reduces through shared memory only when every rank is on one
Ray node; across nodes it stays on gloo (vLLM's CPU communicator makes the same choice).

A rank actor that dies (killed, its node lost) closes its connection: the executor fails as a whole
(ExecutorDeadError), kills the other actors and frees the placement group, so the engine core ends
and its requests fail instead of waiting on a collective that will never complete.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from typing import Any

from tokenloom import envs
from tokenloom.engine.multiproc_executor import MultiprocExecutor
from tokenloom.engine.worker import WorkerInit

logger = logging.getLogger(__name__)


def _rank_actor_class(ray: Any) -> Any:
    class RankActor:
        """One rank; `run` blocks for the rank's life (the actor's only task)."""

        def run(self, address: tuple[str, int], authkey: bytes, rank: int) -> int:
            from tokenloom.engine.worker import serve

            return serve(address, authkey, rank, ray.get_runtime_context().get_node_id(),
                         ray.util.get_node_ip_address())

    return ray.remote(RankActor)


class RayRankHandle:
    """The subprocess.Popen methods the executor uses (pid, poll, kill, wait), over a rank actor and its
    running `run` task."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any) -> None:
        self._ray, self.actor, self.run_ref = ray, actor, run_ref
        self.pid: int | None = None  # the actor process's, once its rank said hello
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        done, _ = self._ray.wait([self.run_ref], timeout=0)
        if not done:
            return None
        try:
            self.returncode = int(self._ray.get(self.run_ref))
        except Exception:  # the actor died (killed, its node lost) or the rank raised
            self.returncode = 1
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor)

    def wait(self, timeout: float | None = None) -> int:
        self._ray.wait([self.run_ref], timeout=timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"rank actor {self.actor}", timeout or 0.0)
        return code


class RayExecutor(MultiprocExecutor):
    def __init__(self, inits: list[WorkerInit], async_scheduling: bool = False, ready_timeout_s: float = 0.0,
                 start_timeout_s: float = 300.0) -> None:
        from tokenloom.engine.ray_utils import import_ray

        self._ray = ray = import_ray()
        if not ray.is_initialized():  # in an engine-core actor Ray is up already
            ray.init(include_dashboard=False, log_to_driver=True)
        self.listen_host = ray.util.get_node_ip_address()
        self.cpus_per_rank = envs.TOKENLOOM_RAY_CPUS_PER_RANK
        self.start_timeout_s = start_timeout_s
        self.placement_group: Any = None
        try:
            super().__init__(inits, async_scheduling, ready_timeout_s)
        except BaseException:
            self._remove_placement_group()
            raise
        for handle, info in zip(self.procs, self.worker_info):
            handle.pid = info["pid"]

    def _rank_cpus(self) -> list[list[int] | None]:
        return [None] * self.world_size  # Ray's bundles hold the CPUs; nothing is pinned

    def _launch(self, host: str, port: int, authkey: bytes) -> list[Any]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        bundles = [{"CPU": self.cpus_per_rank} for _ in range(self.world_size)]
        self.placement_group = pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=self.start_timeout_s)
        except Exception as exc:
            raise RuntimeError(
                f"Ray could not place {self.world_size} ranks with {self.cpus_per_rank} CPU(s) each "
                f"(TOKENLOOM_RAY_CPUS_PER_RANK; cluster: {ray.cluster_resources()}, free: "
                f"{ray.available_resources()}): {exc}") from exc
        actor_cls = _rank_actor_class(ray)
        handles: list[Any] = []
        for rank in range(self.world_size):
            actor = actor_cls.options(
                name=f"tokenloom-rank{rank}-{pg.id.hex()[:12]}",  # `ray list actors` tells whose rank it is
                num_cpus=self.cpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=rank),
            ).remote()
            handles.append(RayRankHandle(ray, actor, actor.run.remote((host, port), authkey, rank)))
            self.procs = handles  # a failed start below kills what started
        return handles

    def _remove_placement_group(self) -> None:
        if self.placement_group is None:
            return
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(self.placement_group)
        self.placement_group = None

    def _kill_all(self) -> None:
        super()._kill_all()
        self._remove_placement_group()

    def shutdown(self) -> None:
        super().shutdown()
        for handle in self.procs:  # a rank's task has returned; its actor process is freed here
            handle.kill()
        self._remove_placement_group()

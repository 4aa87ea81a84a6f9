"""The Ray backend (`--distributed-executor-backend ray`): engine cores placed as Ray actors.

Ray does placement only, as in vLLM's Ray DP backend (`v1/engine/utils.py CoreEngineActorManager`):
one placement group with a bundle of CPUs per data-parallel engine (strategy SPREAD, so engines land
on different machines of the cluster when it has them), one actor per bundle. The data plane is the
same message protocol as the `mp` backend's pipes (core_messages.py), over two TCP connections per
engine that the actor opens back to the API process (`multiprocessing.connection`, with a random
authkey). The actor runs `run_engine_core`, the same loop as a spawned engine process, so an engine
behaves identically whichever backend placed it; when an actor dies its connections reach EOF and
the DP client fails only that engine's requests.

`ray.init()` joins the cluster named by RAY_ADDRESS or started on this machine with `ray start --head`
(other machines: `ray start --address HEAD:6379`), or else starts a local one. Ray is an optional
extra: `pip install 'tokenloom[ray]'`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from multiprocessing.connection import Connection, Listener
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.engine.core_client import MPClient
from tokenloom.engine.exceptions import EngineStartError
from tokenloom.engine.kv_connectors import data_parallel_kv_transfer
from tokenloom.engine.ray_utils import import_ray

logger = logging.getLogger(__name__)


def _engine_actor_class(ray: Any) -> Any:
    class EngineCoreActor:
        """Holds one engine core; `run` blocks for the engine's life (the actor's only task)."""

        def run(self, config: EngineConfig, address: tuple[str, int], authkey: bytes, log_level: str,
                engine_index: int) -> None:
            from multiprocessing.connection import Client

            from tokenloom.engine.core_proc import run_engine_core

            inbox = Client(address, authkey=authkey)
            outbox = Client(address, authkey=authkey)
            try:
                run_engine_core(config, inbox, outbox, log_level, engine_index)
            finally:
                inbox.close()
                outbox.close()

    return ray.remote(EngineCoreActor)


class RayEngineHandle:
    """The Process methods the MPClient uses, over a Ray actor and its running `run` task."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any) -> None:
        self._ray, self.actor, self.run_ref = ray, actor, run_ref
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        if self.exitcode is not None:
            return False
        done, _ = self._ray.wait([self.run_ref], timeout=0)
        if not done:
            return True
        try:
            self._ray.get(self.run_ref)
            self.exitcode = 0
        except Exception:  # the actor died or the loop raised
            self.exitcode = 1
        return False

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self.run_ref], timeout=timeout)
        self.is_alive()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor)
        self.exitcode = self.exitcode if self.exitcode is not None else -9


class RayPlacement:
    """The placement group and actors of one DP deployment; `close` frees them."""

    def __init__(self, ray: Any, placement_group: Any, handles: list[RayEngineHandle]) -> None:
        self._ray, self.placement_group, self.handles = ray, placement_group, handles

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for h in self.handles:
            h.kill()
        with contextlib.suppress(Exception):
            remove_placement_group(self.placement_group)


def start_ray_engines(
    config: EngineConfig,
    num_engines: int,
    log_level: str = "info",
    cpus_per_engine: int | None = None,
    start_timeout_s: float = 300.0,
) -> tuple[list[MPClient], RayPlacement]:
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)
    if cpus_per_engine is None and config.parallel is not None and config.parallel.model_parallel_size > 1:
        cpus_per_engine = 1  # the engine core schedules; its TP/PP ranks are actors with CPUs of their own
    if cpus_per_engine is None:
        total = int(ray.available_resources().get("CPU", 1))
        cpus_per_engine = max(1, total // num_engines)
    bundles = [{"CPU": cpus_per_engine} for _ in range(num_engines)]
    pg = placement_group(bundles, strategy="SPREAD")
    try:
        ray.get(pg.ready(), timeout=start_timeout_s)
    except Exception as exc:
        with contextlib.suppress(Exception):
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
        raise EngineStartError(
            f"Ray could not place {num_engines} engines with {cpus_per_engine} CPUs each "
            f"(cluster: {ray.cluster_resources()}): {exc}"
        ) from exc
    actor_cls = _engine_actor_class(ray)
    host = ray.util.get_node_ip_address()
    authkey = os.urandom(32)
    handles: list[RayEngineHandle] = []
    clients: list[MPClient] = []
    placement = RayPlacement(ray, pg, handles)
    try:
        for i in range(num_engines):
            listener = Listener((host, 0), authkey=authkey)
            try:
                actor = actor_cls.options(
                    num_cpus=cpus_per_engine, name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i),
                ).remote()
                engine_config = data_parallel_kv_transfer(config, i)  # a disk KV tier per engine
                run_ref = actor.run.remote(engine_config, listener.address, authkey, log_level, i)
                handle = RayEngineHandle(ray, actor, run_ref)
                handles.append(handle)
                inbox, outbox = _accept_two(listener, handle, start_timeout_s)
            finally:
                listener.close()
            clients.append(MPClient(config, log_level, engine_index=i, connections=(handle, inbox, outbox)))
    except BaseException:
        for c in clients:
            c.shutdown(1.0)
        placement.close()
        raise
    return clients, placement


def _accept_two(listener: Listener, handle: RayEngineHandle, timeout_s: float) -> tuple[Connection, Connection]:
    """The actor's two connections (its inbox first), or the actor's error if it died first."""
    got: list[Connection] = []
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            got.append(listener.accept())
            got.append(listener.accept())
        except BaseException as exc:  # the listener was closed: start-up failed
            errors.append(exc)

    t = threading.Thread(target=accept, name="ray-engine-accept", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive():
        t.join(0.1)
        if not t.is_alive():
            break
        if not handle.is_alive():
            listener.close()
            try:
                handle._ray.get(handle.run_ref)
            except Exception as exc:
                raise EngineStartError(f"the Ray engine actor failed to start: {exc}") from exc
            raise EngineStartError("the Ray engine actor ended before connecting")
        if time.monotonic() > deadline:
            listener.close()
            raise EngineStartError(f"the Ray engine actor did not connect within {timeout_s:g} s")
    if errors or len(got) != 2:
        raise EngineStartError(f"the Ray engine actor could not connect: {errors[0] if errors else 'no connection'}")
    return got[0], got[1]

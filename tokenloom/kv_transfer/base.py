"""The KV connector interface: vLLM V1's KVConnectorBase_V1, with its method names and roles.

One class, two roles: an engine builds it twice, once as KVConnectorRole.SCHEDULER (called by the
scheduler, pure Python) and once as KVConnectorRole.WORKER (called by the model runner around the
forward). The scheduler side's decisions reach the worker side as this step's KVConnectorMetadata.

Granularity here: the CPU runner runs the whole forward in one call, so a worker side loads every
block of the step in `start_load_kv` (before the forward) and saves them in `wait_for_save` (after
it); `wait_for_layer_load` / `save_kv_layer` exist with vLLM's names for connectors that overlap
transfers with layers, and default to nothing for the whole-step ones.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.config import KVTransferConfig
    from tokenloom.core.kv_cache_manager import KVCacheBlocks
    from tokenloom.core.outputs import KVConnectorOutput, SchedulerOutput
    from tokenloom.core.request import Request

logger = logging.getLogger(__name__)

class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # in the scheduler: lookups, allocation bookkeeping, the step's metadata
    WORKER = 1  # in the model runner: the transfers themselves


class KVConnectorMetadata:  # noqa: B903 - a base type, as vLLM's (each connector subclasses it)
    """What the scheduler side tells the worker side for one step."""


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's class name
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: list[tuple[Any, ...]]) -> None:  # noqa: B027 - optional
        """The runner's KV tensors, one tuple per layer (K, V, and whatever else a block holds)."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound for this step"
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start (here: do) the step's loads into the pool's blocks, before the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:  # noqa: B027 - whole-step connectors: nothing
        """Block until one layer's KV is loaded (layer-wise connectors; a whole-step one has loaded every
        layer in start_load_kv, so the default does nothing)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,  # noqa: B027 - see above
                      **kwargs: Any) -> None:
        """Start saving one layer's KV (layer-wise connectors; a whole-step one saves in wait_for_save)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until the step's saves are done, after the forward."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous send / receive ended since the last call (vLLM's)."""
        return None, None

    def build_connector_worker_output(self) -> KVConnectorOutput | None:
        """The step's report for the scheduler side (ModelRunnerOutput.kv_connector_output)."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Release files, threads, sockets."""

    # ------------------------------------------------------------------ scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` (the pool's prefix hit) the connector can load, and whether
        it loads them asynchronously; None: it cannot tell yet (the request waits a step)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Blocks were allocated for an admitted request (every admission, also with 0 external tokens)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the worker side; resets the scheduler side's per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027 - optional
        """A step's report from the worker side."""

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """The request is finished: whether its blocks must stay allocated for a send still running
        (delay_free), and the kv_transfer_params to return with it."""
        return False, None

    def reset_cache(self) -> bool | None:
        """Drop what the connector has cached (vLLM's, for reset_prefix_cache(reset_connector=True)): True
        when reset, False when it could not be; None, the default, when the connector has no reset, which
        the scheduler takes as success, as vLLM's does."""
        return None


def track_block_ids(block_ids: dict[str, list[int]], scheduler_output: SchedulerOutput) -> None:
    """Keep each tracked request's pool blocks (those of KV cache group 0) current from a step's
    SchedulerOutput: a new request's blocks as scheduled, a running one's newly allocated blocks appended
    (a request the connector does not track is left alone). What build_connector_meta reads to know
    where a request's blocks are, in every connector."""
    for new in scheduler_output.scheduled_new_reqs:
        block_ids[new.req_id] = list(new.block_ids[0])
    cached = scheduler_output.scheduled_cached_reqs
    for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
        if rid in block_ids and new_ids:
            block_ids[rid].extend(new_ids[0])


def write_block_files(files: Any, rows: Any, keys: list[Any], failed: list[Any], what: str) -> None:
    """Write row i of `rows` (the gathered blocks, uint8) to `files` under keys[i] (None: not this row).
    A write that fails leaves that block unsaved, never the step: its key goes to `failed` (reported in
    the step's connector output), and the first failure is logged once per step."""
    for row, key in enumerate(keys):
        if key is None:
            continue
        try:
            files.write(key, memoryview(rows[row].numpy()))
        except OSError as exc:
            if not failed:
                logger.warning("%s: cannot write to %s (%s); the block is not saved", what, files.dir, exc)
            failed.append(key)

"""`KVConnectorBase`: one connector class, two roles (seed: KV Transfer, 2ロール分離).

The same class is instantiated twice: once with `KVConnectorRole.SCHEDULER`
in the engine core, once with `KVConnectorRole.WORKER` in every worker
process. The two instances never share memory; they talk only through

    scheduler side --build_connector_meta()--> bytes in SchedulerOutput.kv_connector_metadata
    worker side    --get_finished() etc.----> KVConnectorOutput in ModelRunnerOutput

Scheduler-side calls, per `schedule()` (the scheduler's order):

    get_num_new_matched_tokens(request, num_local_computed) -> (N | None, is_async)
    update_state_after_alloc(request, blocks, N)            once blocks are allocated
    build_connector_meta(scheduler_output) -> bytes          end of schedule(); resets step state
    update_connector_output(kv_connector_output)             after each step's output
    request_finished(request, block_ids) -> (delay_free, kv_transfer_params)
    take_events()                                            KV events for the publisher

Worker-side calls, per step (the model runner's order):

    bind_connector_metadata(bytes)        before the forward
    start_load_kv()                       before the forward (may only start async loads)
    wait_for_layer_load(layer_name)       in the forward, before layer reads its KV
    save_kv_layer(layer_name, kv_layer)   in the forward, after layer wrote its KV
    wait_for_save()                       after the forward: saves must be complete
    get_finished(finished_req_ids)        -> (finished_sending, finished_recving)
    get_block_ids_with_load_errors()      -> block ids whose load failed (recomputed)
    clear_connector_metadata()            end of step
    handle_preemptions(preempted_req_ids) before the step, when requests were preempted

and once at start-up `register_kv_caches({layer_name: kv_cache}, layer_groups)`.

Hybrid models (several KV cache groups, e.g. Gemma 3's sliding-window and
global layers): block ids are per group (`BlockIdsPerGroup`, the scheduler's
group order); the scheduler side learns each group's window from
`KVConnectorContext.kv_cache_groups`, the worker side which layer belongs to
which group from `layer_groups`. See `groups.py` for which blocks of a
sliding-window group a connector stores and moves.

Differences from vLLM's `KVConnectorBase_V1`, on purpose: the metadata is
bytes (it crosses the process boundary inside an msgspec struct, so each
connector owns its own codec); `start_load_kv` takes no forward context (the
metadata carries block ids and the caches were registered by name);
`save_kv_layer` takes no attention metadata for the same reason.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import torch

from paged.connectors.kv.config import KVTransferConfig
from paged.connectors.kv.groups import GroupLayout, check_layer_groups
from paged.kvcache import KVCacheBlocks
from paged.kvcache.events import KVCacheEvent
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    KVConnectorOutput,
    KVTransferParams,
    SchedulerOutput,
)
from paged.scheduler.request import Request

_Metadata = TypeVar("_Metadata")


class KVConnectorRole(enum.Enum):
    """Which process an instance lives in (vLLM's values)."""

    SCHEDULER = 0
    WORKER = 1


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector needs to know about the engine it is plugged into.

    block_size: tokens per KV block (the scheduler's and the runner's).
    rank / world_size: this worker's tensor-parallel rank (0 / 1 on the
        scheduler side); each rank holds its own slice of the KV heads.
    num_kv_cache_groups: KV cache groups of the model (1 unless hybrid).
    kv_bytes_per_block: bytes of one block across every layer on one rank
        (0 when the builder does not know it; byte-budgeted stores need it on
        the scheduler side, which never sees the KV tensors).
    model_name: the model's name as engines compare it (P/D handshake); "" if unknown.
    kv_cache_groups: each group's layout (scheduler side; empty when the
        builder does not know it, which a single-group connector never needs).
    """

    block_size: int
    rank: int = 0
    world_size: int = 1
    num_kv_cache_groups: int = 1
    kv_bytes_per_block: int = 0
    model_name: str = ""
    kv_cache_groups: tuple[GroupLayout, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.kv_cache_groups and len(self.kv_cache_groups) != self.num_kv_cache_groups:
            raise ValueError(
                f"kv_cache_groups has {len(self.kv_cache_groups)} layouts, "
                f"num_kv_cache_groups is {self.num_kv_cache_groups}"
            )

    def group_layouts(self) -> tuple[GroupLayout, ...]:
        """The groups' layouts; one full-attention group when none were given.

        `ValueError` for a hybrid model without layouts: a connector cannot know
        which blocks of which group to move.
        """
        if self.kv_cache_groups:
            return self.kv_cache_groups
        if self.num_kv_cache_groups != 1:
            raise ValueError(
                f"the model has {self.num_kv_cache_groups} KV cache groups but the "
                "connector was given no kv_cache_groups layouts"
            )
        return (GroupLayout(layer_names=(), block_bytes=self.kv_bytes_per_block),)


class KVConnectorRoleError(RuntimeError):
    """A method of one role was called on an instance of the other role."""


class KVConnectorBase(abc.ABC):
    """Base of every KV connector; see the module docstring for the call order.

    Subclasses implement the abstract methods; the others have the no-op
    behaviour a connector without that feature needs. The constructor
    signature `(config, role, context)` is what `KVConnectorFactory` calls.
    """

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        self._config = config
        self._role = role
        self._context = context
        self._metadata_bytes: bytes | None = None
        self._metadata_decoded: object | None = None  # this step's, decoded once
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_groups: list[list[str]] = []

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        return self._config

    @property
    def context(self) -> KVConnectorContext:
        return self._context

    def _require_role(self, role: KVConnectorRole, method: str) -> None:
        if self._role is not role:
            raise KVConnectorRoleError(
                f"{type(self).__name__}.{method} is a {role.name.lower()}-side method, "
                f"called on the {self._role.name.lower()}-side instance"
            )

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        """Adopt the paged KV cache tensors, layer name -> tensor, once after allocation.

        Layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_size]`
        (K then V). The connector keeps references, never copies.
        `layer_groups`: the layer names of each KV cache group, in the
        scheduler's group order (a layer's cache is indexed by its group's block
        ids); None means one group of every layer. `ValueError` if a layer is
        in no group or in two.
        """
        self._require_role(KVConnectorRole.WORKER, "register_kv_caches")
        self._kv_caches = dict(kv_caches)
        self._layer_groups = (
            [list(self._kv_caches)]
            if layer_groups is None
            else check_layer_groups(list(self._kv_caches), layer_groups)
        )

    def _group_of_layer(self) -> dict[str, int]:
        """Layer name -> its KV cache group (after `register_kv_caches`)."""
        return {name: g for g, names in enumerate(self._layer_groups) for name in names}

    def bind_connector_metadata(self, metadata: bytes) -> None:
        """Adopt this step's metadata (the bytes `build_connector_meta` produced).

        Must be followed by `clear_connector_metadata()` at the end of the step.
        Subclasses decode it lazily through `_get_connector_metadata_bytes()`.
        """
        self._require_role(KVConnectorRole.WORKER, "bind_connector_metadata")
        self._metadata_bytes = metadata
        self._metadata_decoded = None

    def clear_connector_metadata(self) -> None:
        """Forget this step's metadata; the next step binds its own."""
        self._metadata_bytes = None
        self._metadata_decoded = None

    def has_connector_metadata(self) -> bool:
        return self._metadata_bytes is not None

    def _get_connector_metadata_bytes(self) -> bytes:
        """The bound metadata; `RuntimeError` if nothing is bound (a call-order bug)."""
        if self._metadata_bytes is None:
            raise RuntimeError(
                f"{type(self).__name__}: no connector metadata bound for this step "
                "(bind_connector_metadata must come first)"
            )
        return self._metadata_bytes

    def _decoded_connector_metadata(self, metadata_type: type[_Metadata]) -> _Metadata:
        """The bound metadata as msgpack-decoded `metadata_type`, decoded once per step.

        The forward asks for it once per layer; decoding the bytes each time would
        cost a full decode per layer.
        """
        decoded = self._metadata_decoded
        if not isinstance(decoded, metadata_type):
            decoded = msgspec.msgpack.decode(
                self._get_connector_metadata_bytes(), type=metadata_type
            )
            self._metadata_decoded = decoded
        return decoded

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Start (or, for a synchronous connector, do) this step's loads into the paged cache.

        Called before the forward, after `bind_connector_metadata`. Writes only
        into the blocks the metadata names; a load that fails records its
        blocks for `get_block_ids_with_load_errors()` instead of raising.
        """

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV for this step is in the paged cache."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Start saving `layer_name`'s KV (just written by the forward) to the store.

        `kv_layer` is that layer's whole paged cache tensor; the metadata says
        which blocks to save. Must not modify `kv_layer`.
        """

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save started this step is done (the blocks may be reused next)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose async transfers completed: (finished_sending, finished_recving).

        `finished_req_ids` are the requests the scheduler finished since the
        last step. A synchronous connector finishes everything inside the step
        and returns (None, None).
        """
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (the scheduler recomputes them)."""
        return set()

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """The scheduler preempted these requests: stop using their blocks (they are freed)."""
        return None

    def get_kv_connector_stats(self) -> dict[str, float] | None:
        """Counters since the last call, flat "name" -> increment (either role), or None.

        Worker side: carried in `KVConnectorOutput.kv_connector_stats`; scheduler
        side: read by the scheduler's `make_stats`. Both end in `SchedulerStats`.
        """
        return None

    # --------------------------------------------------------------- scheduler side

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External tokens beyond the `num_computed_tokens` local hit: (N | None, load_async).

        (N, False) sync load in the next forward; (N, True) async load, the
        request waits in WAITING_FOR_REMOTE_KVS; (None, _) ask again next step;
        (0, False) nothing. N must leave at least one prompt token to compute.
        Must not mutate the request.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for `request`; remember what to load into them (N may be 0)."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        """Encode this step's loads and saves for the worker side; resets per-step state.

        Must not modify `scheduler_output`.
        """

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        """`request` finished: (delay_free, kv_transfer_params for the response).

        delay_free=True keeps its blocks allocated until the worker lists the
        request in `finished_sending`.
        """
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker side's report for the last step (finished transfers, load errors)."""
        return None

    def take_events(self) -> Sequence[KVCacheEvent]:
        """KV cache events produced since the last call (none by default)."""
        return ()

    def shutdown(self) -> None:
        """Release threads, sockets and files; called once when the engine stops."""
        return None

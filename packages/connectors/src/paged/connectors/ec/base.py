"""`ECConnectorBase`: one encoder-cache connector class, two roles (seed: ECConnector).

The same class is instantiated twice: with `ECConnectorRole.SCHEDULER` in the
engine core (next to the scheduler, torch never touched there) and with
`ECConnectorRole.WORKER` in each worker process (held by the runner's
`EncoderRunner`). The two instances share no memory; they talk only through

    scheduler side --build_connector_meta()--> ECConnectorMetadata, msgpack bytes in
                                               SchedulerOutput.ec_connector_metadata
    worker side    --get_finished() etc.-----> ECConnectorOutput in
                                               ModelRunnerOutput.ec_connector_output

Scheduler-side calls (engine core process), per `schedule()`:

    has_cache_item(mm_hash, request) -> bool an item not in the encoder cache: load it?
    is_async_load(mm_hash) -> bool           will the load land after this step?
    update_state_after_alloc(request, i)     item i got cache space; remember to load it
    build_connector_meta(scheduler_output)   end of schedule(); resets per-step state
    update_connector_output(ec_output)       after each step, with the worker's report
    request_finished(request)                on every end: finish, abort, error

Worker-side calls (worker process), once at start-up `register_caches(encoder_cache)`,
then per step in the runner's order:

    bind_connector_metadata(bytes)           before anything else of the step
    start_load_caches(encoder_cache)         consumer: loads (sync: done on return;
                                             async: started, reported by get_finished)
      ... the encoder runs for the items the scheduler chose to compute ...
    save_caches(encoder_cache, mm_hash)      producer: after each item is encoded
    get_finished(finished_req_ids)           -> (finished_sending, finished_recving)
    get_failed_loads()                       -> mm hashes whose load failed
    clear_connector_metadata()               end of step

The encoder cache is the runner's preallocated buffer (vLLM's gaps 3 and 4),
seen here through the `EncoderCache` Protocol: a connector reserves rows with
`allocate(mm_hash, num_embeds)` and writes the loaded embeddings straight into
the returned view; no dict of tensors, no extra copy.

Failure contract: a load that fails (file missing or corrupt, peer gone) never
raises out of `start_load_caches`/`get_finished` and never leaves rows
reserved for that hash: it is reported by `get_failed_loads()`. The runner
then encodes the item itself (same output); with `ec_load_failure_policy:
"fail"` the scheduler fails the requests waiting on it instead.

Differences from vLLM's `ECConnectorBase`, on purpose: the metadata crosses
the process boundary as msgpack bytes (`bind_connector_metadata` takes the
bytes, each connector decodes its own `ECConnectorMetadata` subclass);
`get_finished` reports mm hashes, not request ids (one item is loaded once
for every request sharing it); `is_async_load` and `get_failed_loads` are
added so the scheduler can wait for, or recover from, an asynchronous load;
`register_caches` takes the preallocated cache (vLLM's is a TODO).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import torch

from paged.connectors.ec.config import ECTransferConfig
from paged.scheduler.boundary import ECConnectorMetadata, ECConnectorOutput, SchedulerOutput
from paged.scheduler.request import Request

_Metadata = TypeVar("_Metadata", bound=ECConnectorMetadata)


class ECConnectorRole(enum.Enum):
    """Which process an instance lives in (vLLM's values)."""

    SCHEDULER = 0
    WORKER = 1


class ECConnectorRoleError(RuntimeError):
    """A method of one role was called on an instance of the other role."""


class EncoderCache(Protocol):
    """The worker's encoder cache as a connector sees it (the runner's preallocated buffer).

    Rows are embeddings of width `hidden_size`, in `dtype`, on `device`. A view
    returned by `get` or `allocate` stays valid until the next `allocate` or
    `free` on the cache (allocation may compact the buffer), so use it at once.
    Not thread-safe: call it from the worker's main thread only.
    """

    @property
    def hidden_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def __contains__(self, mm_hash: object) -> bool: ...

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """The `[num_embeds, hidden_size]` rows of `mm_hash`, or None if absent."""
        ...

    def allocate(self, mm_hash: str, num_embeds: int) -> torch.Tensor:
        """Reserve `num_embeds` rows for `mm_hash` and return them as a writable view.

        `ValueError` if `mm_hash` is already present or `num_embeds` < 1; a
        `RuntimeError` (the runner's `EncoderCacheFullError`) if the rows do not fit.
        """
        ...

    def free(self, mm_hash: str) -> None:
        """Release `mm_hash`'s rows (absent: no-op)."""
        ...


@dataclass(frozen=True)
class ECConnectorContext:
    """What a connector knows about the engine it is plugged into.

    rank / world_size: this worker's tensor-parallel rank (0 / 1 on the
        scheduler side); every rank holds the full encoder outputs.
    model_name: the served model's name, for connectors that check a peer
        runs the same model ("" if unknown).
    """

    rank: int = 0
    world_size: int = 1
    model_name: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")


class ECConnectorBase(abc.ABC):
    """Base of every encoder-cache connector; the module docstring gives the call order.

    Subclasses implement the five abstract methods; the others have the
    behaviour of a synchronous connector that holds nothing per request.
    `(config, role, context)` is the constructor `ECConnectorFactory` calls.
    """

    def __init__(
        self, config: ECTransferConfig, role: ECConnectorRole, context: ECConnectorContext
    ) -> None:
        if not config.is_ec_transfer_instance:
            raise ValueError("ec_transfer_config: ec_connector and ec_role must be set")
        self._config = config
        self._role = role
        self._context = context
        self._metadata_bytes: bytes | None = None
        self._metadata_decoded: ECConnectorMetadata | None = None
        self._encoder_cache: EncoderCache | None = None

    @property
    def role(self) -> ECConnectorRole:
        return self._role

    @property
    def ec_transfer_config(self) -> ECTransferConfig:
        return self._config

    @property
    def context(self) -> ECConnectorContext:
        return self._context

    @property
    def is_producer(self) -> bool:
        return self._config.is_ec_producer

    @property
    def is_consumer(self) -> bool:
        return self._config.is_ec_consumer

    def _require_role(self, role: ECConnectorRole, method: str) -> None:
        if self._role is not role:
            raise ECConnectorRoleError(
                f"{type(self).__name__}.{method} is a {role.name.lower()}-side method, "
                f"called on the {self._role.name.lower()}-side instance"
            )

    def shutdown(self) -> None:
        """Release threads, sockets and files; called once when the engine stops."""
        return None

    # ------------------------------------------------------------------ worker side

    def register_caches(self, encoder_cache: EncoderCache) -> None:
        """Adopt the runner's preallocated encoder cache, once at start-up (vLLM's gap 3).

        Connectors that load asynchronously reserve rows in `start_load_caches`
        and write them later from the worker's main thread, in `get_finished`,
        looking them up again with `get(mm_hash)` (an allocation in between may
        have moved them). The connector keeps the reference, never a copy.
        """
        self._require_role(ECConnectorRole.WORKER, "register_caches")
        self._encoder_cache = encoder_cache

    @property
    def registered_cache(self) -> EncoderCache | None:
        """The cache `register_caches` handed over, or None before it was called."""
        return self._encoder_cache

    def bind_connector_metadata(self, connector_metadata: bytes) -> None:
        """Adopt this step's metadata (the msgpack of `build_connector_meta`'s result).

        Called by the runner at the start of every step that carries
        metadata, before `start_load_caches`; `clear_connector_metadata()`
        ends the step. Subclasses decode it with `_get_connector_metadata(type)`.
        """
        self._require_role(ECConnectorRole.WORKER, "bind_connector_metadata")
        self._metadata_bytes = connector_metadata
        self._metadata_decoded = None

    def clear_connector_metadata(self) -> None:
        """Forget this step's metadata; the next step binds its own."""
        self._metadata_bytes = None
        self._metadata_decoded = None

    def has_connector_metadata(self) -> bool:
        return self._metadata_bytes is not None

    def _get_connector_metadata(self, metadata_type: type[_Metadata]) -> _Metadata:
        """The bound metadata decoded as `metadata_type` (once per step).

        `RuntimeError` if nothing is bound (a call-order bug in the runner).
        """
        decoded = self._metadata_decoded
        if isinstance(decoded, metadata_type):
            return decoded
        if self._metadata_bytes is None:
            raise RuntimeError(
                f"{type(self).__name__}: no connector metadata bound for this step "
                "(bind_connector_metadata must come first)"
            )
        result = msgspec.msgpack.decode(self._metadata_bytes, type=metadata_type)
        self._metadata_decoded = result
        return result

    @abc.abstractmethod
    def start_load_caches(self, encoder_cache: EncoderCache, **kwargs: Any) -> None:
        """Load this step's items (the bound metadata names them) into `encoder_cache`.

        Called on every step of a consumer, before the encoder runs and before
        the step's embeddings are gathered. A synchronous connector has every
        item in `encoder_cache` on return; an asynchronous one only starts the
        transfers and reports them through `get_finished`. A failed load is
        recorded for `get_failed_loads()` and leaves no rows reserved.
        """

    @abc.abstractmethod
    def save_caches(self, encoder_cache: EncoderCache, mm_hash: str, **kwargs: Any) -> None:
        """Save `encoder_cache.get(mm_hash)` to the connector's store or peer.

        Called on a producer right after the item was encoded into the cache,
        once per item. Must not modify the cache. A synchronous connector has
        the bytes stored on return (e.g. `.detach().cpu()` then a file); one
        that sends later copies the rows now: they move or are freed once the
        scheduler evicts the entry (`request_finished` can only keep entries
        that are still cached when the request ends).
        """

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous work completed since the last call: (finished_sending, finished_recving).

        Both are mm hashes. `finished_req_ids` are the requests the scheduler
        finished since the last step. Called once per step, after the
        forward, from the worker's main thread (so this is where an async
        connector copies received bytes into the registered cache). A
        synchronous connector returns (None, None).
        """
        return None, None

    def get_failed_loads(self) -> set[str]:
        """Mm hashes whose load failed since the last call (their rows are not reserved)."""
        return set()

    def build_connector_output(self, finished_req_ids: set[str]) -> ECConnectorOutput:
        """The step's `ECConnectorOutput` from `get_finished` and `get_failed_loads`."""
        sending, recving = self.get_finished(finished_req_ids)
        return ECConnectorOutput(
            finished_sending=sorted(sending or ()),
            finished_recving=sorted(recving or ()),
            failed_recving=sorted(self.get_failed_loads()),
        )

    # --------------------------------------------------------------- scheduler side

    @abc.abstractmethod
    def has_cache_item(self, identifier: str, request: Request | None = None) -> bool:
        """Whether the encoder output of `identifier` (mm hash) can be loaded.

        `request` (paged's addition; None outside a request) is the request that
        needs it: its `ec_transfer_params` may name the producer holding the item.

        The scheduler's hot path: answer from local state or a cheap stat,
        never block on the network.
        """

    def is_async_load(self, identifier: str) -> bool:
        """Whether loading `identifier` lands after the step that starts it (default: no)."""
        return False

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Item `index` of `request` got encoder-cache space and is to be loaded, not encoded."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads for the worker side; resets per-step state.

        Must not modify `scheduler_output`.
        """

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """The worker side's report for the last step (finished/failed loads and saves)."""
        return None

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """`request` ended (finish, abort or error): drop what this connector held for it.

        Returns (delay_free, params). delay_free=True keeps the request's
        encoder-cache references until every mm hash of it was listed in
        `finished_sending`; params are extra details for the response or None.
        """
        return False, None

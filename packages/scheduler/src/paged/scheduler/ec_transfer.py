"""The scheduler side of encoder-cache transfer: vLLM's gaps 1 and 2 (seed: ECConnector 未実装機能).

Gap 1, asynchronous loads. When the EC connector says an item loads
asynchronously, the scheduler allocates its encoder-cache space for a *pin*
(a pseudo request holding the reference, so the entry cannot be evicted while
the worker writes into it), tells the connector to load it
(`update_state_after_alloc`), and from then on schedules no token of any
request from that item's placeholder on until the worker lists the hash in
`ECConnectorOutput.finished_recving`. Requests waiting for it are set aside,
never at the head of the queue, so others keep running. The pin lives on after
the load lands until a waiting request references the entry (or no request
waits any more), so a landed item is not evicted before its reader comes.

    has_cache_item + is_async_load  ->  pin allocated, load started     (loading)
    finished_recving                ->  landed; the next reader takes over the reference
    failed_recving                  ->  pin dropped, entry evicted, hash in `failed`:
                                        "recompute": encoded locally next step
                                        "fail": its waiting requests finish with ERROR

Gap 2, `request_finished`. Every end of a request (finish, abort, error, too
long) reaches `free_request`, which calls `request_ended` here: the request
stops waiting for loads and the connector's `request_finished` is asked; a
`delay_free` answer re-references the request's entries still in the cache
and keeps them until each has been reported in `finished_sending` (a
producer still sending its outputs), so they are not evicted under the sender.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paged.multimodal.encoder_cache import EncoderCacheManager
from paged.multimodal.inputs import MultiModalFeatureSpec
from paged.scheduler.boundary import ECConnectorOutput
from paged.scheduler.connectors import ECConnectorScheduler
from paged.scheduler.request import Request

# Prefix of the pseudo request ids that hold a loading entry (never a real request id:
# real ids reach the scheduler from the frontend, which never starts one with NUL).
_PIN_PREFIX = "\x00ec-load:"


@dataclass(frozen=True, slots=True)
class _LoadPin:
    """A pseudo request referencing one encoder-cache entry (satisfies EncoderCacheRequest)."""

    request_id: str
    mm_features: Sequence[MultiModalFeatureSpec]


@dataclass(slots=True)
class _Load:
    pin: _LoadPin
    waiters: set[str] = field(default_factory=set)  # request ids waiting for this item
    landed: bool = False  # the worker reported finished_recving


@dataclass(slots=True)
class ECTransferState:
    """Encoder items loading asynchronously, failed loads, and delayed frees (see module doc)."""

    load_failure_policy: str = "recompute"
    loads: dict[str, _Load] = field(default_factory=dict)  # mm hash -> its async load
    # Hashes whose load failed: encoded locally instead (cleared once encoded).
    failed: set[str] = field(default_factory=set)
    # Finished requests whose encoder entries a connector is still sending:
    # request id -> (request, mm hashes not yet reported in finished_sending).
    delayed: dict[str, tuple[Request, set[str]]] = field(default_factory=dict)

    def has_pending(self) -> bool:
        """Whether the engine must keep stepping for transfers (loads or delayed frees)."""
        return any(not load.landed for load in self.loads.values()) or bool(self.delayed)

    def is_loading(self, mm_hash: str) -> bool:
        """An async load of `mm_hash` is in flight (its rows are not in the worker yet)."""
        load = self.loads.get(mm_hash)
        return load is not None and not load.landed

    def wait_for(self, mm_hash: str, request_id: str) -> None:
        self.loads[mm_hash].waiters.add(request_id)

    def start_async_load(
        self,
        request: Request,
        index: int,
        encoder_cache: EncoderCacheManager,
        ec_connector: ECConnectorScheduler,
    ) -> None:
        """Allocate item `index`'s entry for a pin and ask the connector to load it."""
        feature = request.mm_features[index]
        pin = _LoadPin(_PIN_PREFIX + feature.identifier, [feature])
        encoder_cache.allocate(pin, 0)
        self.loads[feature.identifier] = _Load(pin, {request.request_id})
        ec_connector.update_state_after_alloc(request, index)

    def on_cache_hit(
        self, mm_hash: str, request_id: str, encoder_cache: EncoderCacheManager
    ) -> None:
        """A request referenced a landed entry: it holds it now, the pin can go."""
        load = self.loads.get(mm_hash)
        if load is None or not load.landed:
            return
        load.waiters.discard(request_id)
        if not load.waiters:
            self._release(mm_hash, encoder_cache)

    def encoded_locally(self, mm_hash: str) -> None:
        """The item was allocated to be encoded here: its failure is dealt with."""
        self.failed.discard(mm_hash)

    def process_output(
        self, output: ECConnectorOutput, encoder_cache: EncoderCacheManager
    ) -> set[str]:
        """Apply the worker's report; returns ids of requests to fail (policy "fail")."""
        for mm_hash in output.finished_recving:
            load = self.loads.get(mm_hash)
            if load is not None:
                load.landed = True
                if not load.waiters:
                    self._release(mm_hash, encoder_cache)
        to_fail: set[str] = set()
        for mm_hash in output.failed_recving:
            load = self.loads.get(mm_hash)
            if load is None:
                continue  # a synchronous load: the runner already encoded it itself
            self._release(mm_hash, encoder_cache)
            # Nothing was written: forget the entry so the item is encoded (or failed).
            encoder_cache.evict_unreferenced(mm_hash)
            self.failed.add(mm_hash)
            if self.load_failure_policy == "fail":
                to_fail |= load.waiters
        for mm_hash in output.finished_sending:
            self._sent(mm_hash, encoder_cache)
        return to_fail

    def request_ended(
        self,
        request: Request,
        encoder_cache: EncoderCacheManager,
        ec_connector: ECConnectorScheduler | None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Gap 2: `request` ended: (references must outlive it, the connector's params).

        The params are what the connector's `request_finished` returned, for the
        response's `ec_transfer_params` (vLLM 0.33: where each item's output is held).
        """
        for mm_hash in [f.identifier for f in request.mm_features]:
            load = self.loads.get(mm_hash)
            if load is not None:
                load.waiters.discard(request.request_id)
                if load.landed and not load.waiters:
                    self._release(mm_hash, encoder_cache)
        if ec_connector is None:
            return False, None
        delay, params = ec_connector.request_finished(request)
        if not delay:
            return False, params
        # References were dropped as each placeholder got computed; take them
        # again on the entries still cached (this revives freeable ones), so
        # none is evicted under the sender. An entry evicted earlier cannot be
        # protected: a connector that sends after `save_caches` returns copies.
        hashes = {
            feature.identifier
            for i, feature in enumerate(request.mm_features)
            if encoder_cache.check_and_update_cache(request, i)
        }
        if not hashes:
            return False, params
        self.delayed[request.request_id] = (request, hashes)
        return True, params

    def _sent(self, mm_hash: str, encoder_cache: EncoderCacheManager) -> None:
        done: list[str] = []
        for req_id, (request, hashes) in self.delayed.items():
            hashes.discard(mm_hash)
            if not hashes:
                encoder_cache.free(request)
                done.append(req_id)
        for req_id in done:
            del self.delayed[req_id]

    def _release(self, mm_hash: str, encoder_cache: EncoderCacheManager) -> None:
        load = self.loads.pop(mm_hash)
        encoder_cache.free(load.pin)

"""`ECZmqConnector`: encoder outputs from an encode-only producer to a consumer over ZMQ.

    proxy -> producer   the request (max_tokens 1); the producer runs only the vision
                        encoder: `save_caches` hands each output to its EmbeddingServer,
                        which holds a CPU copy; the request finishes with no tokens and
                        its response's `ec_transfer_params` name, per mm hash, where the
                        output is held (peer_host, peer_port: vLLM 0.33's shape,
                        `paged.connectors.ec.transfer_params`)
    proxy -> consumer   the same request with those `ec_transfer_params`; for each image
                        not in its encoder cache the scheduler asks `has_cache_item`
                        (yes if the request names its producer, or static
                        producer_endpoints are configured; else it is encoded here),
                        allocates encoder-cache space and records the load with the
                        producer to ask; the load is asynchronous: the request waits
                        for the embeddings while the engine steps the others
    consumer worker     `start_load_caches` submits the hashes to its EmbeddingFetcher
                        (a thread); `get_finished` copies what arrived straight into the
                        registered preallocated encoder cache -> finished_recving; what
                        no producer delivered (not held, producer dead past
                        transfer_timeout) -> `get_failed_loads` -> the scheduler encodes
                        it locally or fails its requests (ec_load_failure_policy)
    producer            the consumer's ACK frees the held output (finished_sending); an
                        output nobody fetched is freed after hold_timeout

A hash is fetched once per consumer however many requests share it: the
scheduler's encoder cache finds the second request's item already allocated
(loading or loaded), and the fetcher drops a hash already in flight.
Extra-config keys: `paged.connectors.ec.p2p.config`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec

from paged.connectors.ec.base import (
    ECConnectorBase,
    ECConnectorContext,
    ECConnectorRole,
    EncoderCache,
)
from paged.connectors.ec.config import ECTransferConfig
from paged.connectors.ec.p2p.config import ECZmqConfig
from paged.connectors.ec.p2p.fetcher import EmbeddingFetcher, FetchResult
from paged.connectors.ec.p2p.server import EmbeddingServer
from paged.connectors.ec.transfer_params import announced_endpoint, producer_entries
from paged.scheduler.boundary import ECConnectorMetadata, SchedulerOutput
from paged.scheduler.request import Request

logger = logging.getLogger(__name__)

# A worker step with fetches in flight and nothing else to do waits this long
# for one to land instead of letting the engine spin a core.
_IDLE_WAIT_S = 0.005


class ECZmqLoad(msgspec.Struct, array_like=True, frozen=True):
    mm_hash: str
    num_embeds: int
    # The producers to ask: the one the request announced, else the static list.
    endpoints: list[str] = msgspec.field(default_factory=list)


class ECZmqMetadata(ECConnectorMetadata, array_like=True, omit_defaults=True, frozen=True):
    """One step's loads (consumer); the producer needs no metadata."""

    loads: list[ECZmqLoad] = msgspec.field(default_factory=list)


class ECZmqConnector(ECConnectorBase):
    """See the module docstring."""

    def __init__(
        self, config: ECTransferConfig, role: ECConnectorRole, context: ECConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        # A consumer needs no producer list: each request names its producers
        # (vLLM 0.33's ec_transfer_params); a static list is the fallback.
        self.zmq_config = ECZmqConfig.from_extra_config(config.ec_connector_extra_config)
        # Scheduler side: this step's loads.
        self._step_loads: list[ECZmqLoad] = []
        # Worker side.
        self._news = threading.Event()
        self.server: EmbeddingServer | None = None
        self.fetcher: EmbeddingFetcher | None = None
        self._expected: dict[str, int] = {}  # mm hash -> embeddings, loads in flight
        self._failed: set[str] = set()
        # Totals since start-up (for tests, logs and metrics).
        self.num_loaded = 0
        self.num_load_failures = 0
        self.bytes_received = 0
        if role is ECConnectorRole.WORKER:
            if self.is_producer:
                self.server = EmbeddingServer(self.zmq_config, self._news)
            if self.is_consumer:
                self.fetcher = EmbeddingFetcher(self.zmq_config, self._news)

    def shutdown(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None
        if self.server is not None:
            self.server.close()
            self.server = None

    # --------------------------------------------------------------- scheduler side

    def has_cache_item(self, identifier: str, request: Request | None = None) -> bool:
        # Some producer is worth asking: the one the request announces for this hash
        # (the proxy forwards the encoder's answer), or any of the static list. A
        # miss (not held, producer dead) comes back as a failed load.
        self._require_role(ECConnectorRole.SCHEDULER, "has_cache_item")
        if not self.is_consumer:
            return False
        return bool(self._endpoints_for(identifier, request))

    def _endpoints_for(self, mm_hash: str, request: Request | None) -> list[str]:
        params = request.ec_transfer_params if request is not None else None
        announced = announced_endpoint(params, mm_hash)
        if announced is not None:
            return [announced]
        return list(self.zmq_config.producer_endpoints)

    def is_async_load(self, identifier: str) -> bool:
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._require_role(ECConnectorRole.SCHEDULER, "update_state_after_alloc")
        feature = request.mm_features[index]
        self._step_loads.append(
            ECZmqLoad(
                feature.identifier,
                feature.mm_position.get_num_embeds(),
                self._endpoints_for(feature.identifier, request),
            )
        )

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        # A producer keeps a finished request's encoder-cache entries until its worker
        # reports them released (acknowledged by the consumer, or hold_timeout), so the
        # engine keeps stepping, and reporting, until then. Its answer names where each
        # item is held (vLLM 0.33's ec_transfer_params) for the proxy to forward. An
        # item served from the producer's encoder cache was not saved again: a consumer
        # that asks for it after its hold ended gets a miss and encodes it itself.
        self._require_role(ECConnectorRole.SCHEDULER, "request_finished")
        if not (self.is_producer and request.mm_features):
            return False, None
        features = [(f.identifier, f.modality) for f in request.mm_features]
        config = self.zmq_config
        return True, producer_entries(features, config.peer_host, config.listen_port)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECZmqMetadata:
        self._require_role(ECConnectorRole.SCHEDULER, "build_connector_meta")
        loads, self._step_loads = self._step_loads, []
        return ECZmqMetadata(loads=loads)

    # ------------------------------------------------------------------ worker side

    def start_load_caches(self, encoder_cache: EncoderCache, **kwargs: Any) -> None:
        self._require_role(ECConnectorRole.WORKER, "start_load_caches")
        if self.fetcher is None or not self.has_connector_metadata():
            return
        for load in self._get_connector_metadata(ECZmqMetadata).loads:
            if load.mm_hash in self._expected:
                continue
            self._expected[load.mm_hash] = load.num_embeds
            self.fetcher.submit(load.mm_hash, load.endpoints)

    def save_caches(self, encoder_cache: EncoderCache, mm_hash: str, **kwargs: Any) -> None:
        self._require_role(ECConnectorRole.WORKER, "save_caches")
        if self.server is None:
            return
        output = encoder_cache.get(mm_hash)
        if output is None:
            raise ValueError(f"save_caches: mm_hash {mm_hash} is not in the encoder cache")
        self.server.put(mm_hash, output)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._require_role(ECConnectorRole.WORKER, "get_finished")
        sending: set[str] | None = None
        if self.server is not None:
            sending = self.server.take_freed()
            if not sending and self.fetcher is None and self.server.num_held():
                # Only holds pending (the engine steps for their release): wait a moment.
                self._news.wait(_IDLE_WAIT_S)
                self._news.clear()
                sending = self.server.take_freed()
        recving: set[str] | None = None
        if self.fetcher is not None:
            results = self.fetcher.collect()
            if not results and self._expected:
                # Nothing else may be running: wait a moment for news, not a busy spin.
                self._news.wait(_IDLE_WAIT_S)
                results = self.fetcher.collect()
            self._news.clear()
            recving = set()
            for result in results:
                if self._store(result):
                    recving.add(result.mm_hash)
        return sending, recving

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def _store(self, result: FetchResult) -> bool:
        """Copy a fetched output into the registered cache; False (recorded failed) if not."""
        expected = self._expected.pop(result.mm_hash, None)
        if expected is None:
            return False  # not asked by this worker (a late duplicate)
        cache = self.registered_cache
        error = result.error
        output = result.output
        if error is None and cache is None:
            error = "register_caches was never called"
        if error is None and output is not None and cache is not None:
            if result.mm_hash in cache:
                return True  # already there (encoded locally meanwhile)
            if output.dim() != 2 or tuple(output.shape) != (expected, cache.hidden_size):
                error = (
                    f"the producer sent shape {list(output.shape)}, the consumer expects "
                    f"[{expected}, {cache.hidden_size}] (do both serve the same model?)"
                )
            else:
                rows = cache.allocate(result.mm_hash, expected)
                rows.copy_(output.to(device=rows.device, dtype=rows.dtype))
                self.num_loaded += 1
                self.bytes_received += result.num_bytes
                return True
        logger.warning("EC transfer: mm_hash %s not loaded: %s", result.mm_hash, error)
        self.num_load_failures += 1
        self._failed.add(result.mm_hash)
        return False

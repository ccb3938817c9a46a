"""Producer side: hold encoder outputs and serve them to consumers (a ROUTER thread).

    worker:  put(mm_hash, output)   a CPU copy is held, deadline = now + hold_timeout;
                                    a hash held already gains a reference and a fresh
                                    deadline (two requests, maybe two consumers)
    thread:  <- FETCH               held: DATA with its bytes; else DATA with an error
             <- ACK                 a consumer has it: one reference released, the copy
                                    freed with the last; expiry frees it whatever is left
    worker:  take_freed()           hashes with a reference released since the last call
                                    (ECConnectorOutput.finished_sending: the scheduler
                                    frees the finished requests waiting on them)

The thread only reads held CPU copies, never the encoder cache the model
writes, so the step that runs meanwhile is never disturbed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from paged.connectors.ec.p2p import wire
from paged.connectors.ec.p2p.config import ECZmqConfig
from paged.connectors.kv.p2p.sender import _readable
from paged.connectors.kv.p2p.stats import TransferStats

logger = logging.getLogger(__name__)

_POLL_MS = 10


@dataclass
class _Held:
    output: torch.Tensor  # CPU, contiguous
    deadline: float
    refs: int = 1  # puts not yet acknowledged


@dataclass
class ServerCounters:
    """Totals since start-up (the metrics read them)."""

    held: int = 0  # outputs put
    acknowledged: int = 0  # freed by a consumer's ACK
    expired: int = 0  # freed after hold_timeout
    served: int = 0  # DATA replies with bytes
    not_found: int = 0  # DATA replies with an error


class EmbeddingServer:
    """Serves held encoder outputs on `config.listen_endpoint`; see the module doc."""

    def __init__(self, config: ECZmqConfig, news: threading.Event | None = None) -> None:
        self._config = config
        self._news = news
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._freed: set[str] = set()
        self.counters = ServerCounters()
        self.stats = TransferStats()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = config.listen_endpoint
        try:
            self._sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ValueError(
                f"ECZmqConnector: cannot listen on {self.endpoint} ({exc}); set "
                "ec_connector_extra_config.listen_port to a free port"
            ) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-ec-server", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ worker thread API

    def put(self, mm_hash: str, output: torch.Tensor) -> None:
        copy = output.detach().to("cpu", copy=True).contiguous()
        deadline = time.monotonic() + self._config.hold_timeout
        with self._lock:
            held = self._held.get(mm_hash)
            if held is None:
                self._held[mm_hash] = _Held(copy, deadline)
            else:
                held.refs += 1
                held.deadline = deadline
            self.counters.held += 1

    def take_freed(self) -> set[str]:
        """Hashes freed since the last call: acknowledged, or held past hold_timeout.

        The thread frees them as soon as it knows (no engine step needed); this
        only collects the report.
        """
        self._expire()
        with self._lock:
            freed, self._freed = self._freed, set()
        return freed

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for mm_hash, held in list(self._held.items()):
                if held.deadline <= now:
                    logger.warning(
                        "EC transfer: no consumer fetched mm_hash %s within %.1f s "
                        "(hold_timeout); freeing it",
                        mm_hash,
                        self._config.hold_timeout,
                    )
                    del self._held[mm_hash]
                    self._freed.add(mm_hash)
                    self.counters.expired += 1
                    self.stats.expired += 1

    def holds(self, mm_hash: str) -> bool:
        with self._lock:
            return mm_hash in self._held

    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.output.numel() * h.output.element_size() for h in self._held.values())

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            out = self.stats.take("send")
        return {k.replace("p2p.", "ec_p2p.", 1): v for k, v in out.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(_POLL_MS):
                    while _readable(self._sock):
                        self._handle(self._sock.recv_multipart())
                self._expire()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.error("EC transfer server: %s", exc)
            except Exception:  # a bad message must not kill the server thread
                logger.exception("EC transfer server: failed to handle a message")

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            return
        identity, kind, payload = frames[0], frames[1], frames[2]
        if kind == wire.FETCH:
            self._serve(identity, wire.FETCH_DECODER.decode(payload))
        elif kind == wire.ACK:
            ack = wire.ACK_DECODER.decode(payload)
            with self._lock:
                held = self._held.get(ack.mm_hash)
                if held is not None:
                    held.refs -= 1
                    if held.refs <= 0:
                        del self._held[ack.mm_hash]
                    self._freed.add(ack.mm_hash)
                    self.counters.acknowledged += 1
            if self._news is not None:
                self._news.set()

    def _serve(self, identity: bytes, fetch: wire.FetchRequest) -> None:
        start = time.perf_counter()
        with self._lock:
            held = self._held.get(fetch.mm_hash)
        if held is None:
            header = wire.EmbeddingHeader(
                fetch.transfer_id,
                fetch.mm_hash,
                error=f"mm_hash {fetch.mm_hash} is not held by this encoder producer "
                "(never encoded here, already acknowledged, or expired)",
            )
            self._sock.send_multipart([identity, wire.DATA, wire.ENCODER.encode(header)])
            with self._lock:
                self.counters.not_found += 1
                self.stats.failures += 1
            return
        out = held.output
        header = wire.EmbeddingHeader(
            fetch.transfer_id, fetch.mm_hash, list(out.shape), wire.dtype_name(out.dtype)
        )
        data = wire.tensor_bytes(out)
        self._sock.send_multipart(
            [identity, wire.DATA, wire.ENCODER.encode(header), data], copy=False
        )
        with self._lock:
            self.counters.served += 1
            self.stats.transfers += 1
            self.stats.bytes += data.nbytes
            self.stats.seconds += time.perf_counter() - start

"""Consumer side: fetch encoder outputs by mm hash in a background thread.

    worker: submit(mm_hash, endpoints)
                              queued for the thread (a hash already in flight is not
                              asked twice); `endpoints` are the producers to ask (the
                              one the request announced), else the configured list
    thread: FETCH to those producers; the first DATA with bytes wins and is
            acknowledged (that producer frees it); errors from every producer, or
            no reply within transfer_timeout, fail the fetch
    worker: collect()         finished fetches (a CPU tensor or an error); the worker
                              copies the tensor into its encoder cache, so the cache
                              is only written by the thread that runs the model

A producer that does not answer within `transfer_timeout` counts as dead for
that fetch; its socket is dropped (queued messages go with it) and rebuilt on
the next fetch, so a restarted producer is used again.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq

from paged.connectors.ec.p2p import wire
from paged.connectors.ec.p2p.config import ECZmqConfig
from paged.connectors.kv.p2p.sender import _readable

logger = logging.getLogger(__name__)

_POLL_MS = 5


@dataclass
class FetchResult:
    """A finished fetch: `output` (CPU) or `error` saying why not."""

    mm_hash: str
    output: torch.Tensor | None
    error: str | None
    num_bytes: int
    seconds: float


@dataclass
class _Fetch:
    mm_hash: str
    transfer_id: int
    started: float
    waiting_on: set[str] = field(default_factory=set)  # endpoints yet to answer
    errors: list[str] = field(default_factory=list)


class EmbeddingFetcher:
    """See the module docstring. One per worker."""

    def __init__(self, config: ECZmqConfig, news: threading.Event | None = None) -> None:
        self._config = config
        self._news = news
        self._inbox: queue.SimpleQueue[tuple[str, tuple[str, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._results: list[FetchResult] = []
        self._ids = itertools.count(1)
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._in_flight: dict[int, _Fetch] = {}
        self._by_hash: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-ec-fetcher", daemon=True)
        self._thread.start()

    def submit(self, mm_hash: str, endpoints: Sequence[str] = ()) -> None:
        """Fetch `mm_hash` from `endpoints` (ZMQ addresses), else the configured producers."""
        self._inbox.put((mm_hash, tuple(endpoints)))

    def collect(self) -> list[FetchResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._socks.values():
            sock.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ the thread

    def _sock(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.close()
                raise
            self._socks[endpoint] = sock
        return sock

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                self._poll()
                self._expire()
            except Exception:  # keep fetching for the other items
                logger.exception("EC transfer fetcher: unexpected error")

    def _drain_inbox(self) -> None:
        while True:
            try:
                mm_hash, endpoints = self._inbox.get_nowait()
            except queue.Empty:
                return
            if mm_hash in self._by_hash:
                continue
            fetch = _Fetch(mm_hash, next(self._ids), time.monotonic())
            request = wire.ENCODER.encode(wire.FetchRequest(fetch.transfer_id, mm_hash))
            targets = endpoints or self._config.producer_endpoints
            if not targets:
                fetch.errors.append("no producer known for it (no ec_transfer_params entry)")
            for endpoint in targets:
                try:
                    self._sock(endpoint).send_multipart([wire.FETCH, request])
                except zmq.ZMQError as exc:
                    fetch.errors.append(f"{endpoint}: {exc}")
                    continue
                fetch.waiting_on.add(endpoint)
            self._in_flight[fetch.transfer_id] = fetch
            self._by_hash[mm_hash] = fetch.transfer_id
            if not fetch.waiting_on:
                self._finish(fetch, None, "; ".join(fetch.errors), 0)

    def _poll(self) -> None:
        if not self._socks:
            time.sleep(_POLL_MS / 1000)
            return
        poller = zmq.Poller()
        by_sock = {}
        for endpoint, sock in self._socks.items():
            poller.register(sock, zmq.POLLIN)
            by_sock[sock] = endpoint
        for sock, _ in poller.poll(_POLL_MS):
            endpoint = by_sock[sock]
            while _readable(sock):
                self._handle(endpoint, sock, sock.recv_multipart(copy=False))

    def _handle(self, endpoint: str, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> None:
        if len(frames) < 2 or frames[0].bytes != wire.DATA:
            return
        header = wire.HEADER_DECODER.decode(frames[1].bytes)
        fetch = self._in_flight.get(header.transfer_id)
        if fetch is None:
            # Answered by another producer already, or timed out: a late copy is
            # still acknowledged so that producer frees it too.
            if header.error is None:
                sock.send_multipart([wire.ACK, wire.ENCODER.encode(wire.Ack(header.mm_hash))])
            return
        fetch.waiting_on.discard(endpoint)
        if header.error is not None:
            fetch.errors.append(f"{endpoint}: {header.error}")
            if not fetch.waiting_on:
                self._finish(fetch, None, "; ".join(fetch.errors), 0)
            return
        sock.send_multipart([wire.ACK, wire.ENCODER.encode(wire.Ack(header.mm_hash))])
        data = frames[2].buffer if len(frames) > 2 else memoryview(b"")
        try:
            output = wire.tensor_from_bytes(header, data)
        except ValueError as exc:
            self._finish(fetch, None, f"{endpoint}: {exc}", 0)
            return
        self._finish(fetch, output, None, data.nbytes)

    def _expire(self) -> None:
        now = time.monotonic()
        timeout = self._config.transfer_timeout
        dead: set[str] = set()
        for fetch in list(self._in_flight.values()):
            if now - fetch.started <= timeout:
                continue
            for endpoint in fetch.waiting_on:
                dead.add(endpoint)
                fetch.errors.append(
                    f"no reply from the encoder producer at {endpoint} within "
                    f"{timeout:.1f} s (transfer_timeout): is it running?"
                )
            self._finish(fetch, None, "; ".join(fetch.errors), 0)
        for endpoint in dead:
            logger.error("EC transfer: producer %s did not answer in time", endpoint)
            sock = self._socks.pop(endpoint, None)
            if sock is not None:
                sock.close(linger=0)

    def _finish(
        self, fetch: _Fetch, output: torch.Tensor | None, error: str | None, num_bytes: int
    ) -> None:
        self._in_flight.pop(fetch.transfer_id, None)
        self._by_hash.pop(fetch.mm_hash, None)
        result = FetchResult(
            fetch.mm_hash, output, error, num_bytes, time.monotonic() - fetch.started
        )
        with self._lock:
            self._results.append(result)
        if self._news is not None:
            self._news.set()

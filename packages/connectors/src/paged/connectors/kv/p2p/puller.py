"""Decode side: pull remote blocks in a background thread while the engine keeps stepping.

    worker: submit(RecvSpec)       queued for the thread
    thread: first contact with a prefill rank: HELLO, check the layouts (a
            mismatch fails every pull to it, naming the field); then PULL;
            DATA -> the bytes are kept, DONE goes back (the prefill frees)
    worker: collect()              finished pulls (bytes or an error); the worker
                                   thread copies the bytes into the paged cache, so the
                                   cache is only ever written by the thread running the model

Every reply is awaited at most `transfer_timeout` seconds: a dead prefill
fails its pulls (load errors: recompute or fail, per kv_load_failure_policy)
and its socket is rebuilt, so a restarted prefill is handshaken again.
Decoders on the prefill's host use its IPC socket when it exists.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import zmq

from paged.connectors.kv.p2p import wire
from paged.connectors.kv.p2p.config import LOOPBACK_HOSTS, ZmqConnectorConfig
from paged.connectors.kv.p2p.handshake import KVHandshakeError, KVLayoutInfo, check_compatible
from paged.connectors.kv.p2p.sender import _readable

logger = logging.getLogger(__name__)

_POLL_MS = 5


@dataclass
class PullResult:
    """A finished pull: `frames` (one per layer) hold `num_blocks` blocks, or `error` says why."""

    req_id: str
    local_block_ids: list[int]
    num_blocks: int
    frames: list[memoryview]
    error: str | None
    seconds: float
    group_sizes: list[int] = field(default_factory=list)  # hybrid: local ids per group


@dataclass
class _Pull:
    spec: wire.RecvSpec
    transfer_id: int
    started: float
    sent_at: float = 0.0


@dataclass
class _Peer:
    """One prefill rank: its socket, handshake state and pulls in flight."""

    endpoint: str
    sock: zmq.Socket[bytes]
    ready: bool = False
    error: str | None = None  # a failed handshake: every pull to it fails with this
    hello_sent_at: float = 0.0
    waiting: list[_Pull] = field(default_factory=list)  # until the handshake is done
    in_flight: dict[int, _Pull] = field(default_factory=dict)


class BlockPuller:
    """See the module docstring. One instance per worker (TP rank)."""

    def __init__(
        self,
        config: ZmqConnectorConfig,
        rank: int,
        info: KVLayoutInfo,
        news: threading.Event,
    ) -> None:
        self._config = config
        self._rank = rank
        self._info = info
        self._news = news
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._results: list[PullResult] = []
        self._ids = itertools.count(1)
        self._ctx = zmq.Context()
        self._peers: dict[tuple[str, str, int], _Peer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-kv-puller", daemon=True)
        self._thread.start()

    def submit(self, spec: wire.RecvSpec) -> None:
        self._inbox.put(("pull", spec))

    def release(self, spec: wire.ReleaseSpec) -> None:
        self._inbox.put(("release", spec))

    def collect(self) -> list[PullResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for peer in self._peers.values():
            peer.sock.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ the thread

    def _endpoint(self, remote: wire.RemoteAddress) -> str:
        if self._config.use_ipc and remote.host in LOOPBACK_HOSTS:
            path = self._config.ipc_path(remote.port, self._rank)
            if os.path.exists(path):
                return self._config.ipc_endpoint(remote.port, self._rank)
        return self._config.tcp_endpoint(remote.host, remote.port, self._rank)

    def _peer(self, remote: wire.RemoteAddress) -> _Peer:
        key = (remote.engine_id, remote.host, remote.port)
        peer = self._peers.get(key)
        if peer is None:
            endpoint = self._endpoint(remote)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            peer = _Peer(endpoint, sock)
            self._peers[key] = peer
        return peer

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                self._poll()
                self._expire()
            except Exception:  # keep pulling for the other requests
                logger.exception("KV transfer puller: unexpected error")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "pull":
                assert isinstance(item, wire.RecvSpec)
                self._start(item)
            elif isinstance(item, wire.ReleaseSpec):
                peer = self._peer(item.remote)
                done = wire.Done(item.remote_request_id)
                peer.sock.send_multipart([wire.DONE, wire.ENCODER.encode(done)])

    def _start(self, spec: wire.RecvSpec) -> None:
        pull = _Pull(spec, next(self._ids), time.monotonic())
        peer = self._peer(spec.remote)
        if peer.error is not None:
            self._finish(pull, None, [], peer.error)
        elif peer.ready:
            self._send_pull(peer, pull)
        else:
            peer.waiting.append(pull)
            if not peer.hello_sent_at:
                peer.hello_sent_at = time.monotonic()
                peer.sock.send_multipart([wire.HELLO, wire.ENCODER.encode(self._info)])

    def _send_pull(self, peer: _Peer, pull: _Pull) -> None:
        spec = pull.spec
        msg = wire.PullRequest(
            pull.transfer_id, spec.remote_request_id, spec.remote_block_ids, spec.group_sizes
        )
        pull.sent_at = time.monotonic()
        peer.in_flight[pull.transfer_id] = pull
        peer.sock.send_multipart([wire.PULL, wire.ENCODER.encode(msg)])

    def _poll(self) -> None:
        poller = zmq.Poller()
        socks = {}
        for peer in self._peers.values():
            poller.register(peer.sock, zmq.POLLIN)
            socks[peer.sock] = peer
        if not socks:
            time.sleep(_POLL_MS / 1000)
            return
        for sock, _ in poller.poll(_POLL_MS):
            peer = socks[sock]
            while _readable(peer.sock):
                self._handle(peer, peer.sock.recv_multipart(copy=False))

    def _handle(self, peer: _Peer, frames: list[zmq.Frame]) -> None:
        kind = frames[0].bytes
        if kind == wire.HELLO:
            reply = wire.HELLO_REPLY_DECODER.decode(frames[1].bytes)
            error = reply.error
            if error is None:
                try:
                    check_compatible(self._info, reply.info)
                except KVHandshakeError as exc:
                    error = str(exc)
            waiting, peer.waiting = peer.waiting, []
            if error is not None:
                logger.error("%s", error)
                peer.error = error
                for pull in waiting:
                    self._finish(pull, None, [], error)
                return
            peer.ready = True
            for pull in waiting:
                self._send_pull(peer, pull)
        elif kind == wire.DATA:
            header = wire.DATA_DECODER.decode(frames[1].bytes)
            if header.transfer_id not in peer.in_flight:
                return  # timed out already
            pull = peer.in_flight.pop(header.transfer_id)
            done = wire.Done(pull.spec.remote_request_id)
            peer.sock.send_multipart([wire.DONE, wire.ENCODER.encode(done)])
            layers = [f.buffer for f in frames[2:]]
            if header.error is not None:
                self._finish(pull, None, [], f"the prefill engine refused: {header.error}")
            elif header.num_blocks and len(layers) != self._info.num_layers:
                self._finish(pull, None, [], f"{len(layers)} layers received")
            else:
                self._finish(pull, header.num_blocks, layers, None)

    def _expire(self) -> None:
        now = time.monotonic()
        timeout = self._config.transfer_timeout
        for key, peer in list(self._peers.items()):
            stale = [p for p in peer.in_flight.values() if now - p.sent_at > timeout]
            hello_stale = bool(peer.waiting) and now - peer.hello_sent_at > timeout
            if not stale and not hello_stale:
                continue
            error = (
                f"no reply from the prefill engine at {peer.endpoint} within "
                f"{timeout:.1f} s (transfer_timeout): is it running?"
            )
            logger.error("KV transfer: %s", error)
            for pull in [*peer.in_flight.values(), *peer.waiting]:
                self._finish(pull, None, [], error)
            # Drop the socket: messages queued for a dead peer go with it, and a
            # restarted prefill is handshaken afresh.
            peer.sock.close(linger=0)
            del self._peers[key]

    def _finish(
        self, pull: _Pull, num_blocks: int | None, frames: list[memoryview], error: str | None
    ) -> None:
        result = PullResult(
            req_id=pull.spec.req_id,
            local_block_ids=pull.spec.local_block_ids,
            num_blocks=num_blocks or 0,
            frames=frames,
            error=error,
            seconds=time.monotonic() - pull.started,
            group_sizes=pull.spec.group_sizes,
        )
        with self._lock:
            self._results.append(result)
        self._news.set()

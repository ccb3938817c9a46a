"""Prefill side: hold finished requests' blocks and serve them to decoders (a thread).

    scheduler: request_finished -> SendSpec in the next step's metadata
    worker:    hold(specs)            blocks held, deadline = now + abort_request_timeout
    thread:    ROUTER <- HELLO        reply with this worker's KVLayoutInfo (+ its own check)
               ROUTER <- PULL         held: reply DATA with the blocks asked for (the prefix it
                                      holds); not held yet (the metadata comes one step after
                                      the response left): park it, retry, error after
                                      transfer_timeout
               ROUTER <- DONE         the decoder has the bytes: release
    worker:    take_finished()        released + expired ids -> finished_sending (blocks freed)

The thread only reads the cache, and only blocks the scheduler keeps
allocated (delay_free) until they are reported here, so the forward that
runs meanwhile never writes them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import zmq

from paged.connectors.kv.p2p import wire
from paged.connectors.kv.p2p.config import ZmqConnectorConfig
from paged.connectors.kv.p2p.handshake import KVHandshakeError, KVLayoutInfo, check_compatible
from paged.connectors.kv.p2p.stats import TransferStats
from paged.connectors.kv.p2p.tensors import gather_blocks

logger = logging.getLogger(__name__)

_POLL_MS = 10
_GONE_REMEMBERED = 4096  # recently released ids: a late PULL gets an error at once


@dataclass
class _Held:
    block_ids: list[int]
    deadline: float


@dataclass
class _Parked:
    identity: bytes
    pull: wire.PullRequest
    since: float


class BlockSender:
    """Serves held blocks on `tcp://host:port+rank` (and an IPC socket); see the module doc."""

    def __init__(
        self,
        config: ZmqConnectorConfig,
        rank: int,
        info: KVLayoutInfo,
        kv_caches: Mapping[str, torch.Tensor],
        news: threading.Event,
        layer_groups: Sequence[int] | None = None,
    ) -> None:
        self._config = config
        self._info = info
        self._kv_caches = dict(kv_caches)
        # Per layer (kv_caches order), its KV cache group (hybrid pulls name blocks per group).
        self._layer_groups = list(layer_groups or [0] * len(self._kv_caches))
        self._news = news
        self._lock = threading.RLock()  # _reply_error may run under it
        self._held: dict[str, _Held] = {}
        self._finished: set[str] = set()
        self._gone: OrderedDict[str, str] = OrderedDict()  # req id -> why
        self.stats = TransferStats()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host = "127.0.0.1" if config.side_channel_host == "localhost" else config.side_channel_host
        self.endpoints = [config.tcp_endpoint(host, config.side_channel_port, rank)]
        self._ipc_path: str | None = None
        try:
            self._sock.bind(self.endpoints[0])
            if config.use_ipc:
                self._ipc_path = config.ipc_path(config.side_channel_port, rank)
                if os.path.exists(self._ipc_path):
                    os.unlink(self._ipc_path)  # a stale socket file of a dead engine
                self._sock.bind(config.ipc_endpoint(config.side_channel_port, rank))
                self.endpoints.append(config.ipc_endpoint(config.side_channel_port, rank))
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ValueError(
                f"PagedZmqConnector: cannot listen on {self.endpoints[-1]} ({exc}); set "
                "kv_connector_extra_config.side_channel_port to a free port"
            ) from None
        self._stop = threading.Event()
        self._parked: list[_Parked] = []
        self._thread = threading.Thread(target=self._run, name="paged-kv-sender", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ worker thread API

    def hold(self, sends: list[wire.SendSpec]) -> None:
        deadline = time.monotonic() + self._config.abort_request_timeout
        with self._lock:
            for spec in sends:
                self._held[spec.req_id] = _Held(list(spec.block_ids), deadline)

    def take_finished(self) -> set[str]:
        """Requests whose blocks may be freed: acknowledged, or past the abort timeout."""
        now = time.monotonic()
        with self._lock:
            for req_id, held in list(self._held.items()):
                if held.deadline <= now:
                    logger.warning(
                        "KV transfer: no decoder pulled request %s within %.1f s "
                        "(abort_request_timeout); freeing its %d blocks",
                        req_id,
                        self._config.abort_request_timeout,
                        len(held.block_ids),
                    )
                    self._release(req_id, "freed after abort_request_timeout")
                    self.stats.expired += 1
            finished, self._finished = self._finished, set()
        return finished

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            return self.stats.take("send")

    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()
        if self._ipc_path is not None and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)

    # ------------------------------------------------------------------ the thread

    def _release(self, req_id: str, why: str) -> None:
        """Under the lock: forget a held request and report it as finished sending."""
        self._held.pop(req_id, None)
        self._finished.add(req_id)
        self._gone[req_id] = why
        while len(self._gone) > _GONE_REMEMBERED:
            self._gone.popitem(last=False)
        self._news.set()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(_POLL_MS):
                    while _readable(self._sock):
                        self._handle(self._sock.recv_multipart())
                self._retry_parked()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.error("KV transfer sender: %s", exc)
            except Exception:  # a bad message must not kill the server thread
                logger.exception("KV transfer sender: failed to handle a message")

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            return
        identity, kind, payload = frames[0], frames[1], frames[2]
        if kind == wire.HELLO:
            theirs = wire.INFO_DECODER.decode(payload)
            error: str | None = None
            try:
                check_compatible(self._info, theirs)
            except KVHandshakeError as exc:
                error = str(exc)
                logger.error("%s", error)
            reply = wire.HelloReply(info=self._info, error=error)
            self._sock.send_multipart([identity, wire.HELLO, wire.ENCODER.encode(reply)])
        elif kind == wire.PULL:
            pull = wire.PULL_DECODER.decode(payload)
            if not self._serve(identity, pull):
                self._parked.append(_Parked(identity, pull, time.monotonic()))
        elif kind == wire.DONE:
            done = wire.DONE_DECODER.decode(payload)
            with self._lock:
                if done.remote_request_id in self._held:
                    self._release(done.remote_request_id, "already sent and acknowledged")

    def _serve(self, identity: bytes, pull: wire.PullRequest) -> bool:
        """Reply to a pull; False if the request is not known yet (park it)."""
        start = time.perf_counter()
        with self._lock:
            held = self._held.get(pull.remote_request_id)
            if held is None:
                why = self._gone.get(pull.remote_request_id)
                if why is None:
                    return False
                self._reply_error(identity, pull, f"request {pull.remote_request_id!r}: {why}")
                return True
            owned = set(held.block_ids)
            if pull.group_sizes:
                frames, n = self._group_frames(pull, owned)
            else:
                # The prefix of the asked blocks this request holds; the decoder
                # recomputes the rest.
                n = 0
                while n < len(pull.block_ids) and pull.block_ids[n] in owned:
                    n += 1
                ids = pull.block_ids[:n]
                frames = (
                    [gather_blocks(cache, ids) for cache in self._kv_caches.values()] if n else []
                )
        header = wire.DataHeader(transfer_id=pull.transfer_id, num_blocks=n)
        self._sock.send_multipart(
            [identity, wire.DATA, wire.ENCODER.encode(header), *frames], copy=False
        )
        with self._lock:
            self.stats.transfers += 1
            self.stats.bytes += sum(f.nbytes for f in frames)
            self.stats.seconds += time.perf_counter() - start
        return True

    def _group_frames(
        self, pull: wire.PullRequest, owned: set[int]
    ) -> tuple[list[memoryview], int]:
        """A hybrid pull: every layer's own group's blocks, all or nothing."""
        try:
            groups = wire.split_groups(pull.block_ids, pull.group_sizes)
        except ValueError:
            return [], 0
        if len(groups) <= max(self._layer_groups) or not owned.issuperset(pull.block_ids):
            return [], 0
        frames = [
            gather_blocks(cache, groups[g])
            for cache, g in zip(self._kv_caches.values(), self._layer_groups, strict=True)
        ]
        return frames, len(pull.block_ids)

    def _reply_error(self, identity: bytes, pull: wire.PullRequest, error: str) -> None:
        header = wire.DataHeader(transfer_id=pull.transfer_id, num_blocks=0, error=error)
        self._sock.send_multipart([identity, wire.DATA, wire.ENCODER.encode(header)])
        with self._lock:
            self.stats.failures += 1

    def _retry_parked(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        still: list[_Parked] = []
        for parked in self._parked:
            if self._serve(parked.identity, parked.pull):
                continue
            if now - parked.since > self._config.transfer_timeout:
                self._reply_error(
                    parked.identity,
                    parked.pull,
                    f"request {parked.pull.remote_request_id!r} is not held by this prefill "
                    "engine (it finished without do_remote_decode, was aborted, or is unknown)",
                )
            else:
                still.append(parked)
        self._parked = still


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message is waiting (drain all before polling again)."""
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

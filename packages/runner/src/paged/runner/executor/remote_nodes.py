"""`RemoteNodes`: node 0's executor reaching the workers of nodes 1..N-1 (the node link).

    MultiprocExecutor --(shm ring)--> local ranks 0..L-1
        --send_call--> [I/O thread] --ROUTER/TCP--> agent of node R --(shm)--> its ranks
        <--collect---- [I/O thread] <-- NodeReply -- (one per call, in call order)

One daemon thread owns the ROUTER socket (ZMQ sockets are single-threaded):
it takes calls from the executor through an inproc pipe and sends them to
every node, files each node's replies in that node's queue, answers Hellos,
sends heartbeats and watches the nodes:

- a node that reports `NodeFailed` (one of its workers died),
- a node whose TCP connection closes (its agent process died): noticed from
  the socket monitor, then pinned to the node that stops heartbeating within
  three heartbeat intervals,
- a node silent for `heartbeat_timeout_s` (a lost host or network)

marks the link failed; `check_alive()` raises `WorkerDiedError` with that
reason from then on, which is how the executor's waits (local or remote) turn
into the same error a dead local worker gives.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from paged.runner.config import ParallelConfig
from paged.runner.executor.abstract import WorkerDiedError, WorkerError
from paged.runner.executor.messages import Reply
from paged.runner.executor.node_wire import (
    FLAG_ALL_RESULTS,
    FLAG_OUTPUT_RANK_ONLY,
    KIND_CALL,
    Fingerprint,
    Heartbeat,
    Hello,
    LinkTimeouts,
    NodeFailed,
    NodeReady,
    NodeReply,
    Welcome,
    control_frames,
    decode_control,
    link_endpoint,
)
from paged.runner.executor.rank_layout import node_ranks

logger = logging.getLogger(__name__)

_POLL_S = 0.2


@dataclass
class _Node:
    """What node 0 knows about one remote node."""

    rank: int
    identity: bytes
    host: str
    pid: int
    last_seen: float
    ready: NodeReady | None = None


class RemoteNodes:
    """Node 0's side of the node link; see the module docstring."""

    def __init__(
        self,
        parallel: ParallelConfig,
        fingerprint: Fingerprint,
        output_rank: int,
        timeouts: LinkTimeouts,
    ) -> None:
        if parallel.master_addr is None:
            raise ValueError("master_addr: required with nnodes > 1")
        self.node_ranks = list(range(1, parallel.nnodes))
        self.remote_ranks = [r for n in self.node_ranks for r in node_ranks(parallel, n)]
        self.endpoint = link_endpoint(parallel.master_addr, parallel.master_port)
        self._fingerprint = fingerprint
        self._output_rank = output_rank
        self._timeouts = timeouts
        self._nodes: dict[int, _Node] = {}
        self._replies: dict[int, queue.SimpleQueue[NodeReply]] = {
            n: queue.SimpleQueue() for n in self.node_ranks
        }
        self._failure: str | None = None
        self._lock = threading.Lock()  # guards _nodes/_failure and the inproc send side
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._router.close()
            self._ctx.term()
            raise ValueError(
                f"master_addr/master_port: cannot listen for the other nodes at {self.endpoint} "
                f"({exc}); master_addr must be an address of this node (node 0) and "
                f"master_port + 1 free"
            ) from None
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        pipe = f"inproc://paged-node-link-{id(self)}"
        self._pipe_in = self._ctx.socket(zmq.PAIR)
        self._pipe_in.bind(pipe)
        self._pipe_out = self._ctx.socket(zmq.PAIR)
        self._pipe_out.connect(pipe)
        self._thread = threading.Thread(target=self._run, name="paged-node-link", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ executor side

    def check_alive(self) -> None:
        """Raise WorkerDiedError once any remote node is gone."""
        if self._failure is not None:
            raise WorkerDiedError(self._failure)

    def wait_joined(self, deadline: float) -> None:
        """Block until every node said Hello; TimeoutError names the missing ones."""
        while True:
            self.check_alive()
            with self._lock:
                missing = [n for n in self.node_ranks if n not in self._nodes]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"multi-node start-up timed out: node(s) {missing} never joined at "
                    f"{self.endpoint}; start `paged serve MODEL ... --headless --nnodes "
                    f"{len(self.node_ranks) + 1} --node-rank R --master-addr ADDR` on each "
                    "(the same model and engine flags as node 0)"
                )
            time.sleep(_POLL_S)

    def wait_ready(self, deadline: float) -> None:
        """Block until every node loaded its workers; WorkerError carries their errors."""
        while True:
            self.check_alive()
            with self._lock:
                loading = [n for n, node in self._nodes.items() if node.ready is None]
                ready = [node.ready for node in self._nodes.values() if node.ready is not None]
            if not loading and len(ready) == len(self.node_ranks):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"multi-node start-up timed out: node(s) {loading} joined but their "
                    "workers did not start in time"
                )
            time.sleep(_POLL_S)
        errors = [e for r in ready for e in r.errors]
        if errors:
            raise WorkerError("\n".join(errors))

    def send_call(self, payload: bytes, output_rank_only: bool) -> None:
        """Send one encoded WorkerCall to every node (in call order, thread-safe)."""
        self.check_alive()
        flag = FLAG_OUTPUT_RANK_ONLY if output_rank_only else FLAG_ALL_RESULTS
        with self._lock:
            self._pipe_out.send_multipart([KIND_CALL, flag, payload], copy=False)

    def collect(self, deadline: float | None) -> list[Reply]:
        """Every node's reply to the oldest call not yet collected (call order)."""
        replies: list[Reply] = []
        for node in self.node_ranks:
            box = self._replies[node]
            while True:
                self.check_alive()
                if self._stop.is_set():
                    raise RuntimeError("the executor is shut down")
                try:
                    replies.extend(box.get(timeout=_POLL_S).replies)
                    break
                except queue.Empty:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"node {node} did not answer in time") from None
        return replies

    def close(self) -> None:
        """Stop the I/O thread and close the sockets (the nodes see the connection close)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        for sock in (self._pipe_out, self._pipe_in, self._monitor, self._router):
            sock.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------ I/O thread

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = reason
                logger.error("multi-node: %s", reason)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        interval = self._timeouts.heartbeat_interval_s
        next_beat = time.monotonic() + interval
        disconnected_at: float | None = None
        while not self._stop.is_set():
            events = dict(poller.poll(timeout=int(interval * 1000)))
            try:
                if self._pipe_in in events:
                    self._forward_calls()
                if self._router in events:
                    self._receive()
                if self._monitor in events:
                    self._monitor.recv_multipart()
                    disconnected_at = disconnected_at or time.monotonic()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                self._fail(f"the node link failed: {exc}")
            now = time.monotonic()
            if now >= next_beat:
                self._send_to_all(control_frames(Heartbeat()))
                next_beat = now + interval
            self._watch(now, disconnected_at)
            if disconnected_at is not None and now - disconnected_at > 4 * interval:
                disconnected_at = None  # the window to pin it on a node has passed

    def _forward_calls(self) -> None:
        while True:
            try:
                frames = self._pipe_in.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._send_to_all(frames)

    def _send_to_all(self, frames: list[bytes] | list[zmq.Frame]) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            try:
                self._router.send_multipart([node.identity, *frames], copy=False)
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer's connection is gone
                self._fail(_gone(node, f"its connection closed ({exc})"))

    def _receive(self) -> None:
        while True:
            try:
                identity, _kind, body = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not our framing: ignore
            message = decode_control(body)
            now = time.monotonic()
            if isinstance(message, Hello):
                self._welcome(identity, message, now)
                continue
            node = self._node_of(identity)
            if node is None:
                continue
            node.last_seen = now
            if isinstance(message, NodeReply):
                self._replies[node.rank].put(message)
            elif isinstance(message, NodeReady):
                node.ready = message
            elif isinstance(message, NodeFailed):
                self._fail(f"node {node.rank} ({node.host}): {message.reason}")

    def _node_of(self, identity: bytes) -> _Node | None:
        with self._lock:
            return next((n for n in self._nodes.values() if n.identity == identity), None)

    def _welcome(self, identity: bytes, hello: Hello, now: float) -> None:
        error = None
        diffs = self._fingerprint.differences(hello.fingerprint)
        if hello.node_rank not in self.node_ranks:
            error = f"node_rank {hello.node_rank} is not in 1..{len(self.node_ranks)}"
        elif hello.node_rank in self._nodes:
            first = self._nodes[hello.node_rank]
            error = f"node_rank {hello.node_rank} already joined (from {first.host})"
        elif diffs:
            error = "its settings differ from node 0's: " + "; ".join(diffs)
        self._router.send_multipart([identity, *control_frames(Welcome(self._output_rank, error))])
        if error is not None:
            logger.error(
                "multi-node: refused node %d from %s: %s", hello.node_rank, hello.host, error
            )
            return
        with self._lock:
            self._nodes[hello.node_rank] = _Node(
                hello.node_rank, identity, hello.host, hello.pid, last_seen=now
            )
        logger.info(
            "multi-node: node %d joined from %s (pid %d)", hello.node_rank, hello.host, hello.pid
        )

    def _watch(self, now: float, disconnected_at: float | None) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        # A closed connection: the node whose heartbeats stopped is the one that left.
        grace = 3 * self._timeouts.heartbeat_interval_s
        for node in nodes:
            silent = now - node.last_seen
            if disconnected_at is not None and now - disconnected_at > grace and silent > grace:
                self._fail(_gone(node, "its connection closed"))
            elif silent > self._timeouts.heartbeat_timeout_s:
                self._fail(
                    _gone(
                        node,
                        f"sent nothing for {silent:.1f} s (heartbeat timeout: host or "
                        "network lost)",
                    )
                )


def _gone(node: _Node, why: str) -> str:
    return (
        f"node {node.rank} ({node.host}, agent pid {node.pid}) is gone: {why}; the executor "
        "cannot continue"
    )

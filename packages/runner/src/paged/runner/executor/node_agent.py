"""`run_worker_node`: a headless node's ranks, driven by node 0's executor over the node link.

`paged serve MODEL --headless --nnodes N --node-rank R --master-addr A` runs
this and nothing else (no API server, no engine core): it starts ranks
[R * L, (R + 1) * L) (L = world size / N) as local worker processes on a
shared-memory ring, exactly as the multiproc executor does on node 0, and
relays:

    node 0 --[CALL frames]--> agent --(shm ring)--> local workers
    node 0 <--NodeReply------ agent <--(one response queue per worker)--

One thread, one loop: it copies each call into the ring without decoding it
(except the rare non-step calls, to spot Shutdown), collects its workers'
replies to calls in order, and sends one `NodeReply` per call; for a model
step that reply carries only the output rank's result and any errors.

Liveness, both ways (docs/multi-node.md):
- a local worker that dies: `NodeFailed` to node 0, then exit 1;
- node 0's connection closing (its process died), or node 0 silent for
  `heartbeat_timeout_s`: exit 1, the workers with it;
- node 0 not answering the Hello within `join_s`: exit 1 with that error.
Exit 0 only after node 0's `Shutdown`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import zmq

from paged.runner.config import EngineConfig
from paged.runner.executor.messages import (
    Ready,
    Reply,
    Shutdown,
    decode_call,
    decode_ready,
    decode_reply,
)
from paged.runner.executor.multiproc import start_worker_processes
from paged.runner.executor.node_wire import (
    FLAG_OUTPUT_RANK_ONLY,
    KIND_CALL,
    ControlMessage,
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
from paged.runner.shm_broadcast import MessageQueue

logger = logging.getLogger(__name__)

_LIVENESS_EVERY_S = 0.2
_SPINS_BEFORE_SLEEP = 64


class NodeExit(Exception):
    """The agent stops: `code` is the process's exit status, `reason` what to log."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass
class _PendingCall:
    output_rank_only: bool
    is_shutdown: bool
    replies: list[Reply] = field(default_factory=list)


def run_worker_node(engine_config: EngineConfig, timeouts: LinkTimeouts | None = None) -> int:
    """Run this node's ranks until node 0 shuts them down; the process's exit status."""
    parallel = engine_config.parallel_config
    if parallel.nnodes < 2 or parallel.node_rank == 0:
        raise ValueError(
            "node_rank: a headless worker node has node_rank >= 1 of nnodes >= 2 "
            f"(got node_rank={parallel.node_rank}, nnodes={parallel.nnodes}); node 0 runs "
            "the API server and the engine"
        )
    agent = _NodeAgent(engine_config, timeouts or LinkTimeouts.from_env())
    code = 1
    try:
        agent.run()
    except NodeExit as stop:
        code = stop.code
        log = logger.info if code == 0 else logger.error
        log("node %d: %s", parallel.node_rank, stop)
    finally:
        agent.close(clean=code == 0)
    return code


class _NodeAgent:
    def __init__(self, engine_config: EngineConfig, timeouts: LinkTimeouts) -> None:
        parallel = engine_config.parallel_config
        assert parallel.master_addr is not None  # ParallelConfig requires it for nnodes > 1
        self.config = engine_config
        self.node_rank = parallel.node_rank
        self.ranks = node_ranks(parallel, parallel.node_rank)
        self.endpoint = link_endpoint(parallel.master_addr, parallel.master_port)
        self.init_method = f"tcp://{parallel.master_addr}:{parallel.master_port}"
        self.timeouts = timeouts
        self.output_rank = -1
        self.procs: list[BaseProcess] = []
        self.broadcast: MessageQueue | None = None
        self.responses: list[MessageQueue] = []
        self.pending: deque[_PendingCall] = deque()
        self._ctx = zmq.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 1000)  # NodeFailed gets out before we exit
        self._monitor = self._dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._dealer.connect(self.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._dealer, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._heard_at = time.monotonic()
        self._beat_at = 0.0
        self._checked_at = 0.0

    # ---------------------------------------------------------------- phases

    def run(self) -> None:
        self._join()
        self._start_workers()
        spins = 0
        while True:
            progressed = self._pump(0 if self.pending else self.timeouts.heartbeat_interval_s)
            progressed |= self._collect_replies()
            spins = 0 if progressed else spins + 1
            if self.pending and spins > _SPINS_BEFORE_SLEEP:
                time.sleep(2e-4)  # a step in progress: poll gently on shared CPUs

    def _join(self) -> None:
        fingerprint = Fingerprint.of(self.config)
        hello = Hello(self.node_rank, os.getpid(), socket.gethostname(), fingerprint)
        self._dealer.send_multipart(control_frames(hello))
        logger.info("node %d: joining node 0 at %s", self.node_rank, self.endpoint)
        deadline = time.monotonic() + self.timeouts.join_s
        while time.monotonic() < deadline:
            if self._dealer.poll(timeout=200):
                kind, body = self._dealer.recv_multipart()
                message = decode_control(body) if kind != KIND_CALL else None
                if isinstance(message, Welcome):
                    if message.error is not None:
                        raise NodeExit(1, f"node 0 refused this node: {message.error}")
                    self.output_rank = message.output_rank
                    self._heard_at = time.monotonic()
                    return
        raise NodeExit(
            1,
            f"node 0 did not answer at {self.endpoint} within {self.timeouts.join_s:.0f} s "
            "(is `paged serve --nnodes ... --node-rank 0` running there, and master_port + 1 "
            "open?)",
        )

    def _start_workers(self) -> None:
        handle = MessageQueue.make_handle(len(self.ranks), 8, 1 << 22)
        self.broadcast = MessageQueue.create_writer(handle)
        response_handles = [MessageQueue.make_handle(1, 4, 1 << 22) for _ in self.ranks]
        self.responses = [MessageQueue.create_reader(h, 0) for h in response_handles]
        self.procs = start_worker_processes(
            self.config, self.ranks, self.init_method, handle, response_handles
        )
        logger.info("node %d: started ranks %s", self.node_rank, list(self.ranks))
        errors: list[str] = []
        for rank, queue in zip(self.ranks, self.responses, strict=True):
            while True:
                self._pump(0.05)
                try:
                    ready: Ready = decode_ready(queue.dequeue(timeout=0.05))
                    break
                except TimeoutError:
                    continue
            if ready.error:
                errors.append(
                    f"worker {rank} on node {self.node_rank} failed to start:\n{ready.error}"
                )
        self._send(NodeReady(self.node_rank, errors))
        if errors:
            raise NodeExit(1, "workers failed to start:\n" + "\n".join(errors))
        logger.info("node %d: ranks %s ready", self.node_rank, list(self.ranks))

    # ------------------------------------------------------------ one turn

    def _pump(self, wait_s: float) -> bool:
        """Take node 0's messages (waiting up to wait_s), beat, check liveness; any progress?"""
        events = dict(self._poller.poll(timeout=int(wait_s * 1000)))
        progressed = False
        if self._monitor in events:
            raise NodeExit(1, f"node 0 closed the connection at {self.endpoint} (it exited)")
        if self._dealer in events:
            progressed = self._receive()
        now = time.monotonic()
        if now - self._beat_at >= self.timeouts.heartbeat_interval_s:
            self._send(Heartbeat())
            self._beat_at = now
        if now - self._checked_at >= _LIVENESS_EVERY_S:
            self._checked_at = now
            self._check_liveness(now)
        return progressed

    def _receive(self) -> bool:
        received = False
        while True:
            try:
                frames = self._dealer.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return received
            received = True
            self._heard_at = time.monotonic()
            if frames[0] == KIND_CALL:
                self._forward_call(frames[1], frames[2])

    def _forward_call(self, flag: bytes, payload: bytes) -> None:
        output_only = flag == FLAG_OUTPUT_RANK_ONLY
        # Non-step calls are rare and small: decoding them tells Shutdown apart.
        is_shutdown = not output_only and isinstance(decode_call(payload), Shutdown)
        assert self.broadcast is not None
        while True:
            try:
                self.broadcast.enqueue(payload, timeout=_LIVENESS_EVERY_S)
                break
            except TimeoutError:
                self._check_liveness(time.monotonic())
        self.pending.append(_PendingCall(output_only, is_shutdown))

    def _collect_replies(self) -> bool:
        """Read the oldest pending call's replies as they come; send it once complete."""
        progressed = False
        while self.pending:
            call = self.pending[0]
            while len(call.replies) < len(self.responses):
                try:
                    data = self.responses[len(call.replies)].dequeue(timeout=0)
                except TimeoutError:
                    return progressed
                call.replies.append(decode_reply(data))
                progressed = True
            self.pending.popleft()
            replies = call.replies
            if call.output_rank_only:
                replies = [r for r in replies if r.rank == self.output_rank or r.error]
            self._send(NodeReply(self.node_rank, replies))
            if call.is_shutdown:
                raise NodeExit(0, "shut down by node 0")
        return progressed

    def _check_liveness(self, now: float) -> None:
        for rank, proc in zip(self.ranks, self.procs, strict=True):
            if not proc.is_alive():
                reason = (
                    f"worker {rank} (pid {proc.pid}) on node {self.node_rank} died with exit "
                    f"code {proc.exitcode}; the executor cannot continue"
                )
                self._send(NodeFailed(self.node_rank, reason))
                raise NodeExit(1, reason)
        silent = now - self._heard_at
        if silent > self.timeouts.heartbeat_timeout_s:
            raise NodeExit(
                1, f"node 0 sent nothing for {silent:.1f} s (heartbeat timeout); leaving"
            )

    def _send(self, message: ControlMessage) -> None:
        self._dealer.send_multipart(control_frames(message))

    # -------------------------------------------------------------- cleanup

    def close(self, clean: bool) -> None:
        """Stop the workers: wait for them after a Shutdown, else kill them (they would
        also exit on their own once this process is gone)."""
        for proc in self.procs:
            if clean:
                proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
        queues = [*self.responses, *([self.broadcast] if self.broadcast is not None else [])]
        for queue in queues:
            try:
                queue.close()
            except OSError:  # already gone: nothing left to free
                logger.debug("closing a queue failed:\n%s", traceback.format_exc())
        self._monitor.close(linger=0)
        self._dealer.close()
        self._ctx.term()

"""Data-parallel engines in other OS processes or on other nodes, over TCP.

    frontend (paged serve ... --data-parallel-address A --data-parallel-rpc-port P)
      DPRendezvous: ROUTER bound at tcp://A:P
    headless node (paged serve ... --headless --data-parallel-start-rank k ...)
      one DEALER per local rank -> EngineRegistration(rank)
      <- EngineAssignment(input, output, identity): a ROUTER/PULL pair the
         frontend bound for that rank on A (ephemeral ports)
      spawns the rank's engine process: `run_engine_core` connects to the
      pair and sends its handshake, exactly as a local engine does

From then on the frontend drives the rank through `RemoteEngine` (the same
handle `AsyncMPClient` uses for a local `EngineProcess`), so load balancing,
abort routing and failure handling are those of local DP.

Peer death, both ways, without a process to wait on:
- engine gone: a ZMQ socket monitor on the rank's PULL socket reports the
  TCP disconnect (a killed process: at once; a vanished host: ZMTP
  heartbeats time out after `HEARTBEAT_TIMEOUT_MS`), and the client fails
  that rank's requests (`EngineDeadError`).
- frontend gone: the headless supervisor watches its rendezvous DEALERs the
  same way and stops its engines (SIGTERM, then SIGKILL), then exits; an
  engine also exits when its supervisor dies (`ParentDeathWatcher`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from paged.scheduler.boundary import EngineCoreRequest
from paged.server.engine.dp_launch import DPRankFactory
from paged.server.engine.errors import EngineDeadError, EngineStartupError
from paged.server.engine.messages import (
    EngineAssignment,
    EngineCoreInfo,
    EngineCoreRequestType,
    EngineHandshake,
    EngineRegistration,
)
from paged.server.engine.proc import run_engine_core
from paged.server.engine.serial import Frame, MsgpackDecoder, MsgpackEncoder, encode_add_request

logger = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
_POLL_MS = 100
_STOP_GRACE_S = 5.0
_SHUTDOWN_WAIT_S = 2.0


def _heartbeat(sock: zmq.Socket[Any]) -> None:
    """ZMTP heartbeats: a peer whose host vanished (no FIN) is noticed too."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def _wait_for_disconnect(monitor: zmq.Socket[Any], stop: threading.Event) -> bool:
    """Block until the monitored socket loses its peer (True) or `stop` is set (False)."""
    while not stop.is_set():
        if not monitor.poll(_POLL_MS):
            continue
        try:
            event = recv_monitor_message(monitor)
        except zmq.ZMQError:
            return False
        if event["event"] == zmq.EVENT_DISCONNECTED:
            return True
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return False
    return False


class RemoteEngine:
    """Frontend-side sockets of one DP rank whose engine runs elsewhere.

    Satisfies `EngineHandle` (as `EngineProcess` does). Thread-safety as
    there: `send` from any thread; `output_socket` belongs to the one reader.
    """

    def __init__(self, ctx: zmq.Context[Any], host: str, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.identity = uuid.uuid4().bytes
        self.input_socket = ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        _heartbeat(self.input_socket)
        self.input_socket.bind(f"tcp://{host}:*")
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        _heartbeat(self.output_socket)
        self._monitor = self.output_socket.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
        )
        self.output_socket.bind(f"tcp://{host}:*")
        self.input_address = _endpoint(self.input_socket)
        self.output_address = _endpoint(self.output_socket)
        self._send_lock = threading.Lock()
        self._encoder = MsgpackEncoder()
        self._closing = False
        self._stop_monitor = threading.Event()
        self._monitor_thread: threading.Thread | None = None
        self._pid = 0
        self.info = EngineCoreInfo(0, 0, 0, 0)  # replaced by the handshake's

    @property
    def pid(self) -> int:
        """The engine's pid on its own node (0 before the handshake)."""
        return self._pid

    def wait_for_handshake(
        self, deadline: float, cancel: threading.Event | None = None
    ) -> EngineCoreInfo:
        """The engine's handshake (EngineStartupError if it failed, never came or `cancel`)."""
        decoder = MsgpackDecoder(EngineHandshake)
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise EngineStartupError("data-parallel startup was cancelled")
            if not self.input_socket.poll(_POLL_MS):
                continue
            frames = self.input_socket.recv_multipart(copy=False)
            if frames[1].bytes != EngineCoreRequestType.HANDSHAKE.value:
                continue
            handshake = decoder.decode([f.buffer for f in frames[2:]])
            if not handshake.ok or handshake.info is None:
                raise EngineStartupError(
                    f"data-parallel engine {self.dp_rank} failed to start: "
                    f"{handshake.error_type}: {handshake.error_message}",
                    engine_traceback=handshake.traceback,
                )
            self._pid, self.info = handshake.pid, handshake.info
            return handshake.info
        raise EngineStartupError(f"data-parallel engine {self.dp_rank} sent no handshake in time")

    def start_monitor(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(message)` from a thread when the engine disconnects before `shutdown`."""
        self._monitor_thread = threading.Thread(
            target=self._watch,
            args=(on_death,),
            name=f"DPEngineMonitor-{self.dp_rank}",
            daemon=True,
        )
        self._monitor_thread.start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        if _wait_for_disconnect(self._monitor, self._stop_monitor) and not self._closing:
            on_death(
                f"data-parallel engine {self.dp_rank} (remote pid {self.pid}, "
                f"{self.output_address}) disconnected"
            )

    def send(self, kind: EngineCoreRequestType, payload: object = None) -> None:
        with self._send_lock:
            frames: list[Frame] = []
            if isinstance(payload, EngineCoreRequest):
                frames = encode_add_request(self._encoder, payload)
            elif payload is not None:
                frames = self._encoder.encode(payload)
            if self._closing:
                raise EngineDeadError("engine core client was shut down")
            try:
                self.input_socket.send_multipart([self.identity, kind.value, *frames], copy=False)
            except zmq.ZMQError as exc:
                raise EngineDeadError(
                    f"cannot reach data-parallel engine {self.dp_rank}: {exc}"
                ) from exc

    def shutdown(self) -> None:
        """Ask the engine to stop (it exits; its supervisor then exits too)."""
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            with contextlib.suppress(zmq.ZMQError):
                self.input_socket.send_multipart(
                    [self.identity, EngineCoreRequestType.SHUTDOWN.value], copy=False
                )
        self._stop_monitor.set()
        thread = self._monitor_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def close(self) -> None:
        """Idempotent (the client and the rendezvous both close it)."""
        if self.input_socket.closed:
            return
        # Linger: the SHUTDOWN just queued should still reach the engine.
        self.input_socket.close(linger=1000)
        self._monitor.close(linger=0)
        self.output_socket.close(linger=0)


def _endpoint(sock: zmq.Socket[Any]) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


class DPRendezvous:
    """The frontend's rendezvous socket: headless nodes register their DP ranks here.

    Stays bound for the frontend's lifetime: headless supervisors watch the
    connection and stop their engines when it drops.
    """

    def __init__(self, address: str, rpc_port: int) -> None:
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        _heartbeat(self._sock)
        try:
            self._sock.bind(f"tcp://{address}:{rpc_port}")
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ValueError(
                f"data_parallel_rpc_port: cannot listen on {address}:{rpc_port}: {exc}"
            ) from exc
        self.engines: list[RemoteEngine] = []
        # Set from another thread to stop `accept` (the local engines failed meanwhile).
        self.cancel = threading.Event()

    def accept(self, ranks: Sequence[int], timeout_s: float) -> list[RemoteEngine]:
        """Wait until every rank in `ranks` registered and is ready; in `ranks` order.

        Runs on one thread (the socket's); `cancel` stops it with `EngineStartupError`.
        """
        wanted = set(ranks)
        deadline = time.monotonic() + timeout_s
        decoder = MsgpackDecoder(EngineRegistration)
        encoder = MsgpackEncoder()
        by_rank: dict[int, RemoteEngine] = {}
        while wanted - by_rank.keys():
            if self.cancel.is_set():
                raise EngineStartupError("data-parallel startup was cancelled")
            if time.monotonic() > deadline:
                missing = sorted(wanted - by_rank.keys())
                raise EngineStartupError(
                    f"data-parallel ranks {missing} did not register within {timeout_s} s "
                    f"(start them with paged serve --headless ...)"
                )
            if not self._sock.poll(_POLL_MS):
                continue
            peer, *frames = self._sock.recv_multipart(copy=False)
            try:
                reg = decoder.decode([f.buffer for f in frames])
            except Exception as exc:  # a stray client must not stop the frontend
                logger.warning("ignoring a malformed data-parallel registration: %s", exc)
                continue
            if reg.dp_rank not in wanted or reg.dp_rank in by_rank:
                why = f"rank {reg.dp_rank} is not expected here (waiting for {sorted(wanted)})"
                if reg.dp_rank in by_rank:
                    why = f"rank {reg.dp_rank} is already registered"
                self._sock.send_multipart([peer, *encoder.encode(EngineAssignment(error=why))])
                continue
            engine = RemoteEngine(self._ctx, self.address, reg.dp_rank)
            self.engines.append(engine)
            by_rank[reg.dp_rank] = engine
            logger.info("data-parallel rank %d registered from %s (pid %d)", *_who(reg))
            assignment = EngineAssignment(
                engine.input_address, engine.output_address, engine.identity
            )
            self._sock.send_multipart([peer, *encoder.encode(assignment)])
        for rank in ranks:
            by_rank[rank].wait_for_handshake(deadline, self.cancel)
        return [by_rank[r] for r in ranks]

    def close(self) -> None:
        self._sock.close(linger=0)
        for engine in self.engines:
            engine.close()
        self._ctx.term()


def _who(reg: EngineRegistration) -> tuple[int, str, int]:
    return reg.dp_rank, reg.host, reg.pid


# ---- headless node -------------------------------------------------------------------


def run_headless(
    factories: Sequence[DPRankFactory],
    address: str,
    rpc_port: int,
    *,
    register_timeout_s: float = 600.0,
    log_level: int = logging.INFO,
) -> int:
    """Register `factories`' ranks with the frontend, run their engines until it goes away.

    Returns 0 once every engine exited because the frontend shut it down or
    disconnected, 1 if an engine failed or the frontend refused a rank.
    """
    ctx = zmq.Context()
    dealers: list[zmq.Socket[Any]] = []
    processes: list[BaseProcess] = []
    stop = threading.Event()
    frontend_gone = threading.Event()
    try:
        assignments = []
        for factory in factories:
            dealer = ctx.socket(zmq.DEALER)
            _heartbeat(dealer)
            dealers.append(dealer)
            dealer.connect(f"tcp://{address}:{rpc_port}")
            assignments.append(_register(dealer, factory.dp_rank, register_timeout_s))
        for dealer in dealers:
            monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED)
            threading.Thread(
                target=_watch_frontend,
                args=(monitor, stop, frontend_gone),
                name="DPFrontendMonitor",
                daemon=True,
            ).start()
        spawn = multiprocessing.get_context("spawn")
        for factory, assignment in zip(factories, assignments, strict=True):
            process = spawn.Process(
                target=run_engine_core,
                name=f"EngineCore_DP{factory.dp_rank}",
                kwargs={
                    "core_factory": factory,
                    "input_address": assignment.input_address,
                    "output_address": assignment.output_address,
                    "identity": assignment.identity,
                    "log_level": log_level,
                },
            )
            process.start()
            processes.append(process)
            logger.info("data-parallel rank %d: engine pid %d", factory.dp_rank, process.pid)
        return _supervise(processes, frontend_gone)
    except EngineStartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        stop.set()
        _stop_all(processes)
        # Closing a socket ends its monitor (`disable_monitor` would wait on a
        # monitor socket the watcher thread may already have closed).
        for dealer in dealers:
            dealer.close(linger=0)
        ctx.term()


def _register(dealer: zmq.Socket[Any], dp_rank: int, timeout_s: float) -> EngineAssignment:
    encoder = MsgpackEncoder()
    dealer.send_multipart(
        encoder.encode(EngineRegistration(dp_rank, socket.gethostname(), os.getpid()))
    )
    if not dealer.poll(int(timeout_s * 1000)):
        raise EngineStartupError(f"no frontend answered rank {dp_rank}'s registration")
    frames = dealer.recv_multipart(copy=False)
    assignment = MsgpackDecoder(EngineAssignment).decode([f.buffer for f in frames])
    if assignment.error is not None:
        raise EngineStartupError(f"the frontend refused rank {dp_rank}: {assignment.error}")
    return assignment


def _watch_frontend(monitor: zmq.Socket[Any], stop: threading.Event, gone: threading.Event) -> None:
    try:
        if _wait_for_disconnect(monitor, stop):
            logger.warning("the frontend disconnected; stopping this node's engines")
            gone.set()
    finally:
        monitor.close(linger=0)


def _supervise(processes: Sequence[BaseProcess], frontend_gone: threading.Event) -> int:
    """Wait until every engine exited, or the frontend went away; the exit status."""
    while True:
        alive = [p for p in processes if p.is_alive()]
        if not alive:
            failed = [p for p in processes if p.exitcode not in (0, None)]
            for p in failed:
                logger.error("engine %s exited with code %s", p.name, p.exitcode)
            return 1 if failed else 0
        if frontend_gone.is_set():
            return 0
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=_POLL_MS / 1000)


def _stop_all(processes: Sequence[BaseProcess]) -> None:
    # A frontend that shut down cleanly sent each engine SHUTDOWN: let them finish.
    deadline = time.monotonic() + _SHUTDOWN_WAIT_S
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for stop in (BaseProcess.terminate, BaseProcess.kill):
        alive = [p for p in processes if p.is_alive()]
        for p in alive:
            stop(p)
        for p in alive:
            p.join(timeout=_STOP_GRACE_S)

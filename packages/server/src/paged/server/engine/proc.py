"""`EngineCoreProc`: the engine core in its own process, driven by a busy loop.

Three threads share the work so that socket I/O and msgpack overlap with the
model (numpy, torch and ZMQ release the GIL):

    input thread   DEALER socket -> decode -> input queue
    main thread    input queue -> EngineCore (add/abort/utility) -> run_step() -> output queue
    output thread  output queue -> encode -> PUSH socket

Startup: the process connects both sockets, builds the engine core and sends
one `EngineHandshake` on the input pair, `ok=False` with the error when
building failed (bad model path, out of memory, ...), so the frontend raises
one clear `EngineStartupError` instead of waiting forever.

Exit: a SHUTDOWN message, SIGTERM, or the death of the frontend process,
noticed within a second whether busy or idle (`ParentDeathWatcher`: the loop
stops after the current step, a step that runs on is interrupted, and the
process exits without flushing sockets nobody reads). A crash inside the
loop is reported as ENGINE_ERROR before the process exits with status 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from paged.server.engine.interfaces import EngineCoreFactory, EngineCoreLike
from paged.server.engine.messages import (
    AddRequestMessage,
    EngineCoreOutputType,
    EngineCoreRequestType,
    EngineErrorMessage,
    EngineHandshake,
    UtilityCall,
    UtilityResult,
)
from paged.server.engine.parent_watch import ParentDeathWatcher
from paged.server.engine.serial import (
    Frame,
    MsgpackDecoder,
    MsgpackEncoder,
    decode_add_request,
)
from paged.server.engine.step_trace import StepTrace

logger = logging.getLogger(__name__)

# How often idle waits wake up to check that the frontend is still alive.
_POLL_S = 0.1
# How long closing sockets may wait to flush queued messages.
_LINGER_MS = 2000
# After the frontend died: how long the current step may still run before
# SIGTERM interrupts it, and how long after that before a hard exit.
_PARENT_DEATH_GRACE_S = 0.5
_PARENT_DEATH_FORCE_S = 5.0

_Output = tuple[EngineCoreOutputType, object]
_STOP = object()


class _UtilityOutcome(msgspec.Struct, frozen=True):
    """A utility call's result or error, encoded by the output thread."""

    call_id: int
    result: Any = None
    error: str | None = None
    value_error: bool = False


class EngineCoreProc:
    """Runs one `EngineCoreLike` against a DEALER input and a PUSH output socket."""

    def __init__(
        self, core: EngineCoreLike, input_socket: zmq.Socket[Any], output_socket: zmq.Socket[Any]
    ):
        self.core = core
        self._input_socket = input_socket
        self._output_socket = output_socket
        self._input_queue: queue.Queue[tuple[EngineCoreRequestType, object]] = queue.Queue()
        self._output_queue: queue.Queue[_Output | object] = queue.Queue()
        self._stop_input = threading.Event()
        self._shutdown_requested = False
        self._output_failed: BaseException | None = None
        self._loop_done = threading.Event()
        self._parent_watch = ParentDeathWatcher(self._on_parent_death)
        # PAGED_STEP_TRACE=PATH: a per-step timeline written at exit (off: None).
        self._trace = StepTrace.from_env()
        if self._trace is not None:
            logger.warning("engine step trace on: written to %s at exit", self._trace.path)

    @property
    def parent_died(self) -> bool:
        """True once the frontend process is gone (nothing left to report to)."""
        return self._parent_watch.died.is_set()

    # ---- lifecycle ---------------------------------------------------------
    def run(self) -> None:
        """Run until shutdown; a crash is reported to the frontend and re-raised."""
        input_thread = threading.Thread(
            target=self._input_loop, name="EngineCoreInput", daemon=True
        )
        output_thread = threading.Thread(
            target=self._output_loop, name="EngineCoreOutput", daemon=True
        )
        input_thread.start()
        output_thread.start()
        self._parent_watch.start()
        try:
            try:
                self._busy_loop()
            finally:
                self._loop_done.set()
        except BaseException as exc:
            if self.parent_died:
                raise  # interrupted after the frontend died: nobody to report to
            logger.exception("engine core loop crashed")
            message = f"engine core crashed: {type(exc).__name__}: {exc}"
            error = EngineErrorMessage(message=message, traceback=traceback.format_exc())
            self._output_queue.put((EngineCoreOutputType.ENGINE_ERROR, error))
            raise
        finally:
            self._parent_watch.stop()
            if self._trace is not None:
                self._trace.write()
            try:
                self.core.shutdown()
            finally:
                self._output_queue.put(_STOP)
                # With the frontend gone the output thread may be stuck sending.
                output_thread.join(timeout=0 if self.parent_died else _LINGER_MS / 1000)
                self._stop_input.set()
                input_thread.join(timeout=1.0)

    def _on_parent_death(self) -> None:
        """Runs on the watcher thread: stop the loop, interrupting a step that runs on."""
        logger.warning("frontend process is gone; engine core exits")
        # Wakes an idle loop at once; a busy one reads it before its next step.
        self._input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
        if self._loop_done.wait(_PARENT_DEATH_GRACE_S):
            return
        logger.warning("engine step still running; interrupting it")
        os.kill(os.getpid(), signal.SIGTERM)  # SystemExit in the main thread
        if not self._loop_done.wait(_PARENT_DEATH_FORCE_S):
            logging.shutdown()
            os._exit(1)

    def _busy_loop(self) -> None:
        while not self._shutdown_requested:
            if self._output_failed is not None:
                raise RuntimeError("the output thread failed") from self._output_failed
            self._process_input_queue()
            if self._shutdown_requested:
                break
            trace = self._trace
            if trace is not None:
                trace.begin_step()
            step_outputs = self.core.run_step()
            if trace is not None:
                trace.end_step(step_outputs)
            for client_index, outputs in step_outputs.items():
                if client_index != 0:
                    # One frontend per engine here: outputs for other indices
                    # still go to it rather than being dropped.
                    logger.debug(
                        "outputs for client %d sent on the only output socket", client_index
                    )
                self._output_queue.put((EngineCoreOutputType.OUTPUTS, outputs))

    def _process_input_queue(self) -> None:
        """Block while idle (checking the frontend is alive); then drain the queue."""
        if not self.core.has_work():
            idle_from = time.monotonic()
            while True:
                try:
                    item = self._input_queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._output_failed is not None:
                        return  # the busy loop raises it
                    if not _parent_alive():
                        logger.warning("frontend process is gone; engine core exits")
                        self._shutdown_requested = True
                        return
                    continue
                self._handle(*item)
                break
            if self._trace is not None:
                self._trace.add_idle(time.monotonic() - idle_from)
        while not self._shutdown_requested:
            try:
                item = self._input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, kind: EngineCoreRequestType, payload: object) -> None:
        if kind is EngineCoreRequestType.ADD:
            assert isinstance(payload, EngineCoreRequest)
            self._add_request(payload)
        elif kind is EngineCoreRequestType.ABORT:
            assert isinstance(payload, list)
            self.core.abort_requests(payload)
        elif kind is EngineCoreRequestType.UTILITY:
            assert isinstance(payload, UtilityCall)
            self._output_queue.put(
                (EngineCoreOutputType.UTILITY_RESULT, self._run_utility(payload))
            )
        elif kind is EngineCoreRequestType.SHUTDOWN:
            self._shutdown_requested = True

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as exc:
            # The frontend waits for this request: finish it with the reason.
            failed = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                finish_detail=str(exc),
            )
            outputs = EngineCoreOutputs(outputs=[failed], finished_requests=[request.request_id])
            self._output_queue.put((EngineCoreOutputType.OUTPUTS, outputs))

    def _run_utility(self, call: UtilityCall) -> _UtilityOutcome:
        try:
            result = self.core.call_utility(call.method, call.args)
        except ValueError as exc:
            return _UtilityOutcome(call.call_id, error=str(exc), value_error=True)
        except Exception as exc:
            return _UtilityOutcome(call.call_id, error=f"{type(exc).__name__}: {exc}")
        return _UtilityOutcome(call.call_id, result=result)

    # ---- I/O threads -------------------------------------------------------
    def _input_loop(self) -> None:
        add_decoder = MsgpackDecoder(AddRequestMessage)
        decoders: dict[EngineCoreRequestType, MsgpackDecoder[Any]] = {
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
        }
        sock = self._input_socket
        while not self._stop_input.is_set():
            if not sock.poll(int(_POLL_S * 1000)):
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                kind = EngineCoreRequestType(frames[0].bytes)
                buffers = [f.buffer for f in frames[1:]]
                if kind is EngineCoreRequestType.SHUTDOWN:
                    payload: object = None
                elif kind is EngineCoreRequestType.ADD:
                    payload = decode_add_request(add_decoder, buffers)
                else:
                    payload = decoders[kind].decode(buffers)
            except (ValueError, KeyError, msgspec.DecodeError):
                logger.exception("dropping a malformed message from the frontend")
                continue
            self._input_queue.put((kind, payload))

    def _output_loop(self) -> None:
        encoder = MsgpackEncoder()
        sock = self._output_socket
        while True:
            item = self._output_queue.get()
            if item is _STOP:
                return
            assert isinstance(item, tuple)
            kind, payload = item
            encode_from = time.perf_counter()
            try:
                frames = _encode_output(encoder, payload)
            except Exception as exc:
                # Outputs that cannot be sent would leave the frontend waiting
                # forever: report the engine dead and make the loop stop.
                logger.exception("cannot encode an engine output")
                self._output_failed = exc
                kind = EngineCoreOutputType.ENGINE_ERROR
                message = f"engine core cannot encode its output: {type(exc).__name__}: {exc}"
                frames = encoder.encode(EngineErrorMessage(message, traceback.format_exc()))
            if self._trace is not None:
                self._trace.add_sent(
                    time.perf_counter() - encode_from, sum(memoryview(f).nbytes for f in frames)
                )
            sock.send_multipart([kind.value, *frames], copy=False)
            if self._output_failed is not None:
                return


def _encode_output(encoder: MsgpackEncoder, payload: object) -> list[Frame]:
    if isinstance(payload, _UtilityOutcome):
        # The result travels as raw msgpack; its out-of-band buffers become
        # the message's trailing frames, so their indices stay valid.
        try:
            result_frames = encoder.encode(payload.result)
        except TypeError as exc:
            failed = f"result of type {type(payload.result).__name__} cannot be sent: {exc}"
            payload = _UtilityOutcome(payload.call_id, error=failed)
            result_frames = encoder.encode(None)
        wrapped = UtilityResult(
            call_id=payload.call_id,
            result=msgspec.Raw(result_frames[0]),
            error=payload.error,
            value_error=payload.value_error,
        )
        return [encoder.encode(wrapped)[0], *result_frames[1:]]
    return encoder.encode(payload)


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def _close(sock: zmq.Socket[Any]) -> None:
    sock.close(linger=_LINGER_MS)


def run_engine_core(
    core_factory: EngineCoreFactory,
    input_address: str,
    output_address: str,
    identity: bytes,
    log_level: int = logging.WARNING,
) -> None:
    """Entry point of the engine process (target of a `spawn` `Process`).

    `log_level` is the frontend's: a spawned interpreter starts without
    logging configured, so the engine's startup lines would otherwise be lost.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s"
        )
    # Ctrl-C reaches the whole process group; the frontend decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.DEALER)
    input_socket.setsockopt(zmq.IDENTITY, identity)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.connect(output_address)
    encoder = MsgpackEncoder()
    exit_code = 0
    try:
        try:
            core = core_factory()
        except BaseException as exc:
            logger.exception("engine core failed to start")
            failed = EngineHandshake(
                ok=False,
                pid=os.getpid(),
                error_type=type(exc).__name__,
                error_message=str(exc),
                traceback=traceback.format_exc(),
            )
            input_socket.send_multipart(
                [EngineCoreRequestType.HANDSHAKE.value, *encoder.encode(failed)]
            )
            exit_code = 1
            return
        ready = EngineHandshake(ok=True, pid=os.getpid(), info=core.info)
        input_socket.send_multipart([EngineCoreRequestType.HANDSHAKE.value, *encoder.encode(ready)])
        proc = EngineCoreProc(core, input_socket, output_socket)
        try:
            proc.run()
        except BaseException:
            exit_code = 1
        if proc.parent_died:
            # The sockets' peer is gone: closing them would only wait out the
            # linger on messages nobody will read.
            logging.shutdown()
            os._exit(0)
    finally:
        _close(input_socket)
        _close(output_socket)
        if not _terminate(ctx):
            # A socket still held by a stuck thread makes term() wait forever;
            # the frontend already has our last message (or never will).
            logger.warning("ZMQ context did not terminate; exiting without it")
            logging.shutdown()
            os._exit(exit_code)
        if exit_code:
            sys.exit(exit_code)


def _terminate(ctx: zmq.Context[Any]) -> bool:
    """ctx.term(), bounded: it flushes queued messages for up to the linger time."""
    term = threading.Thread(target=ctx.term, name="EngineCoreZmqTerm", daemon=True)
    term.start()
    term.join(timeout=_LINGER_MS / 1000 + 2.0)
    return not term.is_alive()


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)

"""`MultiprocExecutor`: one worker process per rank (TP x PP of them).

    executor --(broadcast MessageQueue: 1 writer, N readers)--> worker 0..N-1
    executor <--(response MessageQueue per worker: 1 writer, 1 reader)-- worker r

Calls are typed msgspec Structs (`messages.WorkerCall`); every worker answers
every call, so an error on any rank surfaces. While waiting, the executor
polls the worker processes: a worker that exits turns into a
`WorkerDiedError` naming its rank, pid and exit code, never a hang; later
calls fail fast with the same error. Workers exit on `Shutdown`, or on their
own when the executor's process disappears.

With pipeline parallelism (PP > 1) a `ReplyReader` thread reads the replies,
so `collective_rpc_async` returns a future as soon as the call is broadcast:
the engine sends micro-batch N+1 to stage 0 while the last stage still runs N.

Several nodes (`ParallelConfig.nnodes` > 1, vLLM's --nnodes): this executor,
on node 0, starts only node 0's ranks [0, world/nnodes) on the shared-memory
ring; a `RemoteNodes` link sends every call over TCP to the agent of each
other node (`paged serve --headless --node-rank R`, `node_agent.py`), which
runs that node's ranks and answers once per call; only the output rank's
result of a step travels back. torch.distributed joins all ranks at
tcp://master_addr:master_port. A remote node's death is a `WorkerDiedError`
like a local one's.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
import traceback
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from paged.runner.config import EngineConfig
from paged.runner.executor.abstract import Executor, WorkerDiedError, WorkerError
from paged.runner.executor.dispatch import serve_call
from paged.runner.executor.messages import (
    ExecuteModel,
    Ready,
    Reply,
    SampleTokens,
    Shutdown,
    WorkerCall,
    decode_call,
    decode_ready,
    decode_reply,
    encode,
    encode_result,
)
from paged.runner.executor.node_wire import Fingerprint, LinkTimeouts
from paged.runner.executor.rank_layout import node_ranks
from paged.runner.executor.remote_nodes import RemoteNodes
from paged.runner.executor.replies import ReplyReader, results_in_rank_order
from paged.runner.shm_broadcast import MessageQueue, QueueHandle
from paged.runner.worker import Worker

_POLL_S = 0.5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MultiprocExecutor(Executor):
    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        chunk_bytes: int = 1 << 22,
        n_chunks: int = 8,
        startup_timeout: float = 900.0,
        link_timeouts: LinkTimeouts | None = None,
    ) -> None:
        super().__init__(engine_config)
        parallel = engine_config.parallel_config
        self.world_size = parallel.world_size
        self.local_ranks = node_ranks(parallel, 0)  # every rank unless nnodes > 1
        self._dead: str | None = None
        self._closed = False
        self._replies: ReplyReader | None = None
        self._remote: RemoteNodes | None = None
        self.procs: list[BaseProcess] = []
        handle = MessageQueue.make_handle(len(self.local_ranks), n_chunks, chunk_bytes)
        self.broadcast = MessageQueue.create_writer(handle)
        response_handles = [MessageQueue.make_handle(1, 4, chunk_bytes) for _ in self.local_ranks]
        self.responses = [MessageQueue.create_reader(h, 0) for h in response_handles]
        timeouts = link_timeouts if link_timeouts is not None else LinkTimeouts.from_env()
        try:
            if parallel.nnodes > 1:
                # Listening before any worker starts: a node may say Hello at once.
                self._remote = RemoteNodes(
                    parallel, Fingerprint.of(engine_config), self.output_rank, timeouts
                )
                init_method = f"tcp://{parallel.master_addr}:{parallel.master_port}"
            else:
                init_method = f"tcp://127.0.0.1:{_free_port()}"
            self.procs = start_worker_processes(
                engine_config, self.local_ranks, init_method, handle, response_handles
            )
            self._wait_ready(startup_timeout, timeouts.join_s)
        except BaseException:
            # Workers may be blocked in torch.distributed's rendezvous: kill, do not wait.
            self._dead = self._dead or "the executor failed to start"
            self.shutdown()
            raise
        if self.pp_size > 1:
            # From here on only this thread reads the response queues.
            remote = self._remote
            self._replies = ReplyReader(
                self.responses,
                self._check_alive,
                world_size=self.world_size,
                remote_collect=None if remote is None else lambda: remote.collect(None),
            )

    def _wait_ready(self, timeout: float, join_timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self._remote is not None:
            # Local ranks block in torch.distributed until every node's ranks join.
            self._remote.wait_joined(time.monotonic() + join_timeout)
        errors = []
        for rank, queue in zip(self.local_ranks, self.responses, strict=True):
            ready: Ready = decode_ready(self._dequeue(queue, rank, deadline))
            if ready.error:
                errors.append(f"worker {rank} failed to start:\n{ready.error}")
        if errors:
            raise WorkerError("\n".join(errors))
        if self._remote is not None:
            self._remote.wait_ready(deadline)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        if self._remote is not None:
            try:
                self._remote.check_alive()
            except WorkerDiedError as exc:
                self._dead = str(exc)
                raise
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._dead = (
                    f"worker {rank} (pid {proc.pid}) died with exit code {proc.exitcode}; "
                    "the executor cannot continue"
                )
                raise WorkerDiedError(self._dead)

    def _dequeue(self, queue: MessageQueue, rank: int, deadline: float | None) -> bytes:
        while True:
            self._check_alive()
            try:
                return queue.dequeue(timeout=_POLL_S)
            except TimeoutError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"worker {rank} did not answer in time") from None

    def _broadcast(self, call: WorkerCall, deadline: float | None) -> None:
        if self._closed:
            raise RuntimeError("the executor is shut down")
        self._check_alive()
        payload = encode(call)
        if self._remote is not None:  # first: the network hop overlaps the local enqueue
            self._remote.send_call(payload, isinstance(call, (ExecuteModel, SampleTokens)))
        while True:
            try:
                self.broadcast.enqueue(payload, timeout=_POLL_S)
                return
            except TimeoutError:
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise

    def collective_rpc_async(self, call: WorkerCall) -> Future[list[Any]]:
        if self._replies is None:
            return super().collective_rpc_async(call)
        self._broadcast(call, None)
        return self._replies.expect(call)

    def collective_rpc(self, call: WorkerCall, timeout: float | None = None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._replies is not None:
            self._broadcast(call, deadline)
            return self._replies.expect(call).result(timeout)
        self._broadcast(call, deadline)
        replies: list[Reply] = [
            decode_reply(self._dequeue(queue, rank, deadline))
            for rank, queue in zip(self.local_ranks, self.responses, strict=True)
        ]
        if self._remote is not None:
            replies.extend(self._remote.collect(deadline))
        return results_in_rank_order(call, replies, self.world_size)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dead is None and self.procs and all(p.is_alive() for p in self.procs):
            try:
                if self._remote is not None:
                    self._remote.send_call(encode(Shutdown()), output_rank_only=False)
                self.broadcast.enqueue(encode(Shutdown()), timeout=5.0)
                if self._replies is not None:
                    self._replies.expect(Shutdown()).result(timeout=30.0)
                else:
                    for rank, queue in zip(self.local_ranks, self.responses, strict=True):
                        self._dequeue(queue, rank, time.monotonic() + 30.0)
                    if self._remote is not None:
                        self._remote.collect(time.monotonic() + 30.0)
            except (TimeoutError, WorkerDiedError, WorkerError, RuntimeError):
                pass
        elif self._dead is not None:
            # A dead peer leaves the others blocked in a transfer: do not wait for them.
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
        if self._remote is not None:
            self._remote.close()  # the other nodes see the link close and exit
        if self._replies is not None:
            self._replies.stop()
        for proc in self.procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self.broadcast.close()
        for queue in self.responses:
            queue.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()


def start_worker_processes(
    engine_config: EngineConfig,
    ranks: range,
    init_method: str,
    broadcast_handle: QueueHandle,
    response_handles: list[QueueHandle],
) -> list[BaseProcess]:
    """One spawned worker process per global rank in `ranks` (this node's), in order.

    Local rank i (its reader slot on the ring, its CUDA device) serves global
    rank ranks[i]; each exits when this process does.
    """
    ctx = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = []
    for local_rank, rank in enumerate(ranks):
        proc = ctx.Process(
            target=worker_main,
            args=(
                engine_config,
                rank,
                init_method,
                broadcast_handle,
                response_handles[local_rank],
                os.getpid(),
                local_rank,
            ),
            name=f"paged-worker-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def worker_main(
    engine_config: EngineConfig,
    rank: int,
    init_method: str,
    broadcast_handle: QueueHandle,
    response_handle: QueueHandle,
    parent_pid: int,
    local_rank: int | None = None,
) -> None:
    """Entry point of a worker process: start up, report Ready, then serve calls.

    `local_rank` (default: `rank`) is its index on this node: its reader slot
    on the broadcast ring and its CUDA device.
    """
    # A terminal's Ctrl-C reaches the whole process group. The parent owns
    # shutdown (it stops its workers, and a worker whose parent is gone exits),
    # and `paged chat` turns Ctrl-C into "stop this reply": a worker dying of
    # KeyboardInterrupt would take the engine down instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    local_rank = rank if local_rank is None else local_rank
    responses = MessageQueue.attach(response_handle, writer=True)
    calls = MessageQueue.attach(broadcast_handle, writer=False, reader_rank=local_rank)
    try:
        torch.set_num_threads(worker_threads(engine_config.parallel_config.ranks_per_node))
        worker = Worker(
            engine_config, rank=rank, local_rank=local_rank, distributed_init_method=init_method
        )
        worker.init_device()
        worker.load_model()
    except Exception:
        responses.enqueue(encode(Ready(rank, os.getpid(), error=traceback.format_exc())))
        return
    responses.enqueue(encode(Ready(rank, os.getpid())))
    try:
        _serve(worker, rank, calls, responses, parent_pid)
    finally:
        calls.close()
        responses.close()


def worker_threads(ranks_on_this_node: int) -> int:
    """torch threads per worker: PAGED_WORKER_NUM_THREADS, else the node's cores shared out.

    Sharing the cores between the node's ranks avoids oversubscribing them; the
    variable overrides it where several "nodes" share one host (benchmarks).
    """
    raw = os.environ.get("PAGED_WORKER_NUM_THREADS", "")
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"PAGED_WORKER_NUM_THREADS: must be an integer >= 1, got {raw!r}")
        return int(raw)
    return max(1, (os.cpu_count() or 1) // ranks_on_this_node)


def _serve(
    worker: Worker, rank: int, calls: MessageQueue, responses: MessageQueue, parent_pid: int
) -> None:
    while True:
        try:
            data = calls.dequeue(timeout=1.0)
        except TimeoutError:
            if os.getppid() != parent_pid:
                return  # the executor's process is gone: nobody will call again
            continue
        call = decode_call(data)
        try:
            reply = Reply(rank, encode_result(call, serve_call(worker, call)))
        except Exception:
            reply = Reply(rank, error=traceback.format_exc())
        responses.enqueue(encode(reply))
        if isinstance(call, Shutdown):
            return

"""`ReplyReader`: collect every worker's reply to each call on a thread of its own.

Pipeline parallelism keeps several calls in flight: the executor broadcasts
step N+1 while the last stage still runs step N, so the caller cannot block
reading replies after each call. Each call gets a `Future`; one thread reads
the replies in call order (the order every worker answers in) and resolves
them: the list of results in rank order, a `WorkerError` naming the ranks that
raised, or `WorkerDiedError` once a worker process is gone, for that call and
every later one.

    caller:  enqueue(call) -> reader.expect(call) -> Future
    thread:  for each expected call: one reply from each rank -> set the Future
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from paged.runner.executor.abstract import WorkerError
from paged.runner.executor.messages import Reply, WorkerCall, decode_reply, decode_result
from paged.runner.shm_broadcast import MessageQueue

_POLL_S = 0.2


def results_in_rank_order(call: WorkerCall, replies: Sequence[Reply], world_size: int) -> list[Any]:
    """Every rank's decoded result, by rank; None for a rank that sent none.

    Remote nodes send only the output rank's result of a step (the others'
    would be discarded), so those slots stay None. Any error reply raises
    `WorkerError` naming its rank.
    """
    results: list[Any] = [None] * world_size
    errors: list[str] = []
    for reply in sorted(replies, key=lambda r: r.rank):
        if reply.error is not None:
            errors.append(f"worker {reply.rank}: {reply.error}")
        else:
            results[reply.rank] = decode_result(call, reply.result)
    if errors:
        raise WorkerError("\n".join(errors))
    return results


class ReplyReader:
    def __init__(
        self,
        responses: Sequence[MessageQueue],
        check_alive: Callable[[], None],
        *,
        world_size: int | None = None,
        remote_collect: Callable[[], list[Reply]] | None = None,
    ) -> None:
        """responses: one queue per local rank; check_alive raises WorkerDiedError for a dead
        worker; remote_collect: the other nodes' replies to the next call (multi-node)."""
        self._responses = list(responses)
        self._world_size = len(self._responses) if world_size is None else world_size
        self._remote_collect = remote_collect
        self._check_alive = check_alive
        self._expected: queue.SimpleQueue[tuple[WorkerCall, Future[list[Any]]] | None] = (
            queue.SimpleQueue()
        )
        self._failure: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-replies", daemon=True)
        self._thread.start()

    def expect(self, call: WorkerCall) -> Future[list[Any]]:
        """The future of `call`'s results; call right after broadcasting it."""
        future: Future[list[Any]] = Future()
        self._expected.put((call, future))
        return future

    def stop(self) -> None:
        """Stop the thread; calls still expected fail with RuntimeError."""
        self._stopping.set()
        self._expected.put(None)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            item = self._expected.get()
            if item is None:
                break
            call, future = item
            if self._failure is not None:
                future.set_exception(self._failure)
                continue
            try:
                future.set_result(self._collect(call))
            except WorkerError as exc:
                future.set_exception(exc)  # the workers still serve: later calls proceed
            except BaseException as exc:
                self._failure = exc
                future.set_exception(exc)
        while True:  # drain: nobody will answer these any more
            try:
                left = self._expected.get_nowait()
            except queue.Empty:
                return
            if left is not None:
                left[1].set_exception(RuntimeError("the executor is shut down"))

    def _collect(self, call: WorkerCall) -> list[Any]:
        replies = [decode_reply(self._read(queue_)) for queue_ in self._responses]
        if self._remote_collect is not None:
            replies.extend(self._remote_collect())
        return results_in_rank_order(call, replies, self._world_size)

    def _read(self, queue_: MessageQueue) -> bytes:
        while True:
            self._check_alive()
            if self._stopping.is_set():
                raise RuntimeError("the executor is shut down")
            try:
                return queue_.dequeue(timeout=_POLL_S)
            except TimeoutError:
                continue

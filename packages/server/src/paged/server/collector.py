"""Per-request hand-off from the output handler to a `generate()` consumer.

vLLM's RequestOutputCollector: a slot, not a queue. If the consumer falls
behind, a new output is merged into the pending one (delta outputs are
concatenated per sample, cumulative ones replaced), so a slow client costs
no memory growth and never sees stale cumulative text.
"""

from __future__ import annotations

import asyncio

from paged.scheduler import RequestOutputKind
from paged.server.outputs import CompletionOutput, RequestOutput


class RequestOutputCollector:
    def __init__(self, output_kind: RequestOutputKind, request_id: str = "") -> None:
        # The engine's (internal, unique) id of the request this collects for:
        # what aborting it names (vLLM's `q.request_id`).
        self.request_id = request_id
        self._kind = output_kind
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        elif self._kind == RequestOutputKind.DELTA:
            _merge_delta(self._pending, output)
        else:
            self._pending = output
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        """Fail the consumer: `get()` raises `error` once pending output is read."""
        self._error = error
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        if self._error is not None and self._pending is None:
            raise self._error
        out, self._pending = self._pending, None
        if self._error is None:
            self._ready.clear()
        return out

    async def get(self) -> RequestOutput:
        while True:
            out = self.get_nowait()
            if out is not None:
                return out
            await self._ready.wait()


def _merge_delta(pending: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in pending.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            pending.outputs.append(c)
            continue
        _extend(old, c)
    pending.outputs.sort(key=lambda c: c.index)
    pending.finished = new.finished
    pending.error = new.error or pending.error
    pending.finish_detail = new.finish_detail or pending.finish_detail
    pending.num_cached_tokens = new.num_cached_tokens


def _extend(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids = old.token_ids + new.token_ids
    if old.logprobs is not None and new.logprobs is not None:
        old.logprobs = old.logprobs + new.logprobs
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason

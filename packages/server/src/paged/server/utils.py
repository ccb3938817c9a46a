"""Small async helpers shared by the API server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def merge_async_iterators(
    iterators: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Yield `(i, item)` from several async generators as items arrive.

    Closing (or cancelling) the merged iterator cancels the pending `anext`
    of every input and closes it, so each input's cleanup (an abort) runs.
    """
    pending: dict[asyncio.Future[T], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        for fut in pending:
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await fut
        for it in iterators:
            await it.aclose()

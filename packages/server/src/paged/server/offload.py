"""Blocking frontend work (tokenization, chat templates) kept off the event loop.

Tokenizing a 5 MB prompt takes seconds; on the event loop that freezes every
other request, /health included. Hugging Face fast tokenizers release the GIL
while they encode, so the same work on a worker thread leaves the loop free
(vLLM runs its tokenization on a thread pool executor for the same reason).

Small inputs run inline: a thread hop costs more than tokenizing them, and
they must not queue behind a big one that holds the worker.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# Inputs up to this many characters (or token ids) are handled inline: their
# tokenization takes well under a millisecond.
DEFAULT_INLINE_MAX_SIZE = 16_384


class BlockingWork:
    """Runs blocking calls for large inputs on one worker thread.

    One worker, as vLLM's tokenizer executor: large inputs are served one at a
    time, so a burst of huge prompts cannot spread over every core and starve
    the engine; small inputs never wait for it (they run inline).
    """

    def __init__(self, *, inline_max_size: int = DEFAULT_INLINE_MAX_SIZE) -> None:
        if inline_max_size < 0:
            raise ValueError(f"inline_max_size must be >= 0, got {inline_max_size}")
        self.inline_max_size = inline_max_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-tokenize")

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)`, on the worker thread when `size` is above the inline limit.

        If the awaiting task is cancelled (the client went away) the call
        still finishes on the worker; its result is dropped.
        """
        if size <= self.inline_max_size:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def prompt_size(prompt: object) -> int:
    """How big a prompt is, in characters or token ids (what tokenization time scales with)."""
    if isinstance(prompt, str | list):
        return len(prompt)
    if isinstance(prompt, Mapping):
        size = sum(prompt_size(prompt.get(key)) for key in ("prompt", "prompt_token_ids"))
        return size + _mm_size(prompt.get("multi_modal_data"))
    return 0


def _mm_size(mm_data: object) -> int:
    # Image processing time scales with pixels: count each pixel as a character.
    if not isinstance(mm_data, Mapping):
        return 0
    images = mm_data.get("image")
    items = images if isinstance(images, list | tuple) else [images]
    total = 0
    for item in items:
        size = getattr(item, "size", None)
        if isinstance(size, tuple) and len(size) == 2:
            total += int(size[0]) * int(size[1])
    return total


def messages_size(messages: Sequence[Mapping[str, Any]]) -> int:
    """The characters of chat messages' text (what template rendering time scales with)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, Sequence):
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                total += len(text) if isinstance(text, str) else 0
    return total

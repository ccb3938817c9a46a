"""`paged chat`: the terminal chat loop over an in-process `LLM`.

Ctrl-C during a reply stops that reply (its request is aborted) and returns
to the prompt; Ctrl-C or Ctrl-D at the prompt ends the chat. vLLM 0.33's
`vllm chat` (entrypoints/cli/openai.py:22-27) exits on the first Ctrl-C
instead, losing the conversation.

The engine runs in this process, so Ctrl-C must not raise KeyboardInterrupt
in the middle of an engine step (the scheduler could be left half-updated):
while a reply streams, SIGINT only sets a flag, and the loop stops between
two steps, where closing the stream aborts the request cleanly.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from paged.scheduler import SamplingParams
    from paged.server.llm import LLM

WELCOME = (
    "Chatting with the model. /reset clears the history; Ctrl-C stops a reply; "
    "/exit, Ctrl-D or Ctrl-C at the prompt quits."
)


class StopRequest:
    """A SIGINT handler that records the request instead of raising."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


SigintHandler = Callable[[int, FrameType | None], Any]
H = TypeVar("H", bound=SigintHandler)


@contextmanager
def sigint_handled_by(handler: H) -> Iterator[H]:
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(llm: LLM, params: SamplingParams, system: str | None) -> int:
    """The read-reply loop; returns the exit status (130 after Ctrl-C at the prompt)."""
    from paged.server.chat_utils import apply_chat_template

    base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    history = list(base)
    print(WELCOME)
    while True:
        try:
            # Installed here, not inherited: a chat started from a shell's background job
            # (or by nohup) inherits SIGINT ignored, and Python then raises no
            # KeyboardInterrupt, so Ctrl-C at the prompt would do nothing.
            with sigint_handled_by(signal.default_int_handler):
                line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 130
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(base)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        prompt = apply_chat_template(llm.tokenizer, history)
        print("model> ", end="", flush=True)
        reply, stopped = stream_reply(llm, {"prompt": prompt, "add_special_tokens": False}, params)
        print(" [stopped]" if stopped else "", flush=True)
        # What the user saw is what the model said, a stopped reply included.
        history.append({"role": "assistant", "content": reply})


def stream_reply(llm: LLM, prompt: Any, params: SamplingParams) -> tuple[str, bool]:
    """Print the reply as it streams; (text, whether Ctrl-C stopped it)."""
    reply = ""
    with sigint_handled_by(StopRequest()) as stop:
        stream = llm.stream(prompt, params)
        try:
            for out in stream:
                text = out.outputs[0].text
                reply += text
                print(text, end="", flush=True)
                if stop.requested:
                    break
        finally:
            stream.close()  # an unfinished request is aborted here
    return reply, stop.requested

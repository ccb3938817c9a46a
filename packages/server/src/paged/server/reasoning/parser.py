"""Split a reasoning model's output into its thinking and its answer, by tags.

One state machine serves both paths: `ReasoningStream.feed(delta)` for
streams, and `ReasoningParser.extract(text)` (the same machine fed once), so
the streamed `reasoning`/`content` pieces always add up to the non-streamed
message. Tags are matched in the decoded text, where a dedicated think token
decodes to its tag too; a tag split across deltas (`"</thi"`, `"nk>"`) is
held back until it is complete or ruled out, so no tag text ever leaks.

    states:   OPENING --(start tag or not)--> REASONING --end tag--> CONTENT
              (CONTENT first when the spec says so; a start tag there opens
              REASONING only for the generic parser, `open_in_content`)

The specs (`ReasoningSpec`) follow vLLM 0.33's parsers (registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class ReasoningSpec:
    """How one parser reads an output.

    `starts_in_reasoning`: the output is thinking until the end tag, whether or
    not it opens with the start tag (DeepSeek-R1 and Qwen3 templates put the
    start tag in the prompt). `open_in_content`: a start tag met in the answer
    opens a (single) thinking span (the generic parser). `implicit_ends`: tags
    that end the thinking and belong to the answer (Qwen3's `<tool_call>`).
    `strip_reasoning_trailing_ws`: trailing whitespace of the thinking is
    dropped (vLLM's parser engine does, e.g. for qwen3).
    """

    name: str
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    starts_in_reasoning: bool = True
    open_in_content: bool = False
    implicit_ends: tuple[str, ...] = ()
    strip_reasoning_trailing_ws: bool = False


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one feed adds: thinking text and answer text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class _State(Enum):
    OPENING = "opening"  # before the first non-tag text: an optional start tag may come
    REASONING = "reasoning"
    CONTENT = "content"


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ReasoningStream:
    """The split of one choice's output, fed delta by delta (not thread-safe)."""

    def __init__(
        self, spec: ReasoningSpec, thinking: bool = True, open_: bool | None = None
    ) -> None:
        """`thinking=False` (chat_template_kwargs enable_thinking false): all answer.

        `open_`: what the prompt says (its last tag): True the thinking is open (the
        output starts in it, whatever the spec), False it was closed (all answer),
        None the spec's own start.
        """
        self.spec = spec
        if open_ is False:
            thinking = False
        starts_thinking = spec.starts_in_reasoning or open_ is True
        self._state = _State.OPENING if thinking and starts_thinking else _State.CONTENT
        # True: no start tag is looked for in the answer (only the generic parser does).
        self._opened = not (thinking and spec.open_in_content) or open_ is True
        self._held = ""  # text that may be the start of a tag
        self._ws = ""  # the thinking's trailing whitespace (strip_reasoning_trailing_ws)
        self.reasoning_ended = self._state is _State.CONTENT

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        """Split `delta`; `final=True` flushes what was held back (the output ended)."""
        text = self._held + delta
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state is _State.OPENING:
                text = self._open(text, final)
                if self._state is _State.OPENING:  # undecided: wait for more text
                    self._held = text
                    text = ""
            elif self._state is _State.REASONING:
                text = self._in_reasoning(text, final, reasoning)
            else:
                text = self._in_content(text, final, content)
        return ReasoningDelta("".join(reasoning), "".join(content))

    # -- states ----------------------------------------------------------------------
    def _open(self, text: str, final: bool) -> str:
        tag = self.spec.start_tag
        if text.startswith(tag):
            self._state = _State.REASONING
            return text[len(tag) :]
        if tag.startswith(text) and not final:
            return text  # may still become the start tag
        self._state = _State.REASONING
        return text

    def _in_reasoning(self, text: str, final: bool, out: list[str]) -> str:
        ends = (self.spec.end_tag, *self.spec.implicit_ends)
        hits = [(text.find(t), t) for t in ends if t in text]
        if hits:
            pos, tag = min(hits)
            self._emit_reasoning(text[:pos], out)
            self._ws = ""  # the thinking ended: its trailing whitespace goes
            self._state = _State.CONTENT
            self.reasoning_ended = True
            # An implicit end (a tool-call tag) is part of the answer.
            return text[pos + len(tag) :] if tag == self.spec.end_tag else text[pos:]
        keep = 0 if final else _partial_suffix(text, ends)
        self._emit_reasoning(text[: len(text) - keep], out)
        self._held = text[len(text) - keep :]
        return ""

    def _emit_reasoning(self, text: str, out: list[str]) -> None:
        if not self.spec.strip_reasoning_trailing_ws:
            out.append(text)
            return
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        out.append(body)

    def _in_content(self, text: str, final: bool, out: list[str]) -> str:
        if self._opened:
            out.append(text)
            return ""
        tag = self.spec.start_tag
        pos = text.find(tag)
        if pos >= 0:
            out.append(text[:pos])
            self._opened = True
            self._state = _State.REASONING
            self.reasoning_ended = False
            return text[pos + len(tag) :]
        keep = 0 if final else _partial_suffix(text, (tag,))
        out.append(text[: len(text) - keep])
        self._held = text[len(text) - keep :]
        return ""


class ReasoningParser:
    """One configured parser (`--reasoning-parser NAME`); makes a stream per choice."""

    def __init__(self, spec: ReasoningSpec) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def stream(self, thinking: bool = True, open_: bool | None = None) -> ReasoningStream:
        return ReasoningStream(self.spec, thinking, open_)

    def extract(
        self, text: str, thinking: bool = True, open_: bool | None = None
    ) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, as vLLM: an empty part is None."""
        part = self.stream(thinking, open_).feed(text, final=True)
        return part.reasoning or None, part.content or None

"""RequestOutput pieces -> OpenAI JSON pieces (logprobs, usage, SSE framing)."""

from __future__ import annotations

import math

from pydantic import BaseModel

from paged.server.openai.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from paged.server.outputs import Logprob, SampleLogprobs

# JSON has no -inf; vLLM reports a large negative number instead.
_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return _MIN_LOGPROB if math.isinf(value) or math.isnan(value) else max(value, _MIN_LOGPROB)


def _text(entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else ""


def _top(position: dict[int, Logprob], k: int) -> list[Logprob]:
    # Alternatives ranked 1..k, best first (the chosen token is one of them
    # when it ranks within k).
    ranked = [e for e in position.values() if e.rank is not None and e.rank <= k]
    return sorted(ranked, key=lambda e: e.rank or 0)


def chat_logprobs(logprobs: SampleLogprobs | None, top_k: int) -> ChatChoiceLogprobs | None:
    if logprobs is None:
        return None
    content: list[ChatTokenLogprob] = []
    for position in logprobs:
        if not position:
            continue
        chosen = next(iter(position.values()))
        tops = [
            TopLogprob(token=_text(e), logprob=_lp(e.logprob), bytes=list(_text(e).encode()))
            for e in _top(position, top_k)
        ]
        content.append(
            ChatTokenLogprob(
                token=_text(chosen),
                logprob=_lp(chosen.logprob),
                bytes=list(_text(chosen).encode()),
                top_logprobs=tops,
            )
        )
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(
    logprobs: SampleLogprobs | None, top_k: int, start_offset: int
) -> CompletionLogProbs | None:
    """`start_offset`: characters of this choice's text already sent (streaming)."""
    if logprobs is None:
        return None
    out = CompletionLogProbs()
    offset = start_offset
    for position in logprobs:
        if not position:
            continue
        chosen = next(iter(position.values()))
        token = _text(chosen)
        out.tokens.append(token)
        out.token_logprobs.append(_lp(chosen.logprob))
        out.text_offset.append(offset)
        offset += len(token)
        top = {_text(e): _lp(e.logprob) for e in _top(position, top_k)}
        top.setdefault(token, _lp(chosen.logprob))
        out.top_logprobs.append(top)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"

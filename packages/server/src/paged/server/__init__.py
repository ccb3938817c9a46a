"""paged.server: the engine core, the frontend (AsyncLLM / LLM), the OpenAI API and the CLI.

Names are imported lazily, so `import paged.server` stays cheap and loads
neither torch nor uvicorn until they are used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged.scheduler import RequestOutputKind, SamplingParams
    from paged.server.async_llm import AsyncLLM
    from paged.server.engine_args import EngineArgs
    from paged.server.errors import ContextLengthError, InvalidRequestError
    from paged.server.llm import LLM
    from paged.server.lora import LoRARequest
    from paged.server.outputs import CompletionOutput, Logprob, RequestOutput

_EXPORTS = {
    "AsyncLLM": "paged.server.async_llm",
    "LLM": "paged.server.llm",
    "EngineArgs": "paged.server.engine_args",
    "RequestOutput": "paged.server.outputs",
    "CompletionOutput": "paged.server.outputs",
    "Logprob": "paged.server.outputs",
    "InvalidRequestError": "paged.server.errors",
    "LoRARequest": "paged.server.lora",
    "ContextLengthError": "paged.server.errors",
    "SamplingParams": "paged.scheduler",
    "RequestOutputKind": "paged.scheduler",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "ContextLengthError",
    "EngineArgs",
    "InvalidRequestError",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

"""`LLM` and `AsyncLLM` reach engine utilities through one accessor each.

A client without utilities (the fake engine) fails with `NoEngineUtilities`
(a NotImplementedError naming its type); one with them runs
`reset_prefix_cache` on the engine.
"""

from __future__ import annotations

from typing import Any

import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.client_protocols import NoEngineUtilities
from paged.server.llm import LLM


def test_no_engine_utilities_names_the_client_type() -> None:
    error = NoEngineUtilities(object())
    assert isinstance(error, NotImplementedError)
    assert str(error) == "object cannot run engine utilities"


def test_offline_llm_reset_prefix_cache(tokenizer: Any, fake_engine: Any) -> None:
    llm = LLM.from_engine_client(fake_engine, tokenizer, max_model_len=64)
    with pytest.raises(NoEngineUtilities, match=r"^FakeEngine cannot run engine utilities$"):
        llm.reset_prefix_cache()
    calls: list[str] = []

    def call_utility(method: str, *args: Any) -> Any:
        calls.append(method)
        return True

    fake_engine.call_utility = call_utility
    assert llm.reset_prefix_cache() is True
    assert calls == ["reset_prefix_cache"]


async def test_async_llm_reset_prefix_cache(tokenizer: Any, fake_engine: Any) -> None:
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=64)
    with pytest.raises(NoEngineUtilities, match=r"^FakeEngine cannot run engine utilities$"):
        await llm.reset_prefix_cache()
    calls: list[str] = []

    async def call_utility_async(method: str, *args: Any) -> Any:
        calls.append(method)
        return False  # requests still hold blocks

    fake_engine.call_utility_async = call_utility_async
    assert await llm.reset_prefix_cache() is False
    assert calls == ["reset_prefix_cache"]
    llm.shutdown()

"""Fixtures for the frontend tests: a tiny byte-level BPE tokenizer and a fake engine.

The fake engine implements the engine-client surface the frontend uses
(sync and async) with a deterministic "model": each step every running
request emits the next token of its script (by default its prompt, cycled).
It honours max_tokens, EOS/ignore_eos, stop_token_ids, min_tokens, logprobs
and aborts, like the real scheduler's stop checks.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from paged.scheduler import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    SchedulerStats,
)
from paged.server.async_llm import AsyncLLM

CORPUS = [
    "hello world the quick brown fox jumps over the lazy dog",
    "Hello, World! How are you today? I am fine, thank you.",
    "café naïve résumé 日本語のテキスト 😀🎉 emoji",
    "The capital of France is Paris. STOP here. stop there.",
    "0123456789 + - * / = ( ) [ ] { } < > \n\t",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|endoftext|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@dataclass
class _FakeReq:
    request: EngineCoreRequest
    script: list[int]
    generated: list[int] = field(default_factory=list)
    first: bool = True


Script = Callable[[EngineCoreRequest], list[int]]
# (request, tokens generated so far) -> (reason, detail) to finish it now with no new token.
FinishHook = Callable[[EngineCoreRequest, int], tuple[FinishReason, str] | None]


def _default_script(req: EngineCoreRequest) -> list[int]:
    return list(req.prompt_token_ids)


class FakeEngine:
    """A deterministic engine client; `step()` advances every running request by one token."""

    def __init__(
        self,
        script: Script = _default_script,
        vocab_size: int = 400,
        step_delay: float = 0.001,
        finish_hook: FinishHook | None = None,
    ) -> None:
        self.script = script
        self.finish_hook = finish_hook
        self.step_delay = step_delay
        self.vocab_size = vocab_size
        self.running: dict[str, _FakeReq] = {}
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.dead = False
        self.shut_down = False
        self._event = asyncio.Event() if _has_loop() else None

    # -- the engine "model" -----------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        outs: list[EngineCoreOutput] = []
        for rid, r in list(self.running.items()):
            p = r.request.sampling_params
            forced = self.finish_hook(r.request, len(r.generated)) if self.finish_hook else None
            if forced is not None:
                outs.append(
                    EngineCoreOutput(
                        request_id=rid, new_token_ids=[], finish_reason=forced[0],
                        finish_detail=forced[1],
                    )
                )  # fmt: skip
                del self.running[rid]
                continue
            tok = r.script[len(r.generated) % len(r.script)]
            r.generated.append(tok)
            finish: FinishReason | None = None
            stop_reason: int | str | None = None
            n = len(r.generated)
            if n >= p.min_tokens:
                if tok in p.stop_token_ids:
                    finish, stop_reason = FinishReason.STOP, tok
                elif tok == r.request.eos_token_id and not p.ignore_eos:
                    finish = FinishReason.STOP
            if finish is None and p.max_tokens is not None and n >= p.max_tokens:
                finish = FinishReason.LENGTH
            lps = None
            if p.logprobs is not None:
                k = p.logprobs
                # The chosen token is the most likely one (rank 1), then
                # neighbours at 0.1 each: column 1 repeats the chosen token.
                top = [tok] + [(tok + j) % self.vocab_size for j in range(1, k)]
                top_lps = [math.log(0.5)] + [math.log(0.1)] * (k - 1)
                lps = LogprobsLists([[tok, *top[:k]]], [[math.log(0.5), *top_lps[:k]]], [1])
            outs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=[tok],
                    new_logprobs=lps,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    num_cached_tokens=3 if r.first else 0,
                    # A stand-in EC connector: the last output answers the request's
                    # ec_transfer_params back (as an EPD producer answers its own).
                    ec_transfer_params=r.request.ec_transfer_params if finish else None,
                )
            )
            r.first = False
            if finish is not None:
                del self.running[rid]
        stats = SchedulerStats(num_running_reqs=len(self.running), kv_cache_usage=0.25)
        return EngineCoreOutputs(outputs=outs, scheduler_stats=stats, timestamp=0.0)

    # -- sync client surface ------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._check()
        self.added.append(request)
        self.running[request.request_id] = _FakeReq(request, self.script(request))
        if self._event is not None:
            self._event.set()

    def abort_requests(self, request_ids: list[str]) -> None:
        self._check()
        outs = []
        for rid in request_ids:
            self.aborted.append(rid)
            if self.running.pop(rid, None) is not None:
                outs.append(
                    EngineCoreOutput(
                        request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT
                    )
                )

    def get_output(self) -> EngineCoreOutputs:
        self._check()
        return self.step()

    def has_work(self) -> bool:
        return bool(self.running)

    def shutdown(self) -> None:
        self.shut_down = True

    # -- async client surface -----------------------------------------------------
    @property
    def dead_error(self) -> Any:
        from paged.server.engine.errors import EngineDeadError

        return EngineDeadError("fake engine died") if self.dead else None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            self._check()
            if self.running:
                await asyncio.sleep(self.step_delay)
                return self.step()
            if self._event is None:
                self._event = asyncio.Event()
            self._event.clear()
            await self._event.wait()

    def kill(self) -> None:
        self.dead = True
        if self._event is not None:
            self._event.set()

    def _check(self) -> None:
        if self.dead:
            from paged.server.engine.errors import EngineDeadError

            raise EngineDeadError("fake engine died")


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def engine_cls() -> type[FakeEngine]:
    """The fake engine class, for tests that need their own script."""
    return FakeEngine


@pytest.fixture
async def llm(tokenizer: Any, fake_engine: Any) -> AsyncIterator[AsyncLLM]:
    """An AsyncLLM over the fake engine (the OpenAI API tests' frontend)."""
    engine = AsyncLLM(fake_engine, tokenizer, max_model_len=128)
    yield engine
    engine.shutdown()

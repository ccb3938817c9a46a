"""A fake pooling engine for the pooling API tests (no model).

`FakePoolingEngine.encode` verifies the params with the real
`PoolingParams.verify` (so a `dimensions` the model refuses raises its
ValueError, as the engine does), then pools deterministically: an embedding
is a bag of the token ids hashed into `hidden` slots (L2-normalised unless
`use_activation` is False, first `dimensions` slots if asked); a
classification is a softmax over `num_labels` logits drawn from the ids; a
token task (`token_embed`, `token_classify`) one row per prompt token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from paged.scheduler import PoolingModelInfo, PoolingParams
from paged.server.errors import InvalidRequestError
from paged.server.input_processor import PromptType, TokensPrompt
from paged.server.offload import BlockingWork


@dataclass(frozen=True)
class FakeOutput:
    data: torch.Tensor


@dataclass(frozen=True)
class FakeRequestOutput:
    request_id: str
    outputs: FakeOutput
    prompt_token_ids: list[int]
    finished: bool = True


class VocabChecker:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def check_token_ids(self, ids: object, param: str) -> list[int]:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and 0 <= t < self.vocab_size for t in ids
        ):
            raise InvalidRequestError(param, f"{param} holds a token id out of range")
        return list(ids)


def fake_embedding(ids: list[int], hidden: int) -> torch.Tensor:
    vec = torch.zeros(hidden, dtype=torch.float32)
    for j, t in enumerate(ids):
        vec[(t * 7 + j) % hidden] += 1.0 + t / 100.0
    return vec


@dataclass
class FakePoolingEngine:
    tokenizer: Any
    max_model_len: int = 32
    hidden: int = 8
    num_labels: int = 3
    matryoshka: bool = False
    delay_s: float = 0.0
    offload: BlockingWork = field(default_factory=BlockingWork)
    calls: list[tuple[list[int], PoolingParams, str | None]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    @property
    def input_processor(self) -> VocabChecker:
        return VocabChecker(len(self.tokenizer))

    def info(self) -> PoolingModelInfo:
        return PoolingModelInfo(
            served_model_name="tiny-pool", embedding_size=self.hidden, is_matryoshka=self.matryoshka
        )

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
    ) -> AsyncGenerator[FakeRequestOutput, None]:
        assert isinstance(prompt, dict) and "prompt_token_ids" in prompt
        ids = list(cast(TokensPrompt, prompt)["prompt_token_ids"])
        params = pooling_params.verify(self.info())  # ValueError for what the model refuses
        self.calls.append((ids, pooling_params, request_id))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if params.task in ("token_embed", "token_classify"):
            # One row per prompt token (vLLM's ALL pooling): the token's own vector.
            width = self.hidden if params.task == "token_embed" else self.num_labels
            data = torch.stack([fake_embedding([t], width) for t in ids])
        elif params.task == "classify":
            logits = torch.tensor([float((sum(ids) * (k + 1)) % 5) for k in range(self.num_labels)])
            data = logits.softmax(-1) if params.use_activation else logits
        else:
            data = fake_embedding(ids, self.hidden)
            if params.dimensions is not None:
                data = data[: params.dimensions]
            if params.use_activation:
                data = torch.nn.functional.normalize(data, dim=-1)
        self.finished.append(str(request_id))
        yield FakeRequestOutput(str(request_id), FakeOutput(data), ids)

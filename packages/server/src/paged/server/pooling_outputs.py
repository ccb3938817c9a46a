"""What pooling requests hand to users: vLLM 0.33's `PoolingRequestOutput` family.

Names, fields and `from_base` conversions follow vllm/outputs.py:117-135 and
:302-490. `PoolingOutput.data` is a float32 CPU tensor decoded from the
engine's `PoolerOutput` bytes (`tensor_from_pooler_output`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from paged.scheduler.boundary import PoolerOutput

if TYPE_CHECKING:
    import torch


def tensor_from_pooler_output(output: PoolerOutput) -> torch.Tensor:
    """The engine's float32 bytes + shape back as a CPU tensor (a copy: it is writable)."""
    import numpy as np
    import torch

    array = np.frombuffer(output.data, dtype="<f4").reshape(output.shape)
    return torch.from_numpy(array.astype(np.float32, copy=True))


@dataclass
class PoolingOutput:
    """One pooling result of a request (vLLM's PoolingOutput): the pooled tensor."""

    data: torch.Tensor

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and bool((self.data == other.data).all())


_O = TypeVar("_O")


class PoolingRequestOutput(Generic[_O]):
    """The result of one pooling request (vLLM's PoolingRequestOutput).

    `error`: the engine's message when the request failed (then `outputs` is empty).
    """

    def __init__(
        self,
        request_id: str,
        outputs: _O,
        prompt_token_ids: list[int],
        num_cached_tokens: int,
        finished: bool,
        *,
        error: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finished = finished
        self.error = error

    def __repr__(self) -> str:
        error = f", error={self.error!r}" if self.error is not None else ""
        return (
            f"{type(self).__name__}(request_id={self.request_id!r}, "
            f"outputs={self.outputs!r}, prompt_token_ids={self.prompt_token_ids}, "
            f"num_cached_tokens={self.num_cached_tokens}, finished={self.finished}{error})"
        )


@dataclass
class EmbeddingOutput:
    """An embedding vector (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        data = pooling_output.data
        if data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput([float(x) for x in data.tolist()])

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        outputs = (
            EmbeddingOutput([])
            if request_output.error is not None
            else EmbeddingOutput.from_base(request_output.outputs)
        )
        return EmbeddingRequestOutput(
            request_output.request_id,
            outputs,
            request_output.prompt_token_ids,
            request_output.num_cached_tokens,
            request_output.finished,
            error=request_output.error,
        )


@dataclass
class ClassificationOutput:
    """A class-probability vector (vLLM's ClassificationOutput)."""

    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        data = pooling_output.data
        if data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput([float(x) for x in data.tolist()])

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    def __repr__(self) -> str:
        return f"ClassificationOutput(num_classes={self.num_classes})"


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @staticmethod
    def from_base(
        request_output: PoolingRequestOutput[PoolingOutput],
    ) -> ClassificationRequestOutput:
        outputs = (
            ClassificationOutput([])
            if request_output.error is not None
            else ClassificationOutput.from_base(request_output.outputs)
        )
        return ClassificationRequestOutput(
            request_output.request_id,
            outputs,
            request_output.prompt_token_ids,
            request_output.num_cached_tokens,
            request_output.finished,
            error=request_output.error,
        )


@dataclass
class ScoringOutput:
    """A similarity or relevance score (vLLM's ScoringOutput)."""

    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ScoringOutput:
        data = pooling_output.data.squeeze()
        if data.ndim != 0:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(float(data.item()))

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput[PoolingOutput]) -> ScoringRequestOutput:
        outputs = (
            ScoringOutput(0.0)
            if request_output.error is not None
            else ScoringOutput.from_base(request_output.outputs)
        )
        return ScoringRequestOutput(
            request_output.request_id,
            outputs,
            request_output.prompt_token_ids,
            request_output.num_cached_tokens,
            request_output.finished,
            error=request_output.error,
        )


class PoolingOutputCollector:
    """The hand-off slot of one pooling request (FINAL_ONLY: one output, then done)."""

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self._pending: PoolingRequestOutput[PoolingOutput] | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: PoolingRequestOutput[PoolingOutput]) -> None:
        self._pending = output
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def get_nowait(self) -> PoolingRequestOutput[PoolingOutput] | None:
        if self._error is not None and self._pending is None:
            raise self._error
        out, self._pending = self._pending, None
        if self._error is None:
            self._ready.clear()
        return out

    async def get(self) -> PoolingRequestOutput[PoolingOutput]:
        while True:
            out = self.get_nowait()
            if out is not None:
                return out
            await self._ready.wait()

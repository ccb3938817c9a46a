"""`EncoderPoolingRunner`: the worker of an encoder-only pooling model (BERT family).

vLLM 0.33 runs bidirectional encoders without a KV cache and with chunked
prefill and prefix caching off (vllm/config/model.py:2193-2205, 2239-2250;
model_states/encoder_only.py). paged does the same: every scheduled request
is a whole prompt (the engine turns chunking off, so the scheduler's token
budget still caps a step), the step's prompts run as one token-packed batch
(no padding rows), and each request is pooled and finished in that step.

The scheduler still needs block accounting to admit requests; as the EPD
encoder producer (`encode_only.py`), this runner reports a virtual KV cache
(one group of a one-element spec, no tensor behind it).

Cross-encoder pairs carry their segment ids as vLLM does: the half-open range
of token type 1 in `PoolingParams.extra_kwargs["compressed_token_type_ids"]`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from paged.kvcache import KVCacheConfig, KVCacheSpec
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.encode_only import VIRTUAL_KV_LAYER, virtual_kv_bytes, virtual_kv_spec
from paged.runner.pooling import Pooler, PoolingInput
from paged.runner.pooling_setup import build_model_pooler
from paged.runner.pooling_step import to_pooler_output
from paged.scheduler.boundary import (
    GrammarOutput,
    ModelRunnerOutput,
    PoolerOutput,
    SchedulerOutput,
)
from paged.scheduler.pooling_params import PoolingParams


class EncoderModel(Protocol):
    """pool-models' BERT-family encoder (token-packed, bidirectional within a sequence)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor: ...


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: PoolingParams


def token_type_range(params: PoolingParams) -> tuple[int, int] | None:
    """vLLM's compressed token types: (start, end) of the type-1 segment, or None."""
    extra = params.extra_kwargs
    value: Any = None if extra is None else extra.get("compressed_token_type_ids")
    if value is None:
        return None
    start, end = (int(v) for v in value)
    return start, end


class EncoderPoolingRunner:
    """See the module docstring. The worker drives it like a `ModelRunner`."""

    kv_connector = None  # no KV cache to transfer
    ec_connector = None

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_limits: SchedulerLimits,
        device: torch.device | str,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.limits = scheduler_limits
        self.device = torch.device(device)
        self.model: EncoderModel | None = None
        self.pooler: Pooler | None = None
        self.requests: dict[str, _Request] = {}

    # ----------------------------------------------------------- start-up

    def load_model(self, model: EncoderModel | None = None, pooler: Pooler | None = None) -> None:
        """Load the encoder and build the pooler (or adopt them, e.g. in tests)."""
        if model is None:
            from paged.runner.models.bert import load_bert_model

            model = load_bert_model(
                self.model_config.model, dtype=self.model_config.dtype, device=self.device
            )
        self.model = model
        self.pooler = pooler if pooler is not None else build_model_pooler(self.model_config)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {VIRTUAL_KV_LAYER: virtual_kv_spec(self.cache_config.block_size)}

    def determine_available_memory(self) -> int:
        return virtual_kv_bytes(
            self.cache_config.block_size, self.limits, self.model_config.max_model_len
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Nothing to allocate: the blocks are the scheduler's bookkeeping only."""

    # ---------------------------------------------------------------- step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        model, pooler = self._require_loaded()
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is None or new.pooling_params.task is None:
                raise ValueError(
                    f"scheduler_output: request {new.req_id!r} is not a pooling request; "
                    f"the encoder-only model {self.model_config.architecture} only pools"
                )
            self.requests[new.req_id] = _Request(list(new.prompt_token_ids), new.pooling_params)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput()
        batch: list[_Request] = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                raise ValueError(f"scheduler_output: unknown request {req_id!r}")
            n = so.num_scheduled_tokens[req_id]
            if n != len(req.prompt_token_ids):
                raise ValueError(
                    f"scheduler_output: request {req_id!r} schedules {n} of its "
                    f"{len(req.prompt_token_ids)} tokens; an encoder-only model needs the "
                    "whole prompt in one step (chunked prefill must be off)"
                )
            batch.append(req)
        hidden = self._forward(model, batch)
        inputs: list[PoolingInput] = []
        start = 0
        for req in batch:
            n = len(req.prompt_token_ids)
            inputs.append(_pooling_input(req, hidden[start : start + n]))
            start += n
        with _one_torch_thread():
            rows = pooler(inputs)
        pooled: dict[str, PoolerOutput] = {
            req_id: to_pooler_output(t) for req_id, t in zip(req_ids, rows, strict=True)
        }
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids],
            pooler_output=pooled,
        )

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        raise RuntimeError("an encoder-only pooling runner samples nothing")

    def _forward(self, model: EncoderModel, batch: Sequence[_Request]) -> torch.Tensor:
        ids: list[int] = []
        positions: list[int] = []
        types: list[int] = []
        seq_lens: list[int] = []
        any_types = False
        for req in batch:
            n = len(req.prompt_token_ids)
            ids.extend(req.prompt_token_ids)
            positions.extend(range(n))
            seq_lens.append(n)
            span = token_type_range(req.params)
            if span is None:
                types.extend([0] * n)
            else:
                any_types = True
                types.extend(1 if span[0] <= p < span[1] else 0 for p in range(n))
        dev = self.device
        token_types = torch.tensor(types, dtype=torch.int64, device=dev) if any_types else None
        return model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            seq_lens,
            token_types,
        )

    def _require_loaded(self) -> tuple[EncoderModel, Pooler]:
        if self.model is None or self.pooler is None:
            raise RuntimeError("load_model() must be called before execute_model()")
        return self.model, self.pooler


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run the pooler's small per-request reductions on the calling thread only.

    The pooler reduces each request on its own (a mean over one prompt's rows is
    ~0.06 ms of work). With several torch threads each op is an OpenMP parallel
    region that ends in a barrier: when another process holds one of the cores,
    that barrier waits for it (measured ~20 ms per MEAN at 2 threads on a loaded
    2-core machine), 1,000 requests a few seconds. The forward keeps its threads.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pooling_input(req: _Request, states: torch.Tensor) -> PoolingInput:
    params = req.params
    assert params.task is not None  # checked when the request arrived
    return PoolingInput(
        hidden_states=states.to(dtype=torch.float32),
        prompt_token_ids=req.prompt_token_ids,
        task=params.task,
        dimensions=params.dimensions,
        use_activation=params.use_activation,
        step_tag_id=params.step_tag_id,
        returned_token_ids=params.returned_token_ids,
    )

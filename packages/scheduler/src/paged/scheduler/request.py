"""`Request`: the scheduler's mutable record of one request, and its lifecycle.

Statuses are grouped into explicit sets (never compared by enum order):

    WAITING ------------------> RUNNING ----------> FINISHED_* (stopped, length capped,
      |  ^                        |  ^                          aborted, ignored, error)
      |  |                        v  |
      |  +---- WAITING_FOR_REMOTE_KVS (async KV load)   PREEMPTED (recompute from scratch,
      |                                                  back at the front of waiting)

Block hashes grow incrementally: the hasher (from paged.kvcache) is called at
construction and after every appended token, and only hashes newly full blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

from paged.kvcache.ids import BlockHash
from paged.multimodal.inputs import MultiModalFeatureSpec
from paged.scheduler.boundary import EngineCoreRequest, FinishReason, KVTransferParams
from paged.scheduler.pooling_params import PoolingParams
from paged.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_IGNORED = "finished_ignored"
    FINISHED_ERROR = "finished_error"

    def __str__(self) -> str:
        return self.value


# Statuses of requests that sit in the waiting queue.
WAITING_STATUSES: frozenset[RequestStatus] = frozenset(
    {RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.PREEMPTED}
)
FINISHED_STATUSES: frozenset[RequestStatus] = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
        RequestStatus.FINISHED_ERROR,
    }
)
_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    # vLLM reports an ignored (never schedulable) prompt as a length finish.
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def is_finished_status(status: RequestStatus) -> bool:
    return status in FINISHED_STATUSES


def finish_reason_of(status: RequestStatus) -> FinishReason | None:
    """The frontend-facing reason for a finished status; None while unfinished."""
    return _FINISH_REASONS.get(status)


BlockHasher = Callable[["Request"], list[BlockHash]]


class Request:
    """One request as the scheduler tracks it (hot record: `__slots__`).

    `num_computed_tokens` counts tokens whose KV is (or, after this step's
    schedule, will be) in the cache. `num_cached_tokens` is the prefix-cache
    plus external hit at first admission (-1 until then). `spec_token_ids`
    holds draft tokens proposed for the next step.
    """

    __slots__ = (
        "_block_hasher",
        "_hash_block_size",
        "_output_token_ids",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "client_index",
        "ec_transfer_params",
        "eos_token_id",
        "finish_detail",
        "kv_load_target_tokens",
        "kv_transfer_params",
        "lora_name",
        "lora_path",
        "max_tokens",
        "mm_features",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_computed_tokens",
        "num_nans_in_logits",
        "num_preemptions",
        "num_prompt_tokens",
        "pooling_params",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        *,
        max_model_len: int,
        arrival_time: float = 0.0,
        priority: int = 0,
        client_index: int = 0,
        mm_features: Sequence[MultiModalFeatureSpec] | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        block_hasher: BlockHasher | None = None,
        ec_transfer_params: dict[str, Any] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_index = client_index
        self.mm_features: list[MultiModalFeatureSpec] = list(mm_features or ())
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        # Which EPD producer holds each mm item's encoder output (the EC connector reads it).
        self.ec_transfer_params = ec_transfer_params
        # A pooling request (embed/classify/...) finishes with its prefill.
        self.pooling_params = pooling_params
        # max_tokens=None means "whatever max_model_len leaves after the prompt".
        requested = sampling_params.max_tokens
        room = max(max_model_len - self.num_prompt_tokens, 0)
        self.max_tokens = room if requested is None else requested
        if pooling_params is not None:
            self.max_tokens = 1  # as vllm/v1/request.py:109-111: one "step" past the prompt
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.finish_detail: str | None = None
        self._output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_external_computed_tokens = 0
        # Tokens counted as computed once an async KV load finishes.
        self.kv_load_target_tokens = 0
        self.num_preemptions = 0
        self.num_nans_in_logits = 0
        self._block_hasher = block_hasher
        # paged.kvcache's hasher publishes its block size so appends that cannot
        # complete a block skip the call (most decode steps); 0: always call.
        self._hash_block_size: int = getattr(block_hasher, "block_size", 0)
        self.block_hashes: list[BlockHash] = []
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        *,
        max_model_len: int,
        block_hasher: BlockHasher | None = None,
    ) -> Request:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            max_model_len=max_model_len,
            arrival_time=request.arrival_time,
            priority=request.priority,
            client_index=request.client_index,
            mm_features=request.mm_features,
            lora_name=request.lora_request,
            lora_path=request.lora_path if request.lora_request is not None else None,
            cache_salt=request.cache_salt,
            kv_transfer_params=request.kv_transfer_params,
            block_hasher=block_hasher,
            ec_transfer_params=request.ec_transfer_params,
            pooling_params=request.pooling_params,
        )

    # -- token views --------------------------------------------------------
    @property
    def output_token_ids(self) -> Sequence[int]:
        return self._output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens and hash any block they complete."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        hasher = self._block_hasher
        if hasher is not None and len(self.all_token_ids) >= self._hash_block_size * (
            len(self.block_hashes) + 1
        ):
            self.block_hashes.extend(hasher(self))

    # -- views paged.kvcache and the encoder cache read ------------------------
    @property
    def skip_reading_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, so cached
        # prefix positions must be recomputed; so do pooling tasks that return a
        # row per prompt token (PoolingParams.verify decides, as vLLM's).
        pooling = self.pooling_params
        if pooling is not None:
            return bool(pooling.skip_reading_prefix_cache)
        return self.sampling_params.prompt_logprobs is not None

    @property
    def has_encoder_inputs(self) -> bool:
        return bool(self.mm_features)

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self.mm_features[input_id].mm_position.get_num_embeds()

    # -- lifecycle -----------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )

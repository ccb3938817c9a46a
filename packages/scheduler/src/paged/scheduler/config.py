"""`SchedulerConfig`: the limits one scheduling step works under."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from paged.scheduler.sampling_params import DEFAULT_MAX_LOGPROBS

logger = logging.getLogger(__name__)

SchedulingPolicy = Literal["fcfs", "priority"]
# vLLM's KVTransferConfig.kv_load_failure_policy values.
KVLoadFailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Scheduling limits, with vLLM's names and defaults.

    - `max_num_batched_tokens`: token budget of one step (prefill chunks and
      decodes together, the unified compute model).
    - `max_num_seqs`: most requests RUNNING at once.
    - `max_model_len`: most tokens (prompt + output) one request may hold.
    - `long_prefill_token_threshold`: when > 0, a prompt chunk is cut to this
      many tokens per step so long prompts do not starve decodes (ignored when
      only one request is running or waiting).
    - `long_prefill_token_threshold_adaptive`: floor that cap at a fair share of
      the step, `max_num_batched_tokens // (running + waiting)` (vLLM 0.33's
      `--long-prefill-token-threshold-adaptive`; only with a non-zero threshold).
    - `policy`: "fcfs" (arrival order) or "priority" (smallest `priority`
      first, arrival time breaking ties; victims of preemption are the largest).
    - `max_num_encoder_input_tokens` / `encoder_cache_size`: per-step encoder
      compute budget and encoder cache capacity, in embeddings; `None` means
      `max_num_batched_tokens` (vLLM's default). Both are raised to fit the
      largest multimodal item (`compute_mm_encoder_budget`).
    - `disable_chunked_mm_input`: never split one multimodal item's placeholder
      across steps (the chunk stops before it instead).
    - `num_lookahead_tokens`: extra slots allocated per running request for
      speculative decoding drafts.
    - `num_speculative_tokens`: drafts per step when speculative decoding is
      on (0: off); the scheduler then reports `SpecDecodingStats`.
    - `kv_load_failure_policy`: what a KV connector load error does to the
      requests whose blocks failed (vLLM's `KVTransferConfig` field, copied
      here by the engine core): "recompute" rewinds them to the first bad
      block; "fail" finishes them with FinishReason.ERROR.
    - `encode_only`: an EPD encoder producer (`--ec-role producer`): the runner
      samples nothing, and a request finishes (LENGTH_CAPPED, no tokens) in the
      step that computes the rest of its prompt, so every item was encoded.
    - `pipeline_parallel_size`: with > 1 the runner's first stages never see
      the sampled tokens, so every running request's step tokens travel in
      `CachedRequestData.new_token_ids` (vLLM's `use_pp`).
    - `max_loras`: most distinct LoRA adapters among the running requests
      (`--max-loras`); None: LoRA off, adapters are not counted. A waiting
      request whose adapter would be one too many waits while later ones go.
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    policy: SchedulingPolicy = "fcfs"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    disable_chunked_mm_input: bool = False
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    num_lookahead_tokens: int = 0
    num_speculative_tokens: int = 0
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    encode_only: bool = False
    pipeline_parallel_size: int = 1
    max_loras: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "pipeline_parallel_size",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in (
            "long_prefill_token_threshold",
            "max_logprobs",
            "num_lookahead_tokens",
            "num_speculative_tokens",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 or None, got {self.max_loras}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                "kv_load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.kv_load_failure_policy!r}"
            )
        self._check_limits_against_each_other()

    def _check_limits_against_each_other(self) -> None:
        """vLLM's `SchedulerConfig.verify_max_model_len`: same conditions, order and messages.

        `long_prefill_token_threshold > max_model_len` is rejected whatever the
        other options, as current vLLM does (older vLLM checked it only with
        `max_num_partial_prefills > 1`, an option paged does not have).
        """
        batched, seqs = self.max_num_batched_tokens, self.max_num_seqs
        model_len = self.max_model_len
        if not self.enable_chunked_prefill and batched < model_len:
            # Without chunking a prompt must fit one step, or it could never run.
            raise ValueError(
                f"max_num_batched_tokens ({batched}) is smaller than max_model_len "
                f"({model_len}). This effectively limits the maximum sequence length to "
                "max_num_batched_tokens and makes paged reject longer sequences. Please "
                "increase max_num_batched_tokens or decrease max_model_len."
            )
        if batched < seqs:
            # Every running request needs at least one token of budget to decode.
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be greater than or equal to "
                f"max_num_seqs ({seqs})."
            )
        threshold = self.long_prefill_token_threshold
        if threshold > model_len:
            # A chunk cap above the context length can never bind: a mistyped limit.
            raise ValueError(
                f"long_prefill_token_threshold ({threshold}) cannot be greater than the "
                f"max_model_len ({model_len})."
            )
        if batched > seqs * model_len:
            logger.warning(
                "max_num_batched_tokens (%d) exceeds max_num_seqs * max_model_len (%d). "
                "This may lead to unexpected behavior.",
                batched,
                seqs * model_len,
            )

    @property
    def resolved_max_num_encoder_input_tokens(self) -> int:
        if self.max_num_encoder_input_tokens is None:
            return self.max_num_batched_tokens
        return self.max_num_encoder_input_tokens

    @property
    def resolved_encoder_cache_size(self) -> int:
        if self.encoder_cache_size is None:
            return self.max_num_batched_tokens
        return self.encoder_cache_size

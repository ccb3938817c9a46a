"""The boundary types that cut the engine (seed: テキスト推論データフロー).

Structs only, no logic: every type here crosses a process boundary as
msgpack (`array_like`, `omit_defaults`). Scheduler -> runner types carry
diffs (`CachedRequestData`) so per-step IPC stays small.

    EngineCoreRequest   frontend      -> engine core
    SchedulerOutput     scheduler     -> executor / runner
    ModelRunnerOutput   runner        -> scheduler
    EngineCoreOutputs   engine core   -> frontend
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from paged.multimodal.inputs import MultiModalFeatureSpec
from paged.scheduler.pooling_params import PoolingParams
from paged.scheduler.sampling_params import SamplingParams

# Block ids per KV cache group: one list per group, in group order.
BlockIdsPerGroup = tuple[list[int], ...]


class FinishReason(enum.IntEnum):
    """Why a request finished, as reported to the frontend."""

    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client or the engine
    ERROR = 3  # failed inside the engine (e.g. NaN logits, KV load error)

    def __str__(self) -> str:
        return self.name.lower()


class KVTransferParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Per-request instructions for a KV connector (prefill/decode disaggregation).

    `do_remote_decode`: this instance prefills and keeps the blocks for a
    remote decoder to pull. `do_remote_prefill`: this instance decodes and
    first loads KV computed elsewhere (`remote_*` say from where).
    `extra`: every other key of the request's object, kept as sent (vLLM's
    `kv_transfer_params` is an open dict: connectors and routers add their own
    keys, e.g. NIXL's `tp_size`), so a connector of its own can read them.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    extra: dict[str, Any] | None = None


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A validated, tokenized request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    mm_features: list[MultiModalFeatureSpec] | None = None
    lora_request: str | None = None  # LoRA adapter name; enters every block hash
    cache_salt: str | None = None  # enters the first block's hash only
    priority: int = 0  # lower value = scheduled earlier (priority policy)
    client_index: int = 0  # which frontend client gets the outputs
    kv_transfer_params: KVTransferParams | None = None
    # Trailing and optional, so messages from senders without it still decode.
    lora_path: str | None = None  # the adapter's weights; keyed with lora_request
    # vLLM 0.33's per-request `ec_transfer_params`: {mm_hash: {"peer_host", "peer_port",
    # ...}} naming the EPD producer that holds each item's encoder output (an open
    # dict, as the client or proxy sent it; the EC connector reads what it knows).
    ec_transfer_params: dict[str, Any] | None = None
    # A pooling request (embed/classify/...): it finishes after its prefill and
    # its `sampling_params` are not used (vLLM sets them None; here they stay a
    # default instance so every generation path keeps its non-optional type).
    pooling_params: PoolingParams | None = None


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A request scheduled for the first time: all its data.

    A request resumed after preemption is NOT sent again as new data: it comes in
    `CachedRequestData` with `resumed_from_preemption=True`, its whole block table
    in `new_block_ids` and all its output tokens in `new_token_ids`.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: BlockIdsPerGroup
    num_computed_tokens: int
    mm_features: list[MultiModalFeatureSpec] | None = None
    lora_request: str | None = None
    # Set for pooling requests: the runner keeps their hidden states and pools them.
    pooling_params: PoolingParams | None = None
    # Where `lora_request`'s weights are (a PEFT directory or a GGUF LoRA file):
    # the runner reloads an adapter it evicted from host memory from here.
    lora_path: str | None = None


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Deltas for requests the runner already holds, as parallel lists indexed by position.

    `new_token_ids[i]` is only filled when the runner cannot know the tokens
    itself (e.g. pipeline parallel or a request resumed from preemption);
    otherwise the runner appends its own sampled tokens. `new_block_ids[i]` is
    `None` when no block was added. For a resumed request, `new_block_ids[i]`
    replaces the runner's block table instead of extending it.
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    resumed_from_preemption: list[bool] = msgspec.field(default_factory=list)
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    new_block_ids: list[BlockIdsPerGroup | None] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    num_output_tokens: list[int] = msgspec.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What the runner must do this step.

    `num_scheduled_tokens[req_id]` tokens are computed for each scheduled
    request (prefill chunk or decode, the unified compute model).
    `scheduled_encoder_inputs[req_id]` lists indices into the request's
    `mm_features` whose encoder runs this step. Connector metadata is opaque
    bytes built by a connector's scheduler side and decoded by its worker side.
    """

    scheduled_new_reqs: list[NewRequestData] = msgspec.field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = msgspec.field(default_factory=dict)
    num_common_prefix_blocks: list[int] = msgspec.field(default_factory=list)
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    free_encoder_mm_hashes: list[str] = msgspec.field(default_factory=list)
    kv_connector_metadata: bytes | None = None
    ec_connector_metadata: bytes | None = None


class GrammarOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Grammar masks for one step, computed between `execute_model()` and `sample_tokens()`.

    Row i of `grammar_bitmask` is a packed allow-mask over the vocabulary:
    bit j of word w allows token `32 * w + j` (words are signed 32-bit ints,
    the layout xgrammar uses). Rows follow `structured_output_request_ids`,
    one row per position sampled for that request (drafts + bonus with
    speculative decoding, so an id may repeat).
    """

    structured_output_request_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: list[list[int]] = msgspec.field(default_factory=list)


class LogprobsLists(msgspec.Struct, array_like=True, frozen=True):
    """Logprobs for a run of positions, as plain lists.

    Row i belongs to position i. Column 0 is the chosen (sampled or prompt)
    token, columns 1.. are the top-k alternatives in descending order.
    `ranks[i]` is the chosen token's rank in the full distribution (1 = best).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What a worker-side KV connector reports back after a step."""

    finished_sending: list[str] = msgspec.field(default_factory=list)
    finished_recving: list[str] = msgspec.field(default_factory=list)
    invalid_block_ids: list[int] = msgspec.field(default_factory=list)
    # Connector counters since the last step, flat "name" -> increment (vLLM's
    # kv_connector_stats); the scheduler adds them into `SchedulerStats`.
    kv_connector_stats: dict[str, float] = msgspec.field(default_factory=dict)


class ECConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Base of what an encoder-cache connector's scheduler side tells its worker side per step.

    Each connector subclasses it with its own fields (e.g. the mm hashes to
    load). The scheduler msgpack-encodes the instance `build_connector_meta`
    returns into `SchedulerOutput.ec_connector_metadata`; the worker side
    decodes those bytes with its own subclass (it knows its type, the wire
    does not carry it).
    """


class ECConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What a worker-side encoder-cache connector reports back after a step (vLLM gap 1).

    Every entry is an mm hash (the encoder item's identifier), not a request
    id: one item is loaded once for every request that shares it.
    finished_sending: saves/sends that completed (the producer may release them).
    finished_recving: asynchronous loads whose embeddings are now in the
        worker's encoder cache (the scheduler may schedule the item's tokens).
    failed_recving: loads that failed (missing, corrupt, peer gone); the
        scheduler encodes the item locally or fails its requests, by config.
    """

    finished_sending: list[str] = msgspec.field(default_factory=list)
    finished_recving: list[str] = msgspec.field(default_factory=list)
    failed_recving: list[str] = msgspec.field(default_factory=list)


class PoolerOutput(msgspec.Struct, array_like=True, frozen=True):
    """One request's pooled result as float32 bytes (msgspec cannot carry tensors).

    `data`: little-endian float32, C order; `shape`: e.g. [hidden] for embed,
    [num_labels] for classify, [n_tokens, hidden] for token_embed.
    """

    data: bytes
    shape: list[int]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """The runner's answer to one `SchedulerOutput`; plain lists, never tensors.

    `sampled_token_ids[i]` belongs to `req_ids[i]`: empty for a partial prefill
    chunk (nothing sampled), one token for a normal step, several with
    speculative decoding (accepted drafts plus the bonus token).
    `logprobs[req_id]` covers the sampled tokens; `prompt_logprobs[req_id]`
    covers the prompt positions computed this step.
    `num_nans_in_logits[req_id] > 0` reports NaN logits (the request fails).
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    sampled_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    num_nans_in_logits: dict[str, int] = msgspec.field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    # Speculative decoding: drafts to verify next step (Scheduler.update_draft_token_ids).
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Encoder-cache connector report (finished async loads/saves); trailing, optional.
    ec_connector_output: ECConnectorOutput | None = None
    # Pooling requests whose last prefill chunk ran this step (vLLM's pooler_output).
    pooler_output: dict[str, PoolerOutput] = msgspec.field(default_factory=dict)


class PrefixCacheStats(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Prefix-cache lookups since the last report, in tokens."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheEvictionEvent(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Residency of one sampled KV block, reported when it is reused (vLLM's stats struct).

    Only with a `KVCacheMetricsCollector` (vLLM's --kv-cache-metrics).
    """

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...] = ()


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Speculative-decoding counters since the last report (vLLM's SpecDecodingStats).

    A draft is one request's drafted tokens verified in one step;
    `num_accepted_tokens_per_pos[j]` counts drafts whose position j was accepted.
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A snapshot of the scheduler, attached to each `EngineCoreOutputs`."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    num_preempted_reqs: int = 0  # preemptions since the last report
    num_scheduled_tokens: int = 0
    # Sampled block evictions since the last report (empty without --kv-cache-metrics).
    kv_cache_eviction_events: list[KVCacheEvictionEvent] = msgspec.field(default_factory=list)
    # KV connector counters since the last report (worker and scheduler sides summed).
    kv_connector_stats: dict[str, float] = msgspec.field(default_factory=dict)
    # Drafted / accepted tokens since the last report (None: no speculative decoding).
    spec_decoding_stats: SpecDecodingStats | None = None
    # Multimodal items since the last report: sent to this engine's vision encoder,
    # and loaded through its EC connector instead (EPD: a consumer computes none).
    num_encoder_items_computed: int = 0
    num_encoder_items_loaded: int = 0
    # Encoder outputs an EC producer released (ECConnectorOutput.finished_sending).
    num_encoder_items_released: int = 0
    # Requests per LoRA adapter name, running and waiting (vLLM's SchedulerStats
    # fields, feeding the vllm:lora_requests_info gauge); empty without adapters.
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """New results for one request in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    # The stop token id or stop string that finished the request, if any.
    stop_reason: int | str | None = None
    # Human-readable detail for ABORT/ERROR finishes (e.g. "prompt too long").
    finish_detail: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    num_cached_tokens: int = 0
    # What the EC connector's `request_finished` returned (vLLM's ec_transfer_params).
    ec_transfer_params: dict[str, Any] | None = None
    # A finished pooling request's result (vLLM's EngineCoreOutput.pooling_output).
    pooling_output: PoolerOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One batch of outputs for one frontend client."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    engine_index: int = 0
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    finished_requests: list[str] | None = None

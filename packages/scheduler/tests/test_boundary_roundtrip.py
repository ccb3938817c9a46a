"""Every boundary struct survives msgpack (and JSON) unchanged."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.scheduler.boundary import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GrammarOutput,
    KVConnectorOutput,
    KVTransferParams,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PrefixCacheStats,
    SchedulerOutput,
    SchedulerStats,
)
from paged.scheduler.sampling_params import RequestOutputKind, SamplingParams

PARAMS = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=3,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    logit_bias={5: -1.0, 7: 2.5},
    max_tokens=32,
    min_tokens=2,
    stop=["\n\n"],
    stop_token_ids=[11, 12],
    ignore_eos=True,
    logprobs=3,
    prompt_logprobs=0,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
    output_kind=RequestOutputKind.DELTA,
)
FEATURE = MultiModalFeatureSpec(
    modality="image",
    identifier="abc",
    mm_position=PlaceholderRange(2, 3, is_embed=[True, False, True]),
    data={"pixel_values": TensorData("float32", [1, 2], b"\x00" * 8)},
)
LOGPROBS = LogprobsLists(
    token_ids=[[1, 2], [3, 4]], logprobs=[[-0.1, -2.0], [-0.3, -1.5]], ranks=[1, 2]
)
KVP = KVTransferParams(
    do_remote_prefill=True,
    remote_engine_id="e",
    remote_request_id="r",
    remote_block_ids=[1, 2],
    remote_host="h",
    remote_port=5,
    remote_num_tokens=30,
)

SAMPLES: list[Any] = [
    PARAMS,
    SamplingParams(),
    KVP,
    EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling_params=PARAMS,
        eos_token_id=2,
        arrival_time=1.5,
        mm_features=[FEATURE],
        lora_request="lora-a",
        cache_salt="salt",
        priority=-3,
        client_index=2,
        kv_transfer_params=KVP,
        lora_path="/adapters/lora-a",
    ),
    NewRequestData(
        req_id="r1",
        prompt_token_ids=[1, 2],
        sampling_params=PARAMS,
        block_ids=([1, 2], [3]),
        num_computed_tokens=16,
        mm_features=[FEATURE],
        lora_request="x",
    ),
    CachedRequestData(
        req_ids=["a", "b"],
        resumed_from_preemption=[False, True],
        new_token_ids=[[], [5, 6]],
        new_block_ids=[None, ([4, 5],)],
        num_computed_tokens=[10, 0],
        num_output_tokens=[3, 2],
    ),
    SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["a"],
            resumed_from_preemption=[False],
            new_token_ids=[[]],
            new_block_ids=[None],
            num_computed_tokens=[4],
            num_output_tokens=[1],
        ),
        num_scheduled_tokens={"a": 1},
        total_num_scheduled_tokens=1,
        scheduled_spec_decode_tokens={"a": [3, 4]},
        scheduled_encoder_inputs={"a": [0]},
        num_common_prefix_blocks=[2],
        finished_req_ids=["z"],
        preempted_req_ids=["y"],
        free_encoder_mm_hashes=["abc"],
        kv_connector_metadata=b"\x01\x02",
        ec_connector_metadata=b"\x03",
    ),
    GrammarOutput(structured_output_request_ids=["a", "a"], grammar_bitmask=[[-1, 0], [5, 7]]),
    LOGPROBS,
    KVConnectorOutput(finished_sending=["a"], finished_recving=["b"], invalid_block_ids=[3]),
    ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[[1], []],
        logprobs={"a": LOGPROBS},
        prompt_logprobs={"b": LOGPROBS},
        num_nans_in_logits={"a": 0},
        kv_connector_output=KVConnectorOutput(finished_sending=["x"]),
    ),
    PrefixCacheStats(reset=True, requests=2, queries=64, hits=32),
    SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_stats=PrefixCacheStats(requests=1, queries=16, hits=0),
        num_preempted_reqs=2,
        num_scheduled_tokens=17,
    ),
    EngineCoreOutput(
        request_id="a",
        new_token_ids=[4],
        new_logprobs=LOGPROBS,
        new_prompt_logprobs=LOGPROBS,
        finish_reason=FinishReason.STOP,
        stop_reason=11,
        finish_detail="why",
        kv_transfer_params=KVP,
        num_cached_tokens=16,
    ),
    EngineCoreOutput(request_id="b", new_token_ids=[], stop_reason="\n"),
    EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id="a", new_token_ids=[1])],
        engine_index=1,
        scheduler_stats=SchedulerStats(num_running_reqs=1),
        timestamp=3.25,
        finished_requests=["q"],
    ),
    EngineCoreOutputs(),
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_msgpack_round_trip(obj: Any) -> None:
    data = msgspec.msgpack.encode(obj)
    back = msgspec.msgpack.decode(data, type=type(obj))
    assert back == obj


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_json_round_trip(obj: Any) -> None:
    back = msgspec.json.decode(msgspec.json.encode(obj), type=type(obj))
    assert back == obj


def test_finish_reason_str_and_finished_flag() -> None:
    assert str(FinishReason.LENGTH) == "length"
    assert EngineCoreOutput(
        request_id="r", new_token_ids=[], finish_reason=FinishReason.ABORT
    ).finished
    assert not EngineCoreOutput(request_id="r", new_token_ids=[1]).finished


def test_engine_core_output_field_order_is_what_update_builds_positionally() -> None:
    # update.update_requests builds EngineCoreOutput positionally (the hot path); a
    # reordered or inserted field must fail here, not mislabel every output.
    assert EngineCoreOutput.__struct_fields__ == (
        "request_id",
        "new_token_ids",
        "new_logprobs",
        "new_prompt_logprobs",
        "finish_reason",
        "stop_reason",
        "finish_detail",
        "kv_transfer_params",
        "num_cached_tokens",
        "ec_transfer_params",
        "pooling_output",
    )

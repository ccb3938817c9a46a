"""Request lifecycle sets, incremental hashing, and every stop condition."""

from __future__ import annotations

import pytest

from paged.kvcache.hashing import get_request_block_hasher, init_none_hash, sha256
from paged.kvcache.ids import BlockHash
from paged.scheduler.boundary import FinishReason
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.request import (
    FINISHED_STATUSES,
    WAITING_STATUSES,
    Request,
    RequestStatus,
    finish_reason_of,
    is_finished_status,
)
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.stop import check_stop


def make(params: SamplingParams, prompt: list[int] | None = None, eos: int | None = 2) -> Request:
    return Request("r", prompt or [5, 6, 7], params, eos, max_model_len=100)


def test_status_sets_are_explicit_and_disjoint() -> None:
    assert RequestStatus.RUNNING not in FINISHED_STATUSES | WAITING_STATUSES
    assert not FINISHED_STATUSES & WAITING_STATUSES
    assert set(RequestStatus) == FINISHED_STATUSES | WAITING_STATUSES | {RequestStatus.RUNNING}
    for status in RequestStatus:
        assert is_finished_status(status) == (finish_reason_of(status) is not None)
    assert finish_reason_of(RequestStatus.FINISHED_IGNORED) is FinishReason.LENGTH
    assert finish_reason_of(RequestStatus.FINISHED_ERROR) is FinishReason.ERROR
    assert finish_reason_of(RequestStatus.FINISHED_ABORTED) is FinishReason.ABORT


def test_decode_appends_hash_exactly_the_blocks_a_fresh_request_would() -> None:
    # Appends that cannot complete a block skip the hasher call (it publishes its
    # block size); the chain must still equal hashing the whole sequence at once.
    init_none_hash(sha256, 0)
    hasher = get_request_block_hasher(4, sha256)
    r = Request("r", [1, 2, 3], SamplingParams(), None, max_model_len=64, block_hasher=hasher)
    for token in range(10, 24):
        r.append_output_token_ids(token)
        fresh = Request(
            "f", list(r.all_token_ids), SamplingParams(), None, max_model_len=64,
            block_hasher=hasher,
        )  # fmt: skip
        assert r.block_hashes == fresh.block_hashes
    assert len(r.block_hashes) == 17 // 4


def test_a_hasher_without_block_size_is_called_on_every_append() -> None:
    calls: list[int] = []

    def plain_hasher(request: Request) -> list[BlockHash]:
        calls.append(request.num_tokens)
        return []

    r = Request("r", [1, 2], SamplingParams(), None, max_model_len=64, block_hasher=plain_hasher)
    r.append_output_token_ids(3)
    r.append_output_token_ids([4, 5])
    assert calls == [2, 3, 5]


def test_block_hashes_grow_incrementally() -> None:
    init_none_hash(sha256, 0)
    hasher = get_request_block_hasher(4, sha256)
    r = Request("r", list(range(6)), SamplingParams(), None, max_model_len=64, block_hasher=hasher)
    assert len(r.block_hashes) == 1  # one full block of 4
    first = r.block_hashes[0]
    r.append_output_token_ids(100)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([101, 102])
    assert len(r.block_hashes) == 2 and r.block_hashes[0] == first
    # The same 8 tokens hashed from scratch give the same chain.
    r2 = Request(
        "r2", [*range(6), 100, 101], SamplingParams(), None, max_model_len=64, block_hasher=hasher
    )
    assert r2.block_hashes == r.block_hashes[:2]
    assert (
        r.num_tokens == 9
        and r.num_output_tokens == 3
        and list(r.output_token_ids) == [100, 101, 102]
    )


def test_max_tokens_none_means_rest_of_model_len() -> None:
    r = Request("r", [1] * 30, SamplingParams(max_tokens=None), None, max_model_len=100)
    assert r.max_tokens == 70


def test_eos_stops_and_is_kept() -> None:
    r = make(SamplingParams(max_tokens=10))
    r.append_output_token_ids(2)
    assert check_stop(r, 100)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert list(r.output_token_ids) == [2]


def test_ignore_eos_skips_eos_but_not_stop_token_ids() -> None:
    r = make(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[9]))
    r.append_output_token_ids(2)
    assert not check_stop(r, 100)
    r.append_output_token_ids(9)
    assert check_stop(r, 100)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_min_tokens_suppresses_stops_but_not_length() -> None:
    r = make(SamplingParams(max_tokens=3, min_tokens=3, stop_token_ids=[9]))
    r.append_output_token_ids(2)
    assert not check_stop(r, 100)
    r.append_output_token_ids(9)
    assert not check_stop(r, 100)
    r.append_output_token_ids(9)
    assert check_stop(r, 100)
    assert r.status is RequestStatus.FINISHED_STOPPED  # third token may stop
    # max_model_len caps even below min_tokens
    r2 = make(SamplingParams(max_tokens=50, min_tokens=40), prompt=[1, 1, 1])
    r2.append_output_token_ids(2)
    assert check_stop(r2, 4)
    assert r2.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_tokens_length_cap() -> None:
    r = make(SamplingParams(max_tokens=2))
    r.append_output_token_ids(7)
    assert not check_stop(r, 100)
    r.append_output_token_ids(8)
    assert check_stop(r, 100)
    assert r.get_finished_reason() is FinishReason.LENGTH


def test_stop_token_beats_length_on_the_same_token() -> None:
    r = make(SamplingParams(max_tokens=1, stop_token_ids=[9]))
    r.append_output_token_ids(9)
    assert check_stop(r, 100)
    assert r.get_finished_reason() is FinishReason.STOP


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": 8, "max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 8, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 8, "long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"max_model_len": 8, "policy": "lifo"}, "policy"),
        ({"max_model_len": 8, "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({"max_model_len": 8, "encoder_cache_size": -1}, "encoder_cache_size"),
        ({"max_model_len": 4096, "enable_chunked_prefill": False}, "max_num_batched_tokens"),
    ],
)
def test_scheduler_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_scheduler_config_budget_below_max_num_seqs_rejected_with_vllms_message() -> None:
    # vLLM's SchedulerConfig.verify_max_model_len, word for word.
    with pytest.raises(ValueError) as e:
        SchedulerConfig(max_model_len=64, max_num_seqs=300, max_num_batched_tokens=256)
    assert str(e.value) == (
        "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (300)."
    )
    SchedulerConfig(max_model_len=64, max_num_seqs=256, max_num_batched_tokens=256)  # equal: ok


def test_scheduler_config_chunked_prefill_off_message_is_vllms() -> None:
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens \(2048\) is smaller than "
                       r"max_model_len \(4096\)\. This effectively limits"):  # fmt: skip
        SchedulerConfig(max_model_len=4096, enable_chunked_prefill=False)


def test_scheduler_config_long_prefill_threshold_above_max_model_len_rejected_as_vllm() -> None:
    # Current vLLM's _verify_args: unconditional, with this message.
    with pytest.raises(
        ValueError,
        match=r"^long_prefill_token_threshold \(100\) cannot be greater than the "
        r"max_model_len \(64\)\.$",
    ):
        SchedulerConfig(max_model_len=64, max_num_seqs=8, long_prefill_token_threshold=100)
    # Equal is allowed, and 0 (off) always is.
    assert SchedulerConfig(max_model_len=64, long_prefill_token_threshold=64)
    assert SchedulerConfig(max_model_len=64, long_prefill_token_threshold=0)


def test_scheduler_config_warns_when_budget_exceeds_seqs_times_len(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="paged.scheduler.config"):
        SchedulerConfig(max_model_len=8, max_num_seqs=2, max_num_batched_tokens=17)
    assert "max_num_batched_tokens (17) exceeds max_num_seqs * max_model_len (16)" in caplog.text


def test_scheduler_config_encoder_defaults() -> None:
    c = SchedulerConfig(max_model_len=64, max_num_batched_tokens=512)
    assert c.resolved_encoder_cache_size == 512
    assert c.resolved_max_num_encoder_input_tokens == 512
    c2 = SchedulerConfig(max_model_len=64, encoder_cache_size=7, max_num_encoder_input_tokens=3)
    assert (c2.resolved_encoder_cache_size, c2.resolved_max_num_encoder_input_tokens) == (7, 3)

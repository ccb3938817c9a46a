"""PoolingParams: vLLM 0.33's defaults, validation messages and wire round trip."""

from __future__ import annotations

import msgspec
import pytest

from paged.scheduler import PoolingModelInfo, PoolingParams
from paged.scheduler.sampling_params import RequestOutputKind

_MODEL = PoolingModelInfo(served_model_name="m", embedding_size=8)


def test_embed_defaults_activation_on_and_prefix_cache_readable() -> None:
    params = PoolingParams().with_task("embed").verify(_MODEL)
    assert params.use_activation is True
    assert params.skip_reading_prefix_cache is False


def test_token_tasks_skip_reading_prefix_cache() -> None:
    params = PoolingParams(task="token_embed").verify(_MODEL)
    assert params.skip_reading_prefix_cache is True


def test_pooler_config_default_merged_but_request_wins() -> None:
    model = PoolingModelInfo(served_model_name="m", embedding_size=8, default_use_activation=False)
    assert PoolingParams(task="embed").verify(model).use_activation is False
    assert PoolingParams(task="embed", use_activation=True).verify(model).use_activation is True


def test_dimensions_rejected_without_matryoshka() -> None:
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        PoolingParams(task="embed", dimensions=4).verify(_MODEL)


def test_dimensions_range_and_list() -> None:
    model = PoolingModelInfo(
        served_model_name="m", embedding_size=8, is_matryoshka=True, matryoshka_dimensions=(4, 8)
    )
    assert PoolingParams(task="embed", dimensions=4).verify(model).dimensions == 4
    with pytest.raises(ValueError, match=r"range \[1, 8\], got 9"):
        PoolingParams(task="embed", dimensions=9).verify(model)
    with pytest.raises(ValueError, match=r"Matryoshka dimensions \[4, 8\], got 3"):
        PoolingParams(task="embed", dimensions=3).verify(model)


def test_dimensions_not_valid_for_classify() -> None:
    with pytest.raises(ValueError, match="does not support \\['dimensions'\\]"):
        PoolingParams(task="classify", dimensions=4).verify(_MODEL)


def test_step_fields_need_step_pooling() -> None:
    with pytest.raises(ValueError, match="step_tag_id"):
        PoolingParams(task="token_classify", step_tag_id=3).verify(_MODEL)
    step = PoolingModelInfo(
        served_model_name="m", embedding_size=8, tok_pooling_type="STEP", default_step_tag_id=7
    )
    assert PoolingParams(task="token_classify").verify(step).step_tag_id == 7


def test_removed_and_unknown_tasks() -> None:
    with pytest.raises(ValueError, match="`score` task was removed"):
        PoolingParams(task="score")
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="bogus")
    with pytest.raises(ValueError, match="task must be set"):
        PoolingParams().verify(_MODEL)


def test_output_kind_must_be_final_only() -> None:
    with pytest.raises(ValueError, match="FINAL_ONLY"):
        PoolingParams(output_kind=RequestOutputKind.DELTA)


def test_msgpack_round_trip() -> None:
    params = PoolingParams(task="embed", dimensions=4, use_activation=False)
    data = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(data, type=PoolingParams) == params

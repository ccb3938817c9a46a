"""Loading a quantized GGUF logs one INFO line, not one per tensor kind."""

from __future__ import annotations

import logging

import pytest

from paged.runner.loader.quantized import QuantizedKind, log_quantized_summary

ROWS = [
    QuantizedKind("model.layers.*.self_attn.q_proj", "Q4_1", "qgemm-int4", 30, 1e-3, 5 << 20),
    QuantizedKind("model.layers.*.mlp.down_proj", "Q4_1", "qgemm-int4", 30, 2e-3, 9 << 20),
    QuantizedKind("model.layers.*.mlp.up_proj", "Q6_K", "qgemm-int8", 30, 5e-4, 9 << 20),
    QuantizedKind("model.embed_tokens", "Q8_0", "int4-table", 1, 4e-4, 27 << 20),
]


def test_one_info_line_for_the_model(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="paged.runner.loader.quantized"):
        log_quantized_summary(ROWS)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "91 tensors" in message and "50.0 MiB" in message and "2.00e-03" in message
    assert "(from Q4_1, Q6_K, Q8_0)" in message


def test_each_kind_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="paged.runner.loader.quantized"):
        log_quantized_summary(ROWS)
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert [r.getMessage().split(":")[1].split(" x")[0].strip() for r in debug] == [
        row.kind for row in ROWS
    ]

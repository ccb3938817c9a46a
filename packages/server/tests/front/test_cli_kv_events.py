"""`--kv-events-config`: vLLM's JSON reaches EngineArgs; a bad one is one clear error."""

from __future__ import annotations

import pytest

from paged.connectors.events import KVEventsConfig
from paged.server.cli import build_parser, engine_args_from


def test_kv_events_config_reaches_engine_args() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6001",'
            ' "replay_endpoint": "tcp://*:6002", "topic": "kv-events", "buffer_steps": 64}',
        ]
    )
    cfg = engine_args_from(ns).kv_events_config
    assert cfg == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:6001",
        replay_endpoint="tcp://*:6002",
        topic="kv-events",
        buffer_steps=64,
    )
    assert engine_args_from(build_parser().parse_args(["serve"])).kv_events_config is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"enable_kv_cache_events": tru}', "not valid JSON"),
        ('{"enable_kv_cache_events": true, "hwm": "lots"}', "$.hwm"),
        ('{"replay_endpoint": "localhost", "enable_kv_cache_events": true}', "replay_endpoint"),
        ('{"topics": "x"}', "unknown field `topics`"),
    ],
)
def test_bad_kv_events_config_is_one_clear_error(
    text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--kv-events-config", text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-events-config" in err and needle in err
    assert "Traceback" not in err

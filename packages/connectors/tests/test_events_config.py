"""`--kv-events-config` parsing: vLLM's fields and defaults, one clear error per mistake."""

import msgspec
import pytest

from paged.connectors.events import KVEventsConfig, KVEventsConfigError, parse_kv_events_config


def test_defaults_are_vllms() -> None:
    c = parse_kv_events_config("{}")
    assert msgspec.structs.asdict(c) == {
        "enable_kv_cache_events": False,
        "publisher": "null",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": None,
        "buffer_steps": 10_000,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": "",
        "wire_format": "vllm",  # paged's own field: vLLM 0.33.0's layout
    }
    assert not c.publishes


def test_publisher_defaults_to_zmq_when_enabled() -> None:
    c = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert c.publisher == "zmq" and c.topic == "kv-events" and c.publishes
    explicit = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert explicit.publisher == "null" and not explicit.publishes
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"


def test_every_field_is_read() -> None:
    c = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/a",'
        ' "replay_endpoint": "tcp://*:6000", "buffer_steps": 3, "hwm": 7,'
        ' "max_queue_size": 9, "topic": "t", "wire_format": "array"}'
    )
    assert (c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size) == (
        "ipc:///tmp/a",
        "tcp://*:6000",
        3,
        7,
        9,
    )
    assert (c.topic, c.wire_format) == ("t", "array")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"enable_kv_cache_events": true, "hwm": "many"}', "$.hwm"),
        ('{"enable_kv_cache_event": true}', "unknown field `enable_kv_cache_event`"),
        ('{"publisher": "kafka"}', "$.publisher"),
        ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
        ('{"max_queue_size": -1}', "max_queue_size must be >= 1"),
        ('{"hwm": -5}', "hwm must be >= 0"),
        ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint must be"),
        ('{"enable_kv_cache_events": true,', "not valid JSON"),
        ("[1]", "Expected `object`"),
        ('{"wire_format": "msgpack"}', "$.wire_format"),
        ('{"wire_format": 1}', "$.wire_format"),
    ],
)
def test_bad_config_names_the_problem(text: str, needle: str) -> None:
    with pytest.raises(KVEventsConfigError, match="KV events config") as info:
        parse_kv_events_config(text)
    assert needle in str(info.value)


def test_wire_format_is_checked_when_built_in_code() -> None:
    """msgspec validates only what it decodes; the struct checks the rest itself."""
    with pytest.raises(
        KVEventsConfigError, match="wire_format must be one of 'vllm', 'map', 'array'"
    ):
        KVEventsConfig(wire_format="xml")  # type: ignore[arg-type]

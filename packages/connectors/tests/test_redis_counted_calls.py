"""`CountedRedis`: the one guarded call of the Redis tier, its faults counted by role.

No server: the URL names a port nobody listens on, so every call is a
fault of a known reason (refused: "down", then "backoff" while backing off).
"""

from __future__ import annotations

import socket

import pytest

from paged.connectors.kv.offloading.redis_client import RedisFault, parse_redis_tier
from paged.connectors.kv.offloading.redis_tier import CountedRedis, FaultCounters


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: connections are refused


def _counted(role: str, counters: FaultCounters) -> CountedRedis:
    config = parse_redis_tier(
        {"type": "redis", "url": f"redis://127.0.0.1:{_closed_port()}", "backoff_max_s": 60}
    )
    return CountedRedis(config, role, 0.5, counters)


def test_a_fault_is_counted_under_the_role_and_raised() -> None:
    counters = FaultCounters()
    read = _counted("read", counters)
    try:
        with pytest.raises(RedisFault) as fault:
            read.call(lambda c: c.get("k"))
        assert fault.value.reason == "down"
        with pytest.raises(RedisFault) as again:  # the server was down: backing off
            read.call(lambda c: c.get("k"))
        assert again.value.reason == "backoff"
        read.count("miss")  # an outcome that is no fault of the call
    finally:
        read.close()
    assert counters.take() == {"redis.read_down": 1, "redis.read_backoff": 1, "redis.read_miss": 1}


def test_roles_sharing_counters_keep_their_own_names() -> None:
    counters = FaultCounters()
    read, write = _counted("read", counters), _counted("write", counters)
    try:
        for role in (read, write):
            with pytest.raises(RedisFault):
                role.call(lambda c: c.set("k", b"v"))
    finally:
        read.close()
        write.close()
    assert counters.take() == {"redis.read_down": 1, "redis.write_down": 1}

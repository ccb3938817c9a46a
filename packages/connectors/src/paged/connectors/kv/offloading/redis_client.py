"""The Redis tier's settings and its guarded connection: deadlines, fault reasons, backoff.

A secondary tier `{"type": "redis", "url": "redis://HOST:PORT", ...}` of the
OffloadingConnector (paged's addition: vLLM 0.33 has no Redis tier; LMCache's
`remote_url: redis://...` is the counterpart). Every call to Redis goes
through `GuardedRedis`, which turns each failure into one `RedisFault` with a
reason the counters name, and backs off after the server was down or slow:

    ok ── down/timeout ──> backoff (calls skipped, reason "backoff")
     ^                        │ after 0.1 s, 0.2 s, ... up to backoff_max_s
     └──── success ───────────┘ (the next call tries the server again)

The `redis` client (the `redis` extra of paged-connectors) is imported only
when a Redis tier is configured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

if TYPE_CHECKING:
    import redis

T = TypeVar("T")

_KEYS = frozenset(
    {
        "type",
        "url",
        "namespace",
        "read_timeout_s",
        "write_timeout_s",
        "connect_timeout_s",
        "max_pending_writes",
        "ttl_s",
        "backoff_max_s",
        "enable_kv_events",
    }
)
_SCHEMES = ("redis", "rediss", "unix")
_BACKOFF_FIRST_S = 0.1


@dataclass(frozen=True)
class RedisTierConfig:
    """One `{"type": "redis", ...}` secondary tier (see docs/redis-tier.md)."""

    url: str
    namespace: str = "paged"
    read_timeout_s: float = 0.5  # lookups and loads: past it, the request recomputes
    write_timeout_s: float = 2.0  # the background writer's deadline per chunk
    connect_timeout_s: float = 0.5
    max_pending_writes: int = 32  # chunks queued for the writer; more are dropped
    ttl_s: int = 0  # 0: keys never expire (Redis's own maxmemory policy evicts)
    backoff_max_s: float = 5.0
    enable_kv_events: bool = False  # as vLLM's secondary tiers (fs, obj): off by default


def parse_redis_tier(tier: Mapping[str, Any]) -> RedisTierConfig:
    """Validate one redis tier object; `ValueError` naming the key."""
    unknown = sorted(set(tier) - _KEYS)
    if unknown:
        raise ValueError(
            f"OffloadingConnector: redis tier keys {unknown} are not supported "
            f"(paged takes {sorted(_KEYS)})"
        )
    url = tier.get("url")
    if not isinstance(url, str) or urlparse(url).scheme not in _SCHEMES:
        raise ValueError(
            'OffloadingConnector: the redis tier needs url, e.g. "redis://HOST:PORT" '
            f"(schemes {list(_SCHEMES)}); got {url!r}"
        )
    namespace = tier.get("namespace", "paged")
    if not isinstance(namespace, str) or not namespace or any(c.isspace() for c in namespace):
        raise ValueError(
            f"OffloadingConnector: redis tier namespace must be a non-empty word, got {namespace!r}"
        )
    events = tier.get("enable_kv_events", False)
    if not isinstance(events, bool):
        raise ValueError("OffloadingConnector: redis tier enable_kv_events must be true or false")
    return RedisTierConfig(
        url=url,
        namespace=namespace,
        read_timeout_s=_positive(tier, "read_timeout_s", 0.5),
        write_timeout_s=_positive(tier, "write_timeout_s", 2.0),
        connect_timeout_s=_positive(tier, "connect_timeout_s", 0.5),
        max_pending_writes=int(_positive(tier, "max_pending_writes", 32, integer=True)),
        ttl_s=int(_positive(tier, "ttl_s", 0, integer=True, zero_ok=True)),
        backoff_max_s=_positive(tier, "backoff_max_s", 5.0),
        enable_kv_events=events,
    )


def _positive(
    tier: Mapping[str, Any],
    key: str,
    default: float,
    *,
    integer: bool = False,
    zero_ok: bool = False,
) -> float:
    value = tier.get(key, default)
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if not bad:
        bad = value < 0 or (value == 0 and not zero_ok) or (integer and value != int(value))
    if bad:
        what = "an integer" if integer else "a number"
        limit = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"OffloadingConnector: redis tier {key} must be {what} {limit}")
    return float(value)


class RedisFault(Exception):
    """One failed Redis call; `reason` is the counter's name for it."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"redis {reason}: {detail}" if detail else f"redis {reason}")
        self.reason = reason


class Backoff:
    """When the next call may try the server after failures (exponential, capped)."""

    def __init__(self, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_s = max_s
        self._clock = clock
        self._delay = 0.0
        self._until = 0.0

    def ready(self) -> bool:
        return self._clock() >= self._until

    def failed(self) -> None:
        self._delay = min(max(self._delay * 2, _BACKOFF_FIRST_S), self.max_s)
        self._until = self._clock() + self._delay

    def succeeded(self) -> None:
        self._delay = 0.0
        self._until = 0.0


class GuardedRedis:
    """A Redis client whose every call has a deadline and fails as a `RedisFault`.

    One per role and thread group (scheduler lookups, worker reads, the
    writer thread), each with its own timeout; redis-py's own retries are off
    so a deadline is the deadline. Thread-safe (the client's pool is).
    """

    def __init__(self, config: RedisTierConfig, timeout_s: float) -> None:
        import redis as redis_lib  # the `redis` extra; only a Redis tier needs it
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = redis_lib.exceptions
        self.client: redis.Redis = redis_lib.Redis.from_url(
            config.url,
            socket_timeout=timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self.backoff = Backoff(config.backoff_max_s)
        self._lock = threading.Lock()

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        """`fn(client)`, or `RedisFault` (down, timeout, oom, garbage, error, backoff)."""
        with self._lock:
            if not self.backoff.ready():
                raise RedisFault("backoff")
        try:
            result = fn(self.client)
        except self._errors.TimeoutError as exc:
            self._failed()
            raise RedisFault("timeout", str(exc)) from exc
        except self._errors.ConnectionError as exc:  # refused, reset, closed mid-reply
            self._failed()
            raise RedisFault("down", str(exc)) from exc
        except self._errors.OutOfMemoryError as exc:  # maxmemory with noeviction
            raise RedisFault("oom", str(exc)) from exc
        except (self._errors.InvalidResponse, ValueError, TypeError) as exc:
            # Not Redis's protocol, or a reply of the wrong type: the peer is not a sane
            # Redis; back off as from a dead one.
            self._failed()
            raise RedisFault("garbage", str(exc)) from exc
        except self._errors.RedisError as exc:
            raise RedisFault("error", str(exc)) from exc
        with self._lock:
            self.backoff.succeeded()
        return result

    def _failed(self) -> None:
        with self._lock:
            self.backoff.failed()
        # Drop pooled sockets: a timed-out one still owes a reply.
        self.client.connection_pool.disconnect()

    def close(self) -> None:
        self.client.close()

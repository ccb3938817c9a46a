"""`OffloadingConfig`: the `kv_connector_extra_config` keys of `OffloadingConnector`.

    {"chunk_size": 256,                      tokens per chunk, a multiple of the block size
     "kv_bytes_per_rank": 4294967296,        host tier budget per rank (vLLM's key); 0 = off
     "disk_path": "/var/cache/paged-kv",     disk tier directory; absent = off
     "disk_bytes_per_rank": 68719476736}     disk tier budget per rank (payload bytes)

`--kv-offloading-size GiB --kv-offloading-backend native` sets
`kv_bytes_per_rank` to GiB * 2**30 / tensor_parallel_size, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CHUNK_SIZE = 256  # LMCache's default chunk, in tokens
DEFAULT_DISK_BYTES = 64 << 30

_KNOWN_KEYS = frozenset({"chunk_size", "kv_bytes_per_rank", "disk_path", "disk_bytes_per_rank"})


@dataclass(frozen=True)
class OffloadingConfig:
    chunk_size: int
    host_bytes: int
    disk_path: Path | None
    disk_bytes: int

    @property
    def has_host(self) -> bool:
        return self.host_bytes > 0

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None

    def rank_disk_path(self, rank: int, world_size: int) -> Path | None:
        """Where one rank's chunk files live: `disk_path`, or `disk_path/rank{r}` under TP.

        Each rank stores its own slice of the KV heads under the same keys, so
        ranks must not share a directory.
        """
        if self.disk_path is None or world_size == 1:
            return self.disk_path
        return self.disk_path / f"rank{rank}"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], block_size: int) -> OffloadingConfig:
        """Validate the extra config; `ValueError` naming the key."""
        unknown = sorted(set(extra) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"OffloadingConnector: unknown kv_connector_extra_config keys {unknown} "
                f"(known: {sorted(_KNOWN_KEYS)})"
            )
        chunk = _int(extra, "chunk_size", DEFAULT_CHUNK_SIZE)
        if chunk <= 0 or chunk % block_size:
            raise ValueError(
                f"OffloadingConnector: chunk_size {chunk} must be a positive multiple of "
                f"the block size {block_size}"
            )
        host = _int(extra, "kv_bytes_per_rank", 0)
        disk_bytes = _int(extra, "disk_bytes_per_rank", DEFAULT_DISK_BYTES)
        raw_path = extra.get("disk_path")
        if raw_path is not None and (not isinstance(raw_path, str) or not raw_path):
            raise ValueError(
                f"OffloadingConnector: disk_path must be a non-empty string, got {raw_path!r}"
            )
        if host < 0 or disk_bytes <= 0:
            raise ValueError(
                "OffloadingConnector: kv_bytes_per_rank must be >= 0 and disk_bytes_per_rank > 0"
            )
        disk_path = Path(raw_path) if raw_path is not None else None
        if host == 0 and disk_path is None:
            raise ValueError(
                "OffloadingConnector: no tier configured; set kv_bytes_per_rank (host memory) "
                "and/or disk_path"
            )
        return cls(chunk, host, disk_path, disk_bytes)


def _int(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    # vLLM computes kv_bytes_per_rank as a float (GiB * 2**30 / ranks).
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"OffloadingConnector: {key} must be a number, got {value!r}")
    return int(value)

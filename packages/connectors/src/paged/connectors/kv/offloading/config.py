"""`OffloadingConfig`: the `kv_connector_extra_config` keys of `OffloadingConnector`.

vLLM 0.33's keys (docs/features/kv_offloading_usage.md, v1/kv_offload/):

    {"spec_name": "TieringOffloadingSpec",   CPUOffloadingSpec (default) or TieringOffloadingSpec
     "cpu_bytes_to_use": 10737418240,        host tier, all ranks together (split per rank)
     "block_size": 256,                      tokens per chunk (or "blocks_per_chunk": 16)
     "eviction_policy": "lru",               host tier policy: lru or arc
     "store_threshold": 2,                   store a chunk once it was offered this many times
     "max_tracker_size": 64000,              chunks the store_threshold tracker remembers
     "offload_prompt_only": true,            false: decode chunks are offloaded too
     "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv"},   paged's disk tier
                         {"type": "redis", "url": "redis://HOST:PORT"}]}   paged's addition

paged's own keys stay accepted: `chunk_size` (= vLLM's `block_size`),
`kv_bytes_per_rank` (host bytes per rank), `disk_path` (= an fs tier's
`root_dir`), `disk_bytes_per_rank` (disk budget; vLLM's fs tier is unbounded),
`use_layerwise` (LMCache's name: loads and saves layer by layer, default
false) and `layerwise_load_timeout_s` (a layer-wise load's deadline, default
30; docs/layerwise.md).
Keys paged does not implement are refused by `check_extra_config`, which the
server calls while it parses `--kv-transfer-config` (before a model loads).
See packages/connectors/docs/offloading-config.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged.connectors.kv.offloading.redis_client import RedisTierConfig
from paged.connectors.kv.offloading.vllm_keys import (
    check_refused_keys,
    fs_tier_events,
    fs_tier_root_dir,
    number,
    redis_tier_config,
)

DEFAULT_CHUNK_SIZE = 256  # LMCache's default chunk, in tokens
DEFAULT_DISK_BYTES = 64 << 30
DEFAULT_LAYERWISE_TIMEOUT_S = 30.0
DEFAULT_MAX_TRACKER_SIZE = 64_000  # vLLM 0.33's default (v1/kv_offload/cpu/spec.py:163)


@dataclass(frozen=True)
class OffloadingConfig:
    chunk_size: int
    host_bytes: int  # per rank
    disk_path: Path | None
    disk_bytes: int
    # A new chunk is stored once offered this many times (< 2: always), as vLLM's
    # CPUOffloadingManager.prepare_store.
    store_threshold: int = 0
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    offload_prompt_only: bool = True
    # Whether the disk tier publishes KV events: always with paged's disk_path, and for
    # vLLM's fs tier only with its enable_kv_events (vLLM's default: false).
    disk_events: bool = True
    # The host tier's policy (vLLM's primary tier); the disk tier is always LRU.
    eviction_policy: str = "lru"
    # The shared tier below host and disk (redis_tier.py); None without one.
    redis: RedisTierConfig | None = None
    # Loads copied layer by layer during the forward, saves per layer (docs/layerwise.md).
    use_layerwise: bool = False
    layerwise_load_timeout_s: float = DEFAULT_LAYERWISE_TIMEOUT_S

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
    def from_extra_config(
        cls, extra: Mapping[str, Any], block_size: int, world_size: int = 1
    ) -> OffloadingConfig:
        """Validate the extra config; `ValueError` naming the key."""
        check_refused_keys(extra)
        chunk = _chunk_size(extra, block_size)
        host = _host_bytes_per_rank(extra, world_size)
        disk_bytes = int(number(extra, "disk_bytes_per_rank", DEFAULT_DISK_BYTES))
        disk_path = _disk_path(extra)
        if host < 0 or disk_bytes <= 0:
            raise ValueError(
                "OffloadingConnector: cpu_bytes_to_use / kv_bytes_per_rank must be >= 0 and "
                "disk_bytes_per_rank > 0"
            )
        redis = redis_tier_config(extra)
        if host == 0 and disk_path is None and redis is None:
            raise ValueError(
                "OffloadingConnector: no tier configured; set cpu_bytes_to_use (host memory) "
                'and/or secondary_tiers [{"type": "fs", "root_dir": ...}, '
                '{"type": "redis", "url": "redis://HOST:PORT"}]'
            )
        threshold = number(extra, "store_threshold", 0)
        tracker = number(extra, "max_tracker_size", DEFAULT_MAX_TRACKER_SIZE)
        if threshold < 0 or tracker <= 0:
            raise ValueError(
                "OffloadingConnector: store_threshold must be >= 0 and max_tracker_size > 0"
            )
        prompt_only = extra.get("offload_prompt_only", True)
        if not isinstance(prompt_only, bool):
            raise ValueError(
                f"OffloadingConnector: offload_prompt_only must be true or false, "
                f"got {prompt_only!r}"
            )
        use_layerwise, layer_timeout = _layerwise(extra)
        return cls(
            chunk,
            host,
            disk_path,
            disk_bytes,
            int(threshold),
            int(tracker),
            prompt_only,
            disk_events=fs_tier_events(extra),
            eviction_policy=str(extra.get("eviction_policy", "lru")),
            redis=redis,
            use_layerwise=use_layerwise,
            layerwise_load_timeout_s=layer_timeout,
        )


def check_extra_config(extra: Mapping[str, Any], block_size: int, world_size: int) -> None:
    """What the server runs at argument parsing: `ValueError` for any key paged refuses."""
    OffloadingConfig.from_extra_config(extra, block_size, world_size)


def _chunk_size(extra: Mapping[str, Any], block_size: int) -> int:
    # vLLM's `block_size` here is the offloaded chunk in tokens; `blocks_per_chunk` the
    # same in device blocks; at most one of them (and paged's `chunk_size`).
    given = [k for k in ("block_size", "blocks_per_chunk", "chunk_size") if k in extra]
    if len(given) > 1:
        raise ValueError(
            f"OffloadingConnector: specify only one of {given} in kv_connector_extra_config"
        )
    if "blocks_per_chunk" in extra:
        blocks = int(number(extra, "blocks_per_chunk", 1))
        if blocks <= 0:
            raise ValueError("OffloadingConnector: blocks_per_chunk must be greater than 0")
        return blocks * block_size
    key = given[0] if given else "chunk_size"
    chunk = int(number(extra, key, DEFAULT_CHUNK_SIZE))
    if chunk <= 0 or chunk % block_size:
        raise ValueError(
            f"OffloadingConnector: {key} {chunk} must be a positive multiple of "
            f"the block size {block_size}"
        )
    return chunk


def _host_bytes_per_rank(extra: Mapping[str, Any], world_size: int) -> int:
    if "cpu_bytes_to_use" in extra and "kv_bytes_per_rank" in extra:
        raise ValueError(
            "OffloadingConnector: cpu_bytes_to_use (all ranks) and kv_bytes_per_rank (per "
            "rank) are exclusive; use cpu_bytes_to_use"
        )
    if "cpu_bytes_to_use" in extra:
        # vLLM 0.33: "total bytes of host memory reserved for the CPU tier across all
        # workers (not per-worker)".
        return int(number(extra, "cpu_bytes_to_use", 0) / max(world_size, 1))
    return int(number(extra, "kv_bytes_per_rank", 0))


def _disk_path(extra: Mapping[str, Any]) -> Path | None:
    root = fs_tier_root_dir(extra)
    raw = extra.get("disk_path")
    if root is not None and raw is not None:
        raise ValueError(
            "OffloadingConnector: disk_path and a secondary_tiers fs tier both name the "
            "disk tier; keep the fs tier's root_dir"
        )
    if raw is not None and (not isinstance(raw, str) or not raw):
        raise ValueError(f"OffloadingConnector: disk_path must be a non-empty string, got {raw!r}")
    path = root if root is not None else raw
    return Path(path) if path is not None else None


def _layerwise(extra: Mapping[str, Any]) -> tuple[bool, float]:
    enabled = extra.get("use_layerwise", False)
    if not isinstance(enabled, bool):
        raise ValueError(
            f"OffloadingConnector: use_layerwise must be true or false, got {enabled!r}"
        )
    timeout = number(extra, "layerwise_load_timeout_s", DEFAULT_LAYERWISE_TIMEOUT_S)
    if timeout <= 0:
        raise ValueError(
            f"OffloadingConnector: layerwise_load_timeout_s must be > 0, got {timeout}"
        )
    return enabled, timeout

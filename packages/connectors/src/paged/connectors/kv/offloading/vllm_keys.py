"""Which vLLM 0.33 OffloadingConnector keys paged takes, and why it refuses the others.

Every refusal names the key and what paged offers instead, so a vLLM user's
config fails at argument parsing with one line to act on (never after the
model has loaded). The key list is vLLM 0.33's
docs/features/kv_offloading_usage.md table plus paged's own four keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged.connectors.kv.offloading.redis_client import RedisTierConfig, parse_redis_tier

_PAGED_KEYS = frozenset(
    {
        "chunk_size",
        "kv_bytes_per_rank",
        "disk_path",
        "disk_bytes_per_rank",
        "use_layerwise",
        "layerwise_load_timeout_s",
    }
)
_VLLM_KEYS = frozenset(
    {
        "spec_name",
        "cpu_bytes_to_use",
        "block_size",
        "blocks_per_chunk",
        "eviction_policy",
        "store_threshold",
        "max_tracker_size",
        "offload_prompt_only",
        "secondary_tiers",
        "tier_poll_interval_s",
        "sync_load_budget_bytes",
        "self_describing_kv_events",
        "canonical_layout",
    }
)
_SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")
EVICTION_POLICIES = ("lru", "arc")

# Keys refused with a reason (everything else unknown is refused with the key list).
_REFUSED: dict[str, str] = {
    "num_cpu_blocks": "it is SimpleCPUOffloadConnector's key, not the OffloadingConnector's; "
    "size the host tier with cpu_bytes_to_use (bytes, all ranks together)",
    "cpu_bytes_to_use_per_rank": "it is SimpleCPUOffloadConnector's key; use cpu_bytes_to_use "
    "(all ranks together) or paged's kv_bytes_per_rank",
    "spec_module_path": "out-of-tree offloading specs are not loaded; "
    f"spec_name is one of {list(_SPECS)}",
    "cache_policy_module_path": "out-of-tree cache policies are not loaded; "
    f"eviction_policy is one of {list(EVICTION_POLICIES)}",
    "backpressure": "paged's disk tier has no back-pressure detector (one background writer "
    "thread takes every write); remove the key",
}

_FS_KEYS = frozenset({"type", "root_dir", "n_read_threads", "n_write_threads", "enable_kv_events"})
_TIER_TYPES_REFUSED = {
    "obj": "an object-store tier",
    "p2p": "a peer-to-peer tier",
    "kvcr": "a KV cache registry tier",
    "example": "vLLM's example tier",
}


def number(extra: Mapping[str, Any], key: str, default: float) -> float:
    """`extra[key]` as a number (vLLM computes sizes as floats); `ValueError` naming the key."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"OffloadingConnector: {key} must be a number, got {value!r}")
    return float(value)


def check_refused_keys(extra: Mapping[str, Any]) -> None:
    """`ValueError` for the first key or value paged does not implement."""
    for key in sorted(extra):
        if key in _REFUSED:
            raise ValueError(f"OffloadingConnector: {key} is not supported: {_REFUSED[key]}")
    unknown = sorted(set(extra) - _PAGED_KEYS - _VLLM_KEYS)
    if unknown:
        raise ValueError(
            f"OffloadingConnector: unknown kv_connector_extra_config keys {unknown} "
            f"(known: {sorted(_VLLM_KEYS | _PAGED_KEYS)})"
        )
    spec = extra.get("spec_name", "CPUOffloadingSpec")
    if spec not in _SPECS:
        raise ValueError(
            f"OffloadingConnector: spec_name {spec!r} is not supported; use one of {list(_SPECS)}"
        )
    policy = extra.get("eviction_policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise ValueError(
            f"OffloadingConnector: eviction_policy {policy!r} is not supported; paged's host "
            f"tier offers {list(EVICTION_POLICIES)}"
        )
    # paged's tier events always carry each chunk's block hashes, token ids and parent
    # hash (the self-describing form), so either value is honoured; a canonical layout
    # is not: chunks are stored in each rank's own page layout.
    for flag in ("self_describing_kv_events", "canonical_layout"):
        value = extra.get(flag, False)
        if not isinstance(value, bool):
            raise ValueError(f"OffloadingConnector: {flag} must be true or false, got {value!r}")
    if extra.get("canonical_layout", False):
        raise ValueError(
            "OffloadingConnector: canonical_layout=true is not supported: chunks are stored "
            "in each rank's own page layout (share a disk tier only between engines of one "
            "tensor-parallel size)"
        )
    # Accepted for vLLM configs, no effect: tier_poll_interval_s paces only p2p tiers
    # (refused here) and paged's loads are always synchronous (any sync_load_budget_bytes).
    number(extra, "tier_poll_interval_s", 0)
    if number(extra, "sync_load_budget_bytes", 0) < 0:
        raise ValueError("OffloadingConnector: sync_load_budget_bytes must be >= 0")
    if spec == "TieringOffloadingSpec" and number(extra, "store_threshold", 0) >= 2:
        # As vLLM 0.33 (v1/kv_offload/tiering/spec.py:379).
        raise ValueError(
            "OffloadingConnector: store_threshold >= 2 is not supported with "
            "TieringOffloadingSpec (as in vLLM); use CPUOffloadingSpec or drop the threshold"
        )
    _check_tiers(extra, spec)


def fs_tier_root_dir(extra: Mapping[str, Any]) -> str | None:
    """The `root_dir` of the (single) fs secondary tier, or None without one."""
    tiers = extra.get("secondary_tiers") or []
    for tier in tiers:
        if isinstance(tier, Mapping) and tier.get("type") == "fs":
            root = tier.get("root_dir")
            return root if isinstance(root, str) else None
    return None


def fs_tier_events(extra: Mapping[str, Any]) -> bool:
    """Whether the disk tier publishes KV events: its enable_kv_events, True without an fs tier."""
    for tier in extra.get("secondary_tiers") or []:
        if isinstance(tier, Mapping) and tier.get("type") == "fs":
            return tier.get("enable_kv_events", False) is True
    return True


def _check_tiers(extra: Mapping[str, Any], spec: str) -> None:
    if "secondary_tiers" not in extra:
        return
    tiers = extra["secondary_tiers"]
    if not isinstance(tiers, list):
        raise ValueError("OffloadingConnector: secondary_tiers must be a list of tier configs")
    if tiers and spec != "TieringOffloadingSpec":
        # vLLM's CPUOffloadingSpec never reads secondary_tiers: refused rather than ignored.
        raise ValueError(
            'OffloadingConnector: secondary_tiers needs "spec_name": "TieringOffloadingSpec" '
            "(vLLM's CPUOffloadingSpec ignores it)"
        )
    for tier in tiers:
        if not isinstance(tier, Mapping):
            raise ValueError(
                f"OffloadingConnector: a secondary tier must be an object, got {tier!r}"
            )
        if tier.get("type") == "redis":
            parse_redis_tier(tier)
        else:
            _check_fs_tier(tier)
    kinds = [tier.get("type") for tier in tiers]
    if any(kinds.count(kind) > 1 for kind in kinds) or kinds not in (
        ["fs"],
        ["redis"],
        ["fs", "redis"],
    ):
        raise ValueError(
            f"OffloadingConnector: secondary_tiers {kinds} is not supported; paged has at "
            'most one {"type": "fs"} (local disk) then one {"type": "redis"} (shared), '
            "in that order"
        )


def redis_tier_config(extra: Mapping[str, Any]) -> RedisTierConfig | None:
    """The redis secondary tier's settings, or None without one (validated)."""
    for tier in extra.get("secondary_tiers") or []:
        if isinstance(tier, Mapping) and tier.get("type") == "redis":
            return parse_redis_tier(tier)
    return None


def _check_fs_tier(tier: Mapping[str, Any]) -> None:
    kind = tier.get("type")
    if kind != "fs":
        what = _TIER_TYPES_REFUSED.get(str(kind), "an unknown tier type")
        raise ValueError(
            f"OffloadingConnector: secondary tier type {kind!r} ({what}) is not supported; "
            'paged offers {"type": "fs", "root_dir": ...} (local disk) and '
            '{"type": "redis", "url": "redis://HOST:PORT"} (shared)'
        )
    unknown = sorted(set(tier) - _FS_KEYS)
    if unknown:
        raise ValueError(
            f"OffloadingConnector: fs tier keys {unknown} are not supported "
            f"(paged takes {sorted(_FS_KEYS)}; locality, backpressure and module_path "
            "are vLLM-only)"
        )
    root = tier.get("root_dir")
    if not isinstance(root, str) or not root:
        raise ValueError(
            f"OffloadingConnector: the fs tier needs root_dir, a non-empty path; got {root!r}"
        )
    for key in ("n_read_threads", "n_write_threads"):
        threads = number(tier, key, 16)
        if threads <= 0 or threads != int(threads):
            raise ValueError(f"OffloadingConnector: fs tier {key} must be a positive integer")
    if not isinstance(tier.get("enable_kv_events", False), bool):
        raise ValueError("OffloadingConnector: fs tier enable_kv_events must be true or false")

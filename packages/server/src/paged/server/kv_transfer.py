"""KV transfer glue: from `--kv-transfer-config` to connector objects, and request params.

The server is the only package that knows both the runner and the
connectors, so it builds the connector objects (ARCHITECTURE: no global
connector state). `KVConnectorBuilder` is a small frozen, picklable object:
it travels inside `EngineConfig` to the engine-core process (which builds the
scheduler side) and to every worker process (which builds its worker side).

    EngineArgs.kv_transfer_config (JSON text or dict)
      -> kv_connector_builder()      parse + import the class now: bad config stops start-up
      -> EngineConfig.kv_connector_factory
           EngineCore: make_scheduler_connector(...)   KVConnectorRole.SCHEDULER
           Worker:     make_worker_connector(rank, tp) KVConnectorRole.WORKER
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from paged.scheduler.boundary import KVTransferParams
from paged.server.errors import InvalidRequestError

if TYPE_CHECKING:
    from paged.connectors.kv import KVConnectorBase, KVTransferConfig
    from paged.connectors.kv.groups import GroupLayout
    from paged.kvcache import KVCacheConfig
    from paged.runner.config import EngineConfig
    from paged.scheduler.config import KVLoadFailurePolicy


@dataclass(frozen=True)
class KVConnectorBuilder:
    """Builds either side of the configured connector (satisfies the runner's factory Protocol)."""

    config_json: str
    block_size: int
    # What P/D engines compare in their handshake: the served name, or the model
    # path's last component (the same checkpoint sits at different paths on two hosts).
    model_name: str = ""

    def config(self) -> KVTransferConfig:
        from paged.connectors.kv import parse_kv_transfer_config

        return parse_kv_transfer_config(self.config_json)

    def _create(
        self,
        role_name: str,
        rank: int,
        world_size: int,
        num_groups: int,
        kv_bytes_per_block: int = 0,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> KVConnectorBase:
        from paged.connectors.kv import KVConnectorContext, KVConnectorFactory, KVConnectorRole

        context = KVConnectorContext(
            block_size=self.block_size,
            rank=rank,
            world_size=world_size,
            num_kv_cache_groups=num_groups,
            kv_bytes_per_block=kv_bytes_per_block,
            model_name=self.model_name,
            kv_cache_groups=self._layouts(kv_cache_config),
        )
        role = KVConnectorRole[role_name]
        return KVConnectorFactory.with_builtins().create_connector(self.config(), role, context)

    def _layouts(self, kv_cache_config: KVCacheConfig | None) -> tuple[GroupLayout, ...]:
        """Each group's window and bytes, for the scheduler side (the worker side learns
        its layers' groups in register_kv_caches). A single group of a kind connectors do
        not model (e.g. Mamba) keeps the single-group behaviour; a hybrid one is refused.
        """
        from paged.connectors.kv.groups import group_layouts

        if kv_cache_config is None:
            return ()
        try:
            return group_layouts(kv_cache_config, self.block_size)
        except ValueError:
            if len(kv_cache_config.kv_cache_groups) > 1:
                raise
            return ()

    def make_worker_connector(self, rank: int, world_size: int) -> KVConnectorBase:
        return self._create("WORKER", rank, world_size, 1)

    def make_scheduler_connector(
        self,
        world_size: int,
        num_kv_cache_groups: int,
        kv_bytes_per_block: int = 0,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> KVConnectorBase:
        return self._create(
            "SCHEDULER", 0, world_size, num_kv_cache_groups, kv_bytes_per_block, kv_cache_config
        )


# vLLM's LMCache connectors: lmcache 0.5.6 from PyPI moves KV only through its CUDA
# kernels (packages/connectors/docs/lmcache.md), so they are refused by name.
_LMCACHE_CONNECTORS = ("LMCacheConnectorV1", "LMCacheMPConnector")


def kv_connector_builder(
    config: str | dict[str, Any] | None,
    block_size: int,
    model_name: str = "",
    world_size: int = 1,
) -> KVConnectorBuilder | None:
    """Validate a kv-transfer config; None when it names no connector.

    Raises `ValueError` with one message naming the field or the class that
    failed (bad JSON, unknown field, unknown connector, import error).
    """
    if config is None:
        return None
    from paged.connectors.kv import kv_transfer_config_from_dict, parse_kv_transfer_config

    parsed = (
        kv_transfer_config_from_dict(config)
        if isinstance(config, dict)
        else parse_kv_transfer_config(config)
    )
    if parsed.kv_connector is None:
        return None
    _check_connector(parsed, block_size, world_size)
    return KVConnectorBuilder(
        config_json=parsed.to_json(),
        block_size=block_size,
        model_name=os.path.basename(model_name.rstrip("/")),
    )


def _check_connector(config: KVTransferConfig, block_size: int, world_size: int) -> None:
    """Refuse here what would only fail in the engine core: LMCache, offloading keys.

    Runs in the process that parses the flag, before any model loads or engine
    process is spawned; MultiConnector's children are checked the same way.
    """
    from paged.connectors.kv import KVConnectorFactory
    from paged.connectors.kv.multi import child_configs
    from paged.connectors.kv.offloading.config import check_extra_config

    if config.kv_connector in _LMCACHE_CONNECTORS:
        raise ValueError(
            f"kv_transfer_config: kv_connector {config.kv_connector!r} is not available: the "
            "lmcache package moves KV only with CUDA kernels, which paged cannot use "
            "(packages/connectors/docs/lmcache.md); use paged's OffloadingConnector "
            '(\'{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
            '"kv_connector_extra_config":{"cpu_bytes_to_use":...}}\')'
        )
    # Import the class now so an unknown connector stops start-up.
    KVConnectorFactory.with_builtins().get_connector_class(config)
    if config.kv_connector == "OffloadingConnector":
        check_extra_config(config.kv_connector_extra_config, block_size, world_size)
    elif config.kv_connector == "MultiConnector":
        for child in child_configs(config):
            _check_connector(child, block_size, world_size)


def make_scheduler_connector(
    engine_config: EngineConfig,
    num_kv_cache_groups: int,
    kv_bytes_per_block: int = 0,
    kv_cache_config: KVCacheConfig | None = None,
) -> KVConnectorBase | None:
    """The scheduler-side connector for this engine, or None without KV transfer."""
    builder = engine_config.kv_connector_factory
    if builder is None:
        return None
    if not isinstance(builder, KVConnectorBuilder):
        raise TypeError(
            "EngineConfig.kv_connector_factory must be a KVConnectorBuilder to build the "
            f"scheduler side, got {type(builder).__name__}"
        )
    tp = engine_config.parallel_config.tensor_parallel_size
    return builder.make_scheduler_connector(
        tp, num_kv_cache_groups, kv_bytes_per_block, kv_cache_config
    )


def kv_load_failure_policy(engine_config: EngineConfig) -> KVLoadFailurePolicy:
    """The configured connector's `kv_load_failure_policy` ("recompute" without one)."""
    builder = engine_config.kv_connector_factory
    if not isinstance(builder, KVConnectorBuilder):
        return "recompute"
    return builder.config().kv_load_failure_policy


def kv_bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block id across every layer of one rank (what a chunk store holds)."""
    return sum(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names)
        for g in kv_cache_config.kv_cache_groups
    )


# vLLM also offers "lmcache"; paged cannot run it (packages/connectors/docs/lmcache.md).
OFFLOADING_BACKENDS = ("native",)


def offloading_kv_transfer_config(
    size_gib: float, backend: str, tensor_parallel_size: int
) -> dict[str, Any]:
    """vLLM's `--kv-offloading-size GiB --kv-offloading-backend native`, as a transfer config.

    As vLLM 0.33 (config/vllm.py:1167-1174): the OffloadingConnector in kv_both
    with `cpu_bytes_to_use` = GiB * 2**30, all ranks together (the connector
    splits it over the ranks).
    """
    if size_gib <= 0:
        raise ValueError(f"kv_offloading_size must be positive GiB, got {size_gib}")
    if backend != "native":
        raise ValueError(
            f"kv_offloading_backend {backend!r} is not supported; use 'native' "
            "(vLLM's 'lmcache' is not available: packages/connectors/docs/lmcache.md)"
        )
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": size_gib * (1 << 30)},
    }


class _KVTransferParamsIn(msgspec.Struct, forbid_unknown_fields=True):
    """The typed keys of `KVTransferParams` in JSON object form (the struct is array-like)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None


_TYPED_KEYS = frozenset(_KVTransferParamsIn.__struct_fields__)


def parse_request_kv_transfer_params(raw: object) -> KVTransferParams | None:
    """A request's `kv_transfer_params` object; `InvalidRequestError` (HTTP 400) if malformed."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError(
            "kv_transfer_params", "kv_transfer_params is invalid: expected an object"
        )
    # Known keys are typed strictly; any other key is kept as sent (vLLM's params are an
    # open dict that routers and connectors extend), never a 400.
    known = {k: v for k, v in raw.items() if k in _TYPED_KEYS}
    extra = {str(k): v for k, v in raw.items() if k not in _TYPED_KEYS}
    grouped = known.get("remote_block_ids")
    if isinstance(grouped, list) and grouped and all(isinstance(g, list) for g in grouped):
        # A hybrid model's prefill answers one list per KV cache group (vLLM's form);
        # the typed field is flat, so the per-group lists travel in `extra`.
        try:
            extra["remote_block_ids"] = msgspec.convert(grouped, type=list[list[int]])
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(
                "kv_transfer_params", f"kv_transfer_params is invalid: remote_block_ids: {exc}"
            ) from None
        del known["remote_block_ids"]
    try:
        parsed = msgspec.convert(known, type=_KVTransferParamsIn)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(
            "kv_transfer_params", f"kv_transfer_params is invalid: {exc}"
        ) from None
    return KVTransferParams(**msgspec.structs.asdict(parsed), extra=extra or None)


def kv_transfer_params_to_dict(params: KVTransferParams | None) -> dict[str, Any] | None:
    """The response form of params a connector returned (unset fields left out, extras flat)."""
    if params is None:
        return None
    fields = msgspec.structs.asdict(params)
    extra = fields.pop("extra") or {}
    typed = {k: v for k, v in fields.items() if v is not None}
    return {**extra, **typed}

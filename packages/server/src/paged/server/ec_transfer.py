"""Encoder-cache transfer glue: from `--ec-transfer-config` to connector objects.

As for KV transfer (kv_transfer.py), the server is the only package that
knows both the runner and the connectors, so it builds the connector objects
(no global connector state). `ECConnectorBuilder` is a frozen, picklable
object that travels inside `EngineConfig` to the engine-core process (which
builds the scheduler side) and to every worker process (the worker side).

    EngineArgs.ec_transfer_config (JSON text or dict)
      -> ec_connector_builder()        parse + import the class now: bad config stops start-up
      -> EngineConfig.ec_connector_factory
           EngineCore: make_scheduler_ec_connector(...)   ECConnectorRole.SCHEDULER
           Worker:     make_worker_ec_connector(rank, tp) ECConnectorRole.WORKER
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged.connectors.ec import ECConnectorBase, ECTransferConfig
    from paged.runner.config import EngineConfig


@dataclass(frozen=True)
class ECConnectorBuilder:
    """Builds either side of the configured EC connector (the runner's factory Protocol)."""

    config_json: str
    model_name: str = ""

    def config(self) -> ECTransferConfig:
        from paged.connectors.ec import parse_ec_transfer_config

        return parse_ec_transfer_config(self.config_json)

    def _create(self, role_name: str, rank: int, world_size: int) -> ECConnectorBase:
        from paged.connectors.ec import ECConnectorContext, ECConnectorFactory, ECConnectorRole

        context = ECConnectorContext(rank=rank, world_size=world_size, model_name=self.model_name)
        role = ECConnectorRole[role_name]
        return ECConnectorFactory.with_builtins().create_connector(self.config(), role, context)

    def make_worker_ec_connector(self, rank: int, world_size: int) -> ECConnectorBase:
        return self._create("WORKER", rank, world_size)

    def make_scheduler_ec_connector(self, world_size: int) -> ECConnectorBase:
        return self._create("SCHEDULER", 0, world_size)


def ec_connector_builder(
    config: str | dict[str, Any] | None, model_name: str = ""
) -> ECConnectorBuilder | None:
    """Validate an ec-transfer config; None when it names no connector.

    Raises `ValueError` with one message naming the field or the class that
    failed (bad JSON, unknown field, bad ec_role, unknown connector, import error).
    """
    if config is None:
        return None
    from paged.connectors.ec import (
        ECConnectorFactory,
        ec_transfer_config_from_dict,
        parse_ec_transfer_config,
    )

    parsed = (
        ec_transfer_config_from_dict(config)
        if isinstance(config, dict)
        else parse_ec_transfer_config(config)
    )
    if parsed.ec_connector is None:
        return None
    # Import the class in the process that parses the flag, so an unknown
    # connector stops start-up before any engine process is spawned.
    ECConnectorFactory.with_builtins().get_connector_class(parsed)
    return ECConnectorBuilder(
        config_json=parsed.to_json(), model_name=os.path.basename(model_name.rstrip("/"))
    )


def parse_request_ec_transfer_params(raw: object) -> dict[str, Any] | None:
    """A request's `ec_transfer_params` (vLLM 0.33); `InvalidRequestError` (HTTP 400) if bad.

    Accepted on any instance: one without an EC connector ignores them, as
    vLLM does (vllm/v1/engine/core.py:549 warns and disables the transfer), so a
    proxy can send the same body to a decode instance that is no consumer.
    """
    from paged.connectors.ec.transfer_params import (
        ECTransferParamsError,
        validate_ec_transfer_params,
    )
    from paged.server.errors import InvalidRequestError

    try:
        return validate_ec_transfer_params(raw)
    except ECTransferParamsError as exc:
        raise InvalidRequestError("ec_transfer_params", str(exc)) from None


def make_scheduler_ec_connector(engine_config: EngineConfig) -> ECConnectorBase | None:
    """The scheduler-side EC connector for this engine, or None without one."""
    builder = engine_config.ec_connector_factory
    if builder is None:
        return None
    if not isinstance(builder, ECConnectorBuilder):
        raise TypeError(
            "EngineConfig.ec_connector_factory must be an ECConnectorBuilder to build the "
            f"scheduler side, got {type(builder).__name__}"
        )
    return builder.make_scheduler_ec_connector(engine_config.parallel_config.tensor_parallel_size)


def ec_load_failure_policy(engine_config: EngineConfig) -> str:
    """The configured EC connector's `ec_load_failure_policy` ("recompute" without one)."""
    builder = engine_config.ec_connector_factory
    if not isinstance(builder, ECConnectorBuilder):
        return "recompute"
    return builder.config().ec_load_failure_policy

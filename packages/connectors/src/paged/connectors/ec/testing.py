"""Test doubles for EC connectors: a dict-backed encoder cache and requests with images.

Used by paged-connectors' tests and usable by any connector author. The
runner's PreallocatedEncoderCache lives in paged-runner (not upstream of this
package), so `DictEncoderCache` stands in for it: it satisfies the same
`EncoderCache` Protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from paged.connectors.ec import (
    ECConnectorContext,
    ECConnectorFactory,
    ECConnectorRole,
    EncoderCache,
    ec_transfer_config_from_dict,
)
from paged.connectors.ec.base import ECConnectorBase
from paged.connectors.ec.config import ECTransferConfig
from paged.connectors.ec.example import ECExampleConnector, ECExampleConnectorMetadata
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.request import Request
from paged.scheduler.sampling_params import SamplingParams

HIDDEN = 8


class DictEncoderCache:
    """An `EncoderCache` over a dict (each allocation its own tensor)."""

    def __init__(self, hidden_size: int = HIDDEN, capacity: int = 1000) -> None:
        self._rows: dict[str, torch.Tensor] = {}
        self._hidden = hidden_size
        self._capacity = capacity

    @property
    def hidden_size(self) -> int:
        return self._hidden

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._rows

    def get(self, mm_hash: str) -> torch.Tensor | None:
        return self._rows.get(mm_hash)

    def allocate(self, mm_hash: str, num_embeds: int) -> torch.Tensor:
        if mm_hash in self._rows or num_embeds < 1:
            raise ValueError(mm_hash)
        if sum(len(t) for t in self._rows.values()) + num_embeds > self._capacity:
            raise RuntimeError("full")
        rows = torch.full((num_embeds, self._hidden), float("nan"))
        self._rows[mm_hash] = rows
        return rows

    def free(self, mm_hash: str) -> None:
        self._rows.pop(mm_hash, None)

    def store(self, mm_hash: str, output: torch.Tensor) -> None:
        self.allocate(mm_hash, output.shape[0]).copy_(output)


_PROTOCOL_CHECK: type[EncoderCache] = DictEncoderCache


def image_request(rid: str, hashes: list[str], embeds: int = 4) -> Request:
    """A request whose prompt holds one image placeholder per hash, `embeds` tokens each."""
    features = [
        MultiModalFeatureSpec("image", h, PlaceholderRange(2 + i * (embeds + 2), embeds))
        for i, h in enumerate(hashes)
    ]
    length = 4 + len(hashes) * (embeds + 2)
    core = EngineCoreRequest(
        rid, list(range(1, length + 1)), SamplingParams(max_tokens=2), None, 0.0,
        mm_features=features,
    )  # fmt: skip
    return Request.from_engine_core_request(core, max_model_len=256)


def make_connector(
    config: Mapping[str, Any], role: ECConnectorRole, factory: ECConnectorFactory | None = None
) -> ECConnectorBase:
    factory = factory or ECConnectorFactory.with_builtins()
    return factory.create_connector(
        ec_transfer_config_from_dict(dict(config)), role, ECConnectorContext()
    )


class DelayedECExampleConnector(ECExampleConnector):
    """ECExampleConnector whose loads land asynchronously, `delay_steps` steps later.

    A stand-in for a network connector, to test the asynchronous path (vLLM's
    gap 1) through a real engine: `start_load_caches` reserves the rows and
    reads the file, `get_finished` copies the bytes in after `delay_steps`
    further calls (looking the rows up again: they may have moved) and reports
    the hash in `finished_recving`. `ec_connector_extra_config.delay_steps`
    (default 2) sets the delay. Select it with
    `"ec_connector": "DelayedECExampleConnector",
    "ec_connector_module_path": "paged.connectors.ec.testing"`.
    """

    def __init__(
        self, config: ECTransferConfig, role: ECConnectorRole, context: ECConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        self.delay_steps = int(config.get_from_extra_config("delay_steps", 2))
        # mm hash -> (steps left, bytes read from the file, or None if unreadable)
        self._in_flight: dict[str, tuple[int, torch.Tensor | None]] = {}

    def is_async_load(self, identifier: str) -> bool:
        return True

    def start_load_caches(self, encoder_cache: EncoderCache, **kwargs: Any) -> None:
        if not self.is_consumer or not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata(ECExampleConnectorMetadata)
        for item in metadata.mm_datas:
            if item.mm_hash in encoder_cache or item.mm_hash in self._in_flight:
                continue
            tensor = self._read(item, encoder_cache.hidden_size)
            encoder_cache.allocate(item.mm_hash, item.num_token)  # reserved, written later
            self._in_flight[item.mm_hash] = (self.delay_steps, tensor)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        cache = self.registered_cache
        done: set[str] = set()
        for mm_hash, (left, tensor) in list(self._in_flight.items()):
            if left > 0:
                self._in_flight[mm_hash] = (left - 1, tensor)
                continue
            del self._in_flight[mm_hash]
            rows = cache.get(mm_hash) if cache is not None else None
            if rows is None or tensor is None:
                if cache is not None:
                    cache.free(mm_hash)  # the contract: a failed load leaves no rows
                self._failed.add(mm_hash)
                continue
            rows.copy_(tensor)
            self.num_loaded += 1
            done.add(mm_hash)
        return None, done or None

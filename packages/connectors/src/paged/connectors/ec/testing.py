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

"""`ECExampleConnector`: encoder outputs as safetensors files (seed: ECExampleConnector 参照実装).

The reference connector of the seed, with vLLM's file layout so the two read
each other's files:

    {shared_storage_path}/
    └── {mm_hash}/
        └── encoder_cache.safetensors      {"ec_cache": Tensor [num_embeds, hidden_size]}

- producer, worker side: `save_caches` writes `.detach().cpu()` of the item's
  rows, to a temporary name first and then renamed, so a reader never sees
  half a file;
- consumer, scheduler side: `has_cache_item` is `os.path.exists` of the file;
  `update_state_after_alloc` queues (mm_hash, num_embeds) for the step's
  metadata;
- consumer, worker side: `start_load_caches` reads each queued file and copies
  it straight into the preallocated encoder cache (synchronous: done before the
  step's forward).

Unlike vLLM's, a file whose tensor has the wrong shape, or whose bytes do not
match the checksum the writer stored in the safetensors header, or that
cannot be parsed, is a failed load (reported in `get_failed_loads`, nothing
reserved in the cache): the runner encodes the item itself, with the same
output. Files written by vLLM carry no checksum and are accepted on shape.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from typing import Any

import msgspec
import safetensors
import safetensors.torch
import torch

from paged.connectors.ec.base import (
    ECConnectorBase,
    ECConnectorContext,
    ECConnectorRole,
    EncoderCache,
)
from paged.connectors.ec.config import ECTransferConfig
from paged.scheduler.boundary import ECConnectorMetadata, SchedulerOutput
from paged.scheduler.request import Request

FILE_NAME = "encoder_cache.safetensors"
TENSOR_KEY = "ec_cache"  # vLLM's key
_CHECKSUM_KEY = "paged_blake2b"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class MMMeta(msgspec.Struct, array_like=True, frozen=True):
    """One item to load: its hash and its number of embeddings (vLLM's MMMeta)."""

    mm_hash: str
    num_token: int


class ECExampleConnectorMetadata(ECConnectorMetadata, frozen=True):
    """The items to load this step (vLLM's ECExampleConnectorMetadata)."""

    mm_datas: list[MMMeta] = msgspec.field(default_factory=list)


def _checksum(tensor: torch.Tensor) -> str:
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class ECExampleConnector(ECConnectorBase):
    """Disk connector over a shared directory; see the module docstring.

    `ec_connector_extra_config["shared_storage_path"]` (required) is the
    directory; it is created if missing.
    """

    def __init__(
        self, config: ECTransferConfig, role: ECConnectorRole, context: ECConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        path = config.get_from_extra_config("shared_storage_path", None)
        if not isinstance(path, str) or not path:
            raise ValueError(
                "ec_connector_extra_config.shared_storage_path: ECExampleConnector needs a "
                "directory (a non-empty string)"
            )
        self.storage_path = path
        os.makedirs(path, exist_ok=True)
        self._to_load: list[MMMeta] = []  # scheduler side, this step
        self._failed: set[str] = set()  # worker side, since the last get_failed_loads
        # Counters for tests and logs (worker side).
        self.num_loaded = 0
        self.num_saved = 0

    def file_path(self, mm_hash: str) -> str:
        """Where `mm_hash`'s file lives (a hash unsafe as a directory name is hashed)."""
        name = (
            mm_hash
            if _SAFE_NAME.match(mm_hash) and mm_hash not in (".", "..")
            else (hashlib.sha256(mm_hash.encode()).hexdigest())
        )
        return os.path.join(self.storage_path, name, FILE_NAME)

    # ------------------------------------------------------------------ worker side

    def start_load_caches(self, encoder_cache: EncoderCache, **kwargs: Any) -> None:
        if not self.is_consumer or not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata(ECExampleConnectorMetadata)
        for item in metadata.mm_datas:
            if item.mm_hash in encoder_cache:
                continue  # already here (e.g. loaded for another request this step)
            tensor = self._read(item, encoder_cache.hidden_size)
            if tensor is None:
                self._failed.add(item.mm_hash)
                continue
            rows = encoder_cache.allocate(item.mm_hash, item.num_token)
            rows.copy_(tensor)  # straight into the preallocated buffer (dtype, device)
            self.num_loaded += 1

    def _read(self, item: MMMeta, hidden_size: int) -> torch.Tensor | None:
        """The file's tensor if it is whole and has the expected shape, else None."""
        path = self.file_path(item.mm_hash)
        try:
            with safetensors.safe_open(path, framework="pt") as f:
                header = f.metadata() or {}
                tensor: torch.Tensor = f.get_tensor(TENSOR_KEY)
        except Exception:  # missing, truncated, not safetensors, no "ec_cache" key
            return None
        if tuple(tensor.shape) != (item.num_token, hidden_size):
            return None
        expected = header.get(_CHECKSUM_KEY)
        if expected is not None and expected != _checksum(tensor):
            return None
        return tensor

    def save_caches(self, encoder_cache: EncoderCache, mm_hash: str, **kwargs: Any) -> None:
        if not self.is_producer:
            return
        rows = encoder_cache.get(mm_hash)
        if rows is None:
            raise ValueError(f"save_caches: mm_hash {mm_hash} is not in the encoder cache")
        tensor = rows.detach().cpu().contiguous()
        path = self.file_path(mm_hash)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            safetensors.torch.save_file(
                {TENSOR_KEY: tensor}, tmp, metadata={_CHECKSUM_KEY: _checksum(tensor)}
            )
            os.replace(tmp, path)  # atomic: has_cache_item never sees half a file
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.num_saved += 1

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    # --------------------------------------------------------------- scheduler side

    def has_cache_item(self, identifier: str, request: Request | None = None) -> bool:
        return self.is_consumer and os.path.exists(self.file_path(identifier))

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        self._to_load.append(
            MMMeta(mm_hash=feature.identifier, num_token=feature.mm_position.get_num_embeds())
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        metadata = ECExampleConnectorMetadata(mm_datas=self._to_load)
        self._to_load = []
        return metadata

"""`SharedStorageConnector`: prompt-prefix KV in a directory, as safetensors (seed: KV Transfer).

vLLM's example connector (also registered as `ExampleConnector`, its newer
name). A request's prompt is cut at the last block boundary that leaves at
least one token to compute; that prefix is the unit stored and looked up:

    prompt (B = 4)   t0 .. t3 | t4 .. t7 | t8 t9      -> prefix t0..t7 (8 tokens)
    key              sha256(token ids [, mm identifiers]) of the prefix
    files            {shared_storage_path}/{key}/rank{r}/{layer_name}.safetensors
                     {shared_storage_path}/{key}/rank{r}/COMPLETE   (written last)

Scheduler side: a request whose prefix is stored (every rank's COMPLETE
marker present) gets `(prefix_len - local_hit, False)`, a synchronous load;
one whose prefix is not stored is saved once its computed tokens reach the
prefix end (with chunked prefill that may be several steps after admission,
so a save never reads blocks not yet written). Worker side: loads are done in
`start_load_kv` (synchronously, every layer), saves in `save_kv_layer`, the
marker in `wait_for_save`. A missing or unreadable file is a load error: its
blocks are reported and the scheduler recomputes them.

Files are written to a temporary name and renamed, so a reader never sees a
half-written tensor.

Hybrid models (full + sliding-window groups, e.g. Gemma 3): each layer's file
holds the prefix tokens of its own group's blocks; a sliding-window group
stores and loads only the blocks inside the window of the prefix end (see
`groups.py`), its file's `first_token` metadata says where they start:

    prefix 0 .. 15, B = 4, W = 6   full layers: tokens 0..15   sliding layers: 8..15
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import safetensors
import safetensors.torch
import torch

from paged.connectors.kv.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from paged.connectors.kv.blocks import gather_kv, scatter_kv, slot_mapping
from paged.connectors.kv.config import KVTransferConfig
from paged.connectors.kv.groups import GroupLayout, window_start_block
from paged.kvcache import KVCacheBlocks
from paged.scheduler.boundary import BlockIdsPerGroup, KVTransferParams, SchedulerOutput
from paged.scheduler.request import Request

logger = logging.getLogger(__name__)

DEFAULT_STORAGE_PATH = "/tmp"  # vLLM's default for shared_storage_path
_COMPLETE = "COMPLETE"


class GroupBlocks(msgspec.Struct, array_like=True, frozen=True):
    """Blocks of one KV cache group: `block_ids[i]` holds prefix block `first_block + i`."""

    first_block: int
    block_ids: list[int]


class StorageTransfer(msgspec.Struct, array_like=True, frozen=True):
    """One prefix of `num_tokens` (a multiple of the block size) to load or save, per group.

    A save names, per group, the blocks the prefix needs (a sliding-window
    group: only those in its window). A load names the blocks to write: it
    skips the local prefix-cache hit (those blocks may be shared with running
    requests and already hold the same KV) and, for a sliding-window group,
    the blocks before the window (they are null blocks in the block table).
    """

    req_id: str
    key: str
    num_tokens: int
    groups: list[GroupBlocks]


class SharedStorageMetadata(msgspec.Struct, array_like=True, frozen=True):
    """One step's work for the worker side."""

    loads: list[StorageTransfer] = msgspec.field(default_factory=list)
    saves: list[StorageTransfer] = msgspec.field(default_factory=list)


@dataclass
class SharedStorageStats:
    """Scheduler-side lookups since start-up (a hit is a prefix found in storage)."""

    num_lookups: int = 0
    num_hits: int = 0
    num_hit_tokens: int = 0
    num_saves: int = 0


@dataclass
class _PendingSave:
    key: str
    num_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)  # per group, from block 0


def prefix_length(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens of the stored prefix: the last block boundary strictly before the prompt's end."""
    return max(num_prompt_tokens - 1, 0) // block_size * block_size


def prefix_key(token_ids: list[int], mm_identifiers: list[str]) -> str:
    """Content key of a prefix; stable across processes and restarts (no Python hash())."""
    digest = hashlib.sha256()
    digest.update(len(token_ids).to_bytes(8, "little"))
    for token in token_ids:
        digest.update(token.to_bytes(8, "little", signed=True))
    for identifier in mm_identifiers:
        digest.update(b"\x00mm\x00" + identifier.encode())
    return digest.hexdigest()


class SharedStorageConnector(KVConnectorBase):
    """Saves prompt-prefix KV to `kv_connector_extra_config.shared_storage_path`, loads it back."""

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        path = config.get_from_extra_config("shared_storage_path", DEFAULT_STORAGE_PATH)
        if not isinstance(path, str) or not path:
            raise ValueError(
                "kv_connector_extra_config.shared_storage_path must be a non-empty string, "
                f"got {path!r}"
            )
        self.storage_path = Path(path)
        # Scheduler side: each group's window (one full group unless the model is hybrid).
        self.groups: tuple[GroupLayout, ...] = (
            context.group_layouts() if role is KVConnectorRole.SCHEDULER else ()
        )
        self.block_size = context.block_size
        self.stats = SharedStorageStats()
        # Scheduler side.
        # req_id -> (key, prefix tokens, tokens already computed locally)
        self._requests_need_load: dict[str, tuple[str, int, int]] = {}
        self._pending_saves: dict[str, _PendingSave] = {}
        # Worker side.
        self._load_errors: set[int] = set()
        if role is KVConnectorRole.WORKER:
            self.storage_path.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ layout

    def _rank_dir(self, key: str, rank: int) -> Path:
        return self.storage_path / key / f"rank{rank}"

    def _layer_file(self, key: str, layer_name: str) -> Path:
        return self._rank_dir(key, self.context.rank) / f"{layer_name}.safetensors"

    def is_stored(self, key: str) -> bool:
        """Whether every rank finished writing this prefix."""
        return all(
            (self._rank_dir(key, r) / _COMPLETE).is_file() for r in range(self.context.world_size)
        )

    def _request_prefix(self, request: Request) -> tuple[str, int]:
        n = prefix_length(len(request.prompt_token_ids), self.block_size)
        identifiers = [f.identifier for f in request.mm_features or []]
        return prefix_key(request.prompt_token_ids[:n], identifiers), n

    # --------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        key, n = self._request_prefix(request)
        if n <= num_computed_tokens or not self._config.is_kv_consumer:
            return 0, False
        self.stats.num_lookups += 1
        if not self.is_stored(key):
            return 0, False
        self.stats.num_hits += 1
        self.stats.num_hit_tokens += n - num_computed_tokens
        return n - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        key, n = self._request_prefix(request)
        if num_external_tokens > 0:
            local = n - num_external_tokens
            self._requests_need_load[request.request_id] = (key, n, local)
        elif n > 0 and self._config.is_kv_producer and not self.is_stored(key):
            self._pending_saves[request.request_id] = _PendingSave(key, n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        for req_id in scheduler_output.preempted_req_ids:
            # Its blocks are freed; it is saved again if re-admitted without a hit.
            self._pending_saves.pop(req_id, None)
        loads: list[StorageTransfer] = []
        saves: list[StorageTransfer] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._step_request(
                new.req_id, new.block_ids, True, new.num_computed_tokens, scheduled, loads, saves
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._step_request(
                req_id,
                cached.new_block_ids[i],
                cached.resumed_from_preemption[i],
                cached.num_computed_tokens[i],
                scheduled,
                loads,
                saves,
            )
        if self._requests_need_load:
            # Admitted requests are always scheduled in the same step.
            raise RuntimeError(
                f"SharedStorageConnector: loads for unscheduled requests "
                f"{sorted(self._requests_need_load)}"
            )
        self.stats.num_saves += len(saves)
        return msgspec.msgpack.encode(SharedStorageMetadata(loads=loads, saves=saves))

    def _step_request(
        self,
        req_id: str,
        new_block_ids: BlockIdsPerGroup | None,
        replaces: bool,
        num_computed: int,
        scheduled: dict[str, int],
        loads: list[StorageTransfer],
        saves: list[StorageTransfer],
    ) -> None:
        """Add this request's load (first step) and save (once computed) to the step."""
        blocks = [list(ids) for ids in new_block_ids] if new_block_ids else []
        need = self._requests_need_load.pop(req_id, None)
        if need is not None:
            key, n, local = need
            loads.append(StorageTransfer(req_id, key, n, self._group_blocks(blocks, local, n)))
        pending = self._pending_saves.get(req_id)
        if pending is None:
            return
        if replaces or not pending.block_ids:
            pending.block_ids = blocks
        elif blocks:
            for have, new in zip(pending.block_ids, blocks, strict=True):
                have.extend(new)
        if num_computed + scheduled.get(req_id, 0) >= pending.num_tokens:
            del self._pending_saves[req_id]
            groups = self._group_blocks(pending.block_ids, 0, pending.num_tokens)
            saves.append(StorageTransfer(req_id, pending.key, pending.num_tokens, groups))

    def _group_blocks(
        self, block_ids: list[list[int]], skip_tokens: int, num_tokens: int
    ) -> list[GroupBlocks]:
        """Per group, the blocks of `[skip_tokens, num_tokens)` a resume at `num_tokens` needs."""
        end = num_tokens // self.block_size
        out: list[GroupBlocks] = []
        for g, layout in enumerate(self.groups):
            first = max(
                skip_tokens // self.block_size,
                window_start_block(layout.sliding_window, num_tokens, self.block_size),
            )
            ids = block_ids[g][first:end] if g < len(block_ids) else []
            out.append(GroupBlocks(first, ids))
        return out

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        self._pending_saves.pop(request.request_id, None)
        self._requests_need_load.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def _metadata(self) -> SharedStorageMetadata:
        return self._decoded_connector_metadata(SharedStorageMetadata)

    def start_load_kv(self) -> None:
        for load in self._metadata().loads:
            try:
                self._load_one(load)
            except Exception as exc:  # safetensors raises its own error type, too
                # A failed load must not produce wrong tokens nor stop the engine:
                # report the blocks, the scheduler recomputes from the first bad one.
                logger.warning("shared storage load for %s failed: %s", load.req_id, exc)
                for group in load.groups:
                    self._load_errors.update(group.block_ids)

    def _load_one(self, load: StorageTransfer) -> None:
        group_of = self._group_of_layer()
        for layer_name, kv_layer in self._kv_caches.items():
            group = load.groups[group_of[layer_name]]
            if not group.block_ids:
                continue
            path = self._layer_file(load.key, layer_name)
            with safetensors.safe_open(str(path), framework="pt") as f:
                kv = f.get_tensor("kv_cache")
                first_token = int((f.metadata() or {}).get("first_token", "0"))
            if first_token + kv.shape[1] != load.num_tokens:
                raise ValueError(
                    f"{path} holds tokens {first_token}..{first_token + kv.shape[1]}, "
                    f"expected a prefix of {load.num_tokens}"
                )
            start = group.first_block * self.block_size - first_token
            if start < 0:
                raise ValueError(f"{path} starts at token {first_token}, the load needs {start}")
            n = len(group.block_ids) * self.block_size
            slots = slot_mapping(group.block_ids, self.block_size, n, kv_layer.device)
            scatter_kv(kv_layer, slots, kv[:, start : start + n])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous (all done in `start_load_kv`): nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        group_idx = self._group_of_layer()[layer_name]
        for save in self._metadata().saves:
            group = save.groups[group_idx]
            n = len(group.block_ids) * self.block_size
            slots = slot_mapping(group.block_ids, self.block_size, n, kv_layer.device)
            kv = gather_kv(kv_layer, slots).cpu().contiguous()
            path = self._layer_file(save.key, layer_name)
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_save(
                {"kv_cache": kv}, path, {"first_token": str(group.first_block * self.block_size)}
            )

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        for save in self._metadata().saves:
            marker = self._rank_dir(save.key, self.context.rank) / _COMPLETE
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    safetensors.torch.save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)

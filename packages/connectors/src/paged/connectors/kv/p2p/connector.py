"""`PagedZmqConnector`: prefill/decode disaggregation over ZMQ (seed: KV Transfer, P/D).

vLLM's NixlConnector request protocol, so a vLLM router works unchanged:

    1. router -> prefill  kv_transfer_params {"do_remote_decode": true}, max_tokens 1
    2. prefill: the request finishes (length capped); `request_finished` keeps its
       blocks (delay_free) and returns {"do_remote_prefill": true,
       "do_remote_decode": false, "remote_engine_id", "remote_request_id",
       "remote_block_ids", "remote_host", "remote_port", "tp_size"}
    3. router -> decode   the original request with those params
    4. decode: `get_num_new_matched_tokens` -> (prompt - 1 - local hit, async): blocks
       are allocated, the request waits in WAITING_FOR_REMOTE_KVS while a thread
       pulls the blocks (the engine keeps stepping the others); the last prompt
       token is computed locally, so the first token comes from the decoder
    5. decode acknowledges (DONE): the prefill frees the blocks; a decoder that
       never comes is covered by `abort_request_timeout` (vLLM: 480 s)

With `use_layerwise` the decoder copies a finished pull into its cache layer
by layer during the next forward (staging.py) instead of between steps.

Roles: kv_producer serves blocks, kv_consumer pulls them, kv_both does both.
Equal TP sizes (the handshake checks).

Hybrid models (full + sliding-window KV cache groups, e.g. Gemma 3): the
prefill returns `remote_block_ids` as one list per group (vLLM's HMA form),
each the group's whole block table (0, the null block, before a sliding
window); the decoder pulls, per group, only the blocks its resume needs:
everything for a full-attention group, the window before the resume point
for a sliding-window one (`groups.window_start_block`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from paged.connectors.kv.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from paged.connectors.kv.config import KVTransferConfig
from paged.connectors.kv.groups import GroupLayout, window_start_block
from paged.connectors.kv.p2p import wire
from paged.connectors.kv.p2p.config import ZmqConnectorConfig
from paged.connectors.kv.p2p.handshake import layout_info
from paged.connectors.kv.p2p.puller import BlockPuller, PullResult
from paged.connectors.kv.p2p.sender import BlockSender
from paged.connectors.kv.p2p.staging import StagedPulls
from paged.connectors.kv.p2p.stats import TransferStats
from paged.connectors.kv.p2p.tensors import scatter_blocks
from paged.kvcache import KVCacheBlocks
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    KVConnectorOutput,
    KVTransferParams,
    SchedulerOutput,
)
from paged.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# An idle engine (nothing scheduled, transfers pending) waits this long for
# transfer news per step instead of spinning a core.
_IDLE_WAIT_S = 0.005
_PULLED_REMEMBERED = 4096  # remote requests already pulled (n > 1 siblings come together)


@dataclass
class _PendingPull:
    """Decode side: matched in get_num_new_matched_tokens, awaiting its allocation."""

    params: KVTransferParams
    num_local_tokens: int
    num_external_tokens: int
    remote_groups: list[list[int]]  # the prefill's block ids, per KV cache group


class PagedZmqConnector(KVConnectorBase):
    """See the module docstring; extra-config keys in `paged.connectors.kv.p2p.config`."""

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        self.groups: tuple[GroupLayout, ...] = (
            context.group_layouts() if role is KVConnectorRole.SCHEDULER else ()
        )
        self.zmq_config = ZmqConnectorConfig.from_extra_config(config.kv_connector_extra_config)
        self.engine_id = config.engine_id
        self.block_size = context.block_size
        # Scheduler side.
        self._pending: dict[str, _PendingPull] = {}
        self._loading: set[str] = set()  # WAITING_FOR_REMOTE_KVS until finished_recving
        self._handled: set[str] = set()  # pulled once: a preempted request recomputes
        self._sends: list[wire.SendSpec] = []
        self._recvs: list[wire.RecvSpec] = []
        self._releases: list[wire.ReleaseSpec] = []
        self._waiting_delta = 0
        # Several requests may carry the same remote KV (n > 1 fans one request out):
        # one pulls, the others wait for it and then hit the prefix cache.
        self._remote_loading: dict[tuple[str, str], str] = {}  # remote key -> request pulling
        self._remote_pulled: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._loading_keys: dict[str, tuple[str, str]] = {}  # request -> remote key
        # Worker side (threads start in register_kv_caches).
        self._news = threading.Event()
        self._sender: BlockSender | None = None
        self._puller: BlockPuller | None = None
        self._staging: StagedPulls | None = None  # use_layerwise decoders
        self._layer_index: dict[str, int] = {}
        self._pulling: set[str] = set()
        self._cancelled: set[str] = set()
        self._load_errors: set[int] = set()
        self._recv_stats = TransferStats()
        self._layer_group_list: list[int] = []  # per registered layer, its KV cache group

    # ------------------------------------------------------------------ scheduler side

    def _remote_params(self, request: Request) -> KVTransferParams | None:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill or not self._config.is_kv_consumer:
            return None
        if request.request_id in self._handled:
            return None
        missing = [
            name
            for name in ("remote_engine_id", "remote_host", "remote_port")
            if getattr(params, name) is None
        ]
        if self._remote_groups(params) is None:
            missing.append(
                "remote_block_ids"
                if params.remote_block_ids is None
                and "remote_block_ids" not in (params.extra or {})
                else f"remote_block_ids for {len(self.groups)} KV cache group(s)"
            )
        if missing:
            # As vLLM: a malformed set of params computes the prompt locally.
            logger.warning(
                "request %s: kv_transfer_params with do_remote_prefill lack %s; "
                "computing the prompt locally",
                request.request_id,
                ", ".join(missing),
            )
            self._handled.add(request.request_id)
            return None
        return params

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = self._remote_params(request)
        if params is None:
            return 0, False
        key = _remote_key(params, request)
        puller = self._remote_loading.get(key)
        if puller is not None and puller != request.request_id:
            return None, False  # ask again once the sibling's pull is done
        if key in self._remote_pulled:
            # Pulled once already (and acknowledged: the prefill has freed it); what the
            # prefix cache does not hold is computed here.
            self._handled.add(request.request_id)
            return 0, False
        remote_groups = self._remote_groups(params) or [[]]
        # The last prompt token is computed here: its logits give the first token.
        remote_tokens = min(len(ids) for ids in remote_groups) * self.block_size
        available = min(request.num_prompt_tokens - 1, remote_tokens)
        count = available - num_computed_tokens
        if count > 0 and not self._window_held(remote_groups, available):
            logger.warning(
                "request %s: the prefill no longer holds a sliding window's blocks; "
                "computing the prompt locally",
                request.request_id,
            )
            count = 0
        if count <= 0:
            self._handled.add(request.request_id)
            self._releases.append(_release_spec(params))
            return 0, False
        self._pending[request.request_id] = _PendingPull(
            params, num_computed_tokens, count, remote_groups
        )
        return count, True

    def _window_held(self, remote_groups: list[list[int]], resume: int) -> bool:
        """Whether every sliding-window group's blocks before `resume` are real on the prefill.

        A prefill that decoded past its prompt has freed the oldest window blocks:
        its block table then holds the null block (id 0, the pool's first) there.
        """
        end = -(-resume // self.block_size)
        for layout, ids in zip(self.groups, remote_groups, strict=True):
            if layout.sliding_window is None:
                continue
            first = window_start_block(layout.sliding_window, resume, self.block_size)
            if 0 in ids[first:end]:
                return False
        return True

    def _remote_groups(self, params: KVTransferParams) -> list[list[int]] | None:
        """The prefill's block ids per KV cache group, or None if absent or not ours.

        One group: `remote_block_ids` is a flat list. Hybrid: a list per group,
        which the request's params keep in `extra` (the typed field is flat).
        """
        if params.remote_block_ids is not None:
            return [list(params.remote_block_ids)] if len(self.groups) == 1 else None
        raw = (params.extra or {}).get("remote_block_ids")
        if (
            not isinstance(raw, list)
            or len(raw) != len(self.groups)
            or not all(
                isinstance(ids, list)
                and all(isinstance(b, int) and not isinstance(b, bool) for b in ids)
                for ids in raw
            )
        ):
            return None
        return [list(ids) for ids in raw]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or num_external_tokens == 0:
            return
        self._handled.add(request.request_id)
        params = pending.params
        resume = pending.num_local_tokens + num_external_tokens
        end = -(-resume // self.block_size)
        local_groups = blocks.get_block_ids()
        local_ids: list[int] = []
        remote_ids: list[int] = []
        sizes: list[int] = []
        for g, layout in enumerate(self.groups):
            # A sliding-window group pulls only the window before the resume point.
            first = max(
                pending.num_local_tokens // self.block_size,
                window_start_block(layout.sliding_window, resume, self.block_size),
            )
            local = local_groups[g][first:end]
            local_ids += local
            remote_ids += pending.remote_groups[g][first:end]
            sizes.append(len(local))
        assert params.remote_engine_id is not None and params.remote_host is not None
        assert params.remote_port is not None
        self._recvs.append(
            wire.RecvSpec(
                req_id=request.request_id,
                remote=wire.RemoteAddress(
                    params.remote_engine_id, params.remote_host, params.remote_port
                ),
                remote_request_id=params.remote_request_id or request.request_id,
                local_block_ids=local_ids,
                remote_block_ids=remote_ids,
                group_sizes=sizes if len(self.groups) > 1 else [],
            )
        )
        self._loading.add(request.request_id)
        key = _remote_key(params, request)
        self._remote_loading[key] = request.request_id
        self._loading_keys[request.request_id] = key
        self._waiting_delta += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        meta = wire.ZmqStepMetadata(
            sends=self._sends,
            recvs=self._recvs,
            releases=self._releases,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            finished=(
                sorted(scheduler_output.finished_req_ids) if self.zmq_config.use_layerwise else []
            ),
        )
        self._sends, self._recvs, self._releases = [], [], []
        self._pending.clear()  # admission and allocation happen in the same schedule()
        return wire.ENCODER.encode(meta)

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        req_id = request.request_id
        params = request.kv_transfer_params
        was_handled = req_id in self._handled
        self._handled.discard(req_id)
        self._pending.pop(req_id, None)
        remote = None if was_handled else self._remote_params(request)
        if remote is not None:
            key = _remote_key(remote, request)
            if key not in self._remote_loading and key not in self._remote_pulled:
                # Aborted before any pull started: let the prefill free its blocks
                # now rather than at its abort timeout.
                self._releases.append(_release_spec(remote))
        self._handled.discard(req_id)
        if params is None or not params.do_remote_decode or not self._config.is_kv_producer:
            return False, None
        # As vLLM: only a prefill that ran to its max_tokens hands its KV over
        # (an aborted or stopped request frees its blocks at once).
        if request.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        groups = [list(ids) for ids in block_ids]
        blocks = [b for ids in groups for b in ids]
        if blocks:
            self._sends.append(wire.SendSpec(req_id, blocks))
        extra: dict[str, object] = {"tp_size": self.context.world_size}
        if len(groups) > 1:
            # vLLM's hybrid form: one list per group (the typed field is a flat list).
            extra["remote_block_ids"] = groups
        return bool(blocks), KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.engine_id,
            remote_request_id=req_id,
            remote_block_ids=groups[0] if len(groups) == 1 else None,
            remote_host=self.zmq_config.side_channel_host,
            remote_port=self.zmq_config.side_channel_port,
            remote_num_tokens=request.num_prompt_tokens,
            extra=extra,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving:
            if req_id in self._loading:
                self._loading.discard(req_id)
                self._waiting_delta -= 1
            key = self._loading_keys.pop(req_id, None)
            if key is not None:
                self._remote_loading.pop(key, None)
                self._remote_pulled[key] = None
                while len(self._remote_pulled) > _PULLED_REMEMBERED:
                    self._remote_pulled.popitem(last=False)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        group_of = self._group_of_layer()
        self._layer_group_list = [group_of[name] for name in self._kv_caches]
        info = layout_info(
            self.engine_id,
            self.context.model_name,
            self.block_size,
            self.context.world_size,
            self.context.rank,
            self._kv_caches,
        )
        if self._config.is_kv_producer:
            self._sender = BlockSender(
                self.zmq_config,
                self.context.rank,
                info,
                self._kv_caches,
                self._news,
                self._layer_group_list,
            )
        if self._config.is_kv_consumer:
            self._puller = BlockPuller(self.zmq_config, self.context.rank, info, self._news)
            if self.zmq_config.use_layerwise:
                # The copy has the data in memory: the deadline only guards a starved thread.
                timeout = self.zmq_config.transfer_timeout
                self._staging = StagedPulls(self._kv_caches, timeout)
                self._layer_index = {name: i for i, name in enumerate(self._kv_caches)}

    def _metadata(self) -> wire.ZmqStepMetadata:
        return self._decoded_connector_metadata(wire.ZmqStepMetadata)

    def start_load_kv(self) -> None:
        meta = self._metadata()
        if meta.sends and self._sender is not None:
            self._sender.hold(meta.sends)
        if self._puller is not None:
            for recv in meta.recvs:
                self._pulling.add(recv.req_id)
                self._puller.submit(recv)
            for release in meta.releases:
                self._puller.release(release)
        if self._staging is not None:
            self._staging.drop(meta.finished)
            self._load_errors.update(self._staging.start())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """use_layerwise: wait for this layer's staged copies (else they were done already)."""
        if self._staging is not None and self.has_connector_metadata():
            self._staging.wait(self._layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """The prefill's blocks are served from the paged cache itself: nothing to save."""

    def wait_for_save(self) -> None:
        """use_layerwise: the step's staged copies complete (failures become load errors)."""
        if self._staging is not None:
            self._load_errors.update(self._staging.finish())

    def clear_connector_metadata(self) -> None:
        # A step whose forward raised never reached wait_for_save: stop the copies now.
        if self._staging is not None:
            self._load_errors.update(self._staging.finish())
        super().clear_connector_metadata()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata() and self._metadata().idle:
            self._news.wait(_IDLE_WAIT_S)
        self._news.clear()
        sending = self._sender.take_finished() if self._sender is not None else set()
        recving: set[str] = set()
        # Finished (aborted) while pulling: its blocks may be freed now, as only this
        # thread writes the cache; the bytes, when they come, are dropped.
        for req_id in finished_req_ids & self._pulling:
            self._pulling.discard(req_id)
            self._cancelled.add(req_id)
            recving.add(req_id)
        if self._puller is not None:
            for result in self._puller.collect():
                if self._apply(result):
                    recving.add(result.req_id)
        return sending or None, recving or None

    def _apply(self, result: PullResult) -> bool:
        """Copy a finished pull into the cache; True if its request still waits for it."""
        if result.req_id in self._cancelled:
            self._cancelled.discard(result.req_id)
            return False
        self._pulling.discard(result.req_id)
        stats = self._recv_stats
        stats.seconds += result.seconds
        n = result.num_blocks
        if result.error is None and n:
            try:
                if result.group_sizes:
                    # A hybrid pull is copied at once (layer-wise staging takes one group).
                    n = self._scatter_groups(result)
                else:
                    ids = result.local_block_ids[:n]
                    if self._staging is not None:
                        self._staging.stage(result.req_id, ids, result.frames)
                    else:
                        for cache, frame in zip(
                            self._kv_caches.values(), result.frames, strict=True
                        ):
                            scatter_blocks(cache, ids, frame)
            except ValueError as exc:
                result.error, n = str(exc), 0
        if result.error is not None:
            logger.error("KV pull for request %s failed: %s", result.req_id, result.error)
            stats.failures += 1
        else:
            stats.transfers += 1
            stats.bytes += sum(f.nbytes for f in result.frames)
            if n < len(result.local_block_ids):
                logger.warning(
                    "KV pull for request %s delivered %d of %d blocks; recomputing the rest",
                    result.req_id,
                    n,
                    len(result.local_block_ids),
                )
        self._load_errors.update(result.local_block_ids[n:])
        return True

    def _scatter_groups(self, result: PullResult) -> int:
        """A hybrid pull: each layer gets its group's blocks; all of them, or `ValueError`."""
        if result.num_blocks != len(result.local_block_ids):
            raise ValueError(
                f"{result.num_blocks} of {len(result.local_block_ids)} blocks delivered "
                "(a hybrid pull is all or nothing)"
            )
        groups = wire.split_groups(result.local_block_ids, result.group_sizes)
        caches = zip(self._kv_caches.values(), self._layer_group_list, strict=True)
        for (cache, g), frame in zip(caches, result.frames, strict=True):
            scatter_blocks(cache, groups[g], frame)
        return result.num_blocks

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, float] | None:
        if self._role is KVConnectorRole.SCHEDULER:
            delta, self._waiting_delta = self._waiting_delta, 0
            return {"p2p.requests_waiting_for_remote_kv": float(delta)} if delta else None
        out = self._recv_stats.take("recv")
        if self._sender is not None:
            out.update(self._sender.take_stats())
        return out or None

    def shutdown(self) -> None:
        if self._staging is not None:
            self._staging.finish()
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._puller is not None:
            self._puller.close()
            self._puller = None

    # ------------------------------------------------------------------ for tests

    def num_held_for_decoders(self) -> int:
        """Prefill worker: requests whose blocks are held for a decoder."""
        return self._sender.num_held() if self._sender is not None else 0

    @property
    def sender_endpoints(self) -> list[str]:
        return list(self._sender.endpoints) if self._sender is not None else []


def _remote_key(params: KVTransferParams, request: Request) -> tuple[str, str]:
    return (params.remote_engine_id or "", params.remote_request_id or request.request_id)


def _release_spec(params: KVTransferParams) -> wire.ReleaseSpec:
    assert params.remote_engine_id is not None and params.remote_host is not None
    assert params.remote_port is not None
    return wire.ReleaseSpec(
        wire.RemoteAddress(params.remote_engine_id, params.remote_host, params.remote_port),
        params.remote_request_id or "",
    )

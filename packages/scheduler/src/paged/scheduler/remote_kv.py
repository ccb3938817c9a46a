"""The scheduler side of KV transfer (seed: KV Transfer, WAITING_FOR_REMOTE_KVS 状態管理).

- Async loads: a request parked in WAITING_FOR_REMOTE_KVS becomes schedulable
  once the worker lists it in `finished_recving`; its loaded blocks are then
  registered in the prefix cache (they were allocated with
  `delay_cache_blocks=True`, so nobody could hit half-written blocks).
- Load errors (`invalid_block_ids`): with `kv_load_failure_policy`
  "recompute" the affected requests fall back to recompute from the first
  invalid block; with "fail" they are returned to the caller, which finishes
  them with FINISHED_ERROR. Either way the bad blocks leave the prefix cache.
- Delayed free: a finished request whose blocks a connector is still sending
  keeps them until the worker lists it in `finished_sending`.
"""

from __future__ import annotations

from collections.abc import Mapping

from paged.scheduler.boundary import KVConnectorOutput, KVTransferParams
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.state import SchedulerState


def finish_remote_kv_load(state: SchedulerState, request: Request) -> bool:
    """True (and the request's computed tokens set) if its async load has finished."""
    req_id = request.request_id
    if req_id not in state.finished_recving_kv_req_ids:
        return False
    state.finished_recving_kv_req_ids.discard(req_id)
    # After a load error `kv_load_target_tokens` was cut back to the last valid block.
    state.failed_recving_kv_req_ids.discard(req_id)
    # At least one token must be computed to produce logits.
    target = min(request.kv_load_target_tokens, request.num_tokens - 1)
    if target > 0:
        state.kv.cache_blocks(request, target)
    else:
        # Nothing valid: give the blocks back (a local prefix hit may serve it on retry).
        state.kv.free(request)
    request.num_computed_tokens = target
    request.kv_load_target_tokens = 0
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = target
    return True


def process_connector_output(
    state: SchedulerState, output: KVConnectorOutput, scheduled: dict[str, int]
) -> set[str]:
    """Apply one step's worker feedback; returns the ids whose KV load failed.

    Under "recompute" their step output must be discarded (they were rewound);
    under "fail" the caller must finish them with FINISHED_ERROR.
    """
    if state.kv_connector is not None:
        state.kv_connector.update_connector_output(output)
    add_counters(state.kv_connector_stats, output.kv_connector_stats)
    failed = _handle_invalid_blocks(state, set(output.invalid_block_ids), scheduled)
    for req_id in output.finished_recving:
        request = state.requests.get(req_id)
        if request is None:
            continue
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            state.finished_recving_kv_req_ids.add(req_id)
        elif request.is_finished():
            # Aborted while loading: its blocks were held until now.
            release_blocks(state, request)
    for req_id in output.finished_sending:
        request = state.requests.get(req_id)
        if request is not None and request.is_finished():
            release_blocks(state, request)
    return failed


def _handle_invalid_blocks(
    state: SchedulerState, invalid: set[int], scheduled: dict[str, int]
) -> set[str]:
    if not invalid:
        return set()
    failed: set[str] = set()
    evict = set(invalid)
    block_size = state.block_size
    recompute = state.config.kv_load_failure_policy == "recompute"
    for request in list(state.requests.values()):
        if request.is_finished():
            continue
        loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        # Back from an async load but not admitted yet: a layer-wise connector copies
        # those blocks during a later forward, so their failure can come now.
        loaded_waiting = request.status is RequestStatus.WAITING and request.num_computed_tokens > 0
        if not loading and not loaded_waiting and request.request_id not in scheduled:
            continue
        if not state.kv.coordinator.has_request(request.request_id):
            continue
        block_ids = state.kv.get_block_ids(request.request_id)
        first_bad = _first_invalid_block(block_ids, invalid)
        if first_bad is None:
            continue
        valid_tokens = first_bad * block_size
        if not recompute:
            # "fail": the caller finishes the request. As vLLM, the blocks after
            # the bad one (computed from it) leave the prefix cache with it.
            used = request.kv_load_target_tokens if loading else request.num_computed_tokens
            if valid_tokens < used:
                failed.add(request.request_id)
                for group in block_ids:
                    evict.update(group[first_bad:])
            continue
        if loading:
            if valid_tokens < request.kv_load_target_tokens:
                request.kv_load_target_tokens = valid_tokens
                state.failed_recving_kv_req_ids.add(request.request_id)
        elif loaded_waiting and request.request_id not in scheduled:
            if valid_tokens < request.num_computed_tokens:
                # Nothing ran on it yet: only its count goes back (nothing to discard).
                # With no valid token left it gives its blocks back and is admitted
                # afresh (prefix cache and connector asked again), as an empty load.
                if valid_tokens == 0:
                    state.kv.free(request)
                request.num_computed_tokens = valid_tokens
        elif valid_tokens < request.num_computed_tokens:
            # The tokens computed this step read corrupt KV: recompute from the bad block.
            request.num_computed_tokens = valid_tokens
            failed.add(request.request_id)
    # Before any failed request frees them: no later request may hit bad KV.
    state.kv.evict_blocks(evict)
    return failed


def _first_invalid_block(block_ids: tuple[list[int], ...], invalid: set[int]) -> int | None:
    first: int | None = None
    for group in block_ids:
        for index, block_id in enumerate(group):
            if block_id in invalid:
                first = index if first is None else min(first, index)
                break
    return first


def connector_finished(
    state: SchedulerState, request: Request, was_loading: bool
) -> tuple[bool, KVTransferParams | None]:
    """Ask the connector whether `request`'s blocks must outlive it; returns (delay, params)."""
    delay = was_loading  # the worker may still be writing into its blocks
    params: KVTransferParams | None = None
    if state.kv_connector is not None:
        kv = state.kv
        has_blocks = kv.coordinator.has_request(request.request_id)
        block_ids = kv.get_block_ids(request.request_id) if has_blocks else kv_empty_ids(state)
        connector_delay, params = state.kv_connector.request_finished(request, block_ids)
        delay = delay or connector_delay
    return delay, params


def kv_empty_ids(state: SchedulerState) -> tuple[list[int], ...]:
    return tuple([] for _ in range(state.num_kv_cache_groups))


def release_blocks(state: SchedulerState, request: Request) -> None:
    """Free a finished request's blocks and forget it."""
    state.kv.free(request)
    state.delayed_free_req_ids.discard(request.request_id)
    state.requests.pop(request.request_id, None)


def add_counters(into: dict[str, float], deltas: Mapping[str, float] | None) -> None:
    """Sum connector counter increments into `into`."""
    for name, value in (deltas or {}).items():
        into[name] = into.get(name, 0.0) + value

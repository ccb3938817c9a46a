"""Which encoder inputs a request needs this step, under the encoder budget (seed: MM処理パス §2).

For a request about to compute tokens `[computed, computed + num_new)`, every
multimodal item whose placeholder overlaps that range needs its encoder output
this step. Per item, in prompt order:

    placeholder entirely before `computed`     -> already in the KV cache, skip
    disable_chunked_mm_input and the chunk would end inside the item
                                                -> cut the chunk before the item (to 0 if
                                                   it already started), stop; also for a
                                                   cached item (both unlike vLLM)
    an async EC load of it is in flight         -> cut the chunk before the item, stop
                                                   (the request waits, set aside)
    same mm_hash already chosen for this request -> shared, skip
    encoder cache hit (check_and_update_cache)  -> reuse, skip
    cannot allocate (budget / cache space)      -> cut the chunk before the item
                                                   (or to 0 if it already started), stop
    no embedding position inside the range      -> skip
    the EC connector has it, synchronously      -> load it (cache space, no compute budget)
    the EC connector has it, asynchronously     -> start the load, cut the chunk before
                                                   the item, stop (ec_transfer.py)
    otherwise                                   -> run the encoder (cache space + budget)

An item is encoded whole: its encoder attends bidirectionally across the item.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.multimodal.encoder_cache import EncoderCacheManager
from paged.multimodal.inputs import PlaceholderRange
from paged.scheduler.connectors import ECConnectorScheduler
from paged.scheduler.ec_transfer import ECTransferState
from paged.scheduler.request import Request


@dataclass(slots=True)
class EncoderDecision:
    """Result of `schedule_encoder_inputs` for one request (nothing allocated yet)."""

    num_new_tokens: int
    to_compute: list[int] = field(default_factory=list)
    to_load: list[int] = field(default_factory=list)
    compute_embeds: int = 0  # encoder budget `to_compute` consumes
    # Items whose asynchronous EC load starts now (the chunk stops before the first).
    to_load_async: list[int] = field(default_factory=list)
    # The chunk was cut for an asynchronous load (started now or in flight): the
    # request waits for the worker, so it is set aside, not a head-of-line stop.
    waiting_for_load: bool = False


def _embeds_in_range(pos: PlaceholderRange, start_rel: int, end_rel: int) -> int:
    if pos.is_embed is None:
        return max(end_rel - start_rel, 0)
    return sum(pos.is_embed[start_rel:end_rel])


def schedule_encoder_inputs(
    request: Request,
    num_computed_tokens: int,
    num_new_tokens: int,
    encoder_budget: int,
    encoder_cache: EncoderCacheManager,
    ec_connector: ECConnectorScheduler | None,
    disable_chunked_mm_input: bool,
    ec_transfer: ECTransferState | None = None,
) -> EncoderDecision:
    """Choose the encoder inputs to run or load; may trim `num_new_tokens` (see module doc)."""
    decision = EncoderDecision(num_new_tokens=num_new_tokens)
    if num_new_tokens == 0 or not request.mm_features:
        return decision
    chosen_hashes: set[str] = set()
    num_embeds_to_schedule = 0
    end = num_computed_tokens + num_new_tokens
    for i, feature in enumerate(request.mm_features):
        pos = feature.mm_position
        start_pos, length = pos.offset, pos.length
        if start_pos >= end:
            break  # items are sorted by offset: nothing later is needed this step
        if start_pos + length <= num_computed_tokens:
            continue
        mm_hash = feature.identifier
        # Checked before the cache-hit skip, and also when `computed` is already
        # inside the item (a prefix-cache hit ending mid-image): vLLM checks neither,
        # but a chunk ending inside an image would cut Gemma3's bidirectional
        # attention over it. A started item then waits for a step with room for
        # the rest of it (num_new_tokens 0), which any step has: item <= budget.
        if disable_chunked_mm_input and start_pos < end < start_pos + length:
            decision.num_new_tokens = max(start_pos - num_computed_tokens, 0)
            break
        if ec_transfer is not None and ec_transfer.is_loading(mm_hash):
            ec_transfer.wait_for(mm_hash, request.request_id)
            decision.num_new_tokens = max(start_pos - num_computed_tokens, 0)
            decision.waiting_for_load = True
            break
        if mm_hash in chosen_hashes:
            continue
        if encoder_cache.check_and_update_cache(request, i):
            if ec_transfer is not None:
                ec_transfer.on_cache_hit(mm_hash, request.request_id, encoder_cache)
            continue
        if not encoder_cache.can_allocate(
            request, i, encoder_budget - decision.compute_embeds, num_embeds_to_schedule
        ):
            # Prefix caching can put `computed` past the item's start although
            # its output is gone; then nothing of this request can run now.
            decision.num_new_tokens = max(start_pos - num_computed_tokens, 0)
            break
        start_rel = max(0, num_computed_tokens - start_pos)
        end_rel = min(length, end - start_pos)
        if _embeds_in_range(pos, start_rel, end_rel) == 0:
            continue
        num_embeds = pos.get_num_embeds()
        chosen_hashes.add(mm_hash)
        num_embeds_to_schedule += num_embeds
        loadable = (
            ec_connector is not None
            and (ec_transfer is None or mm_hash not in ec_transfer.failed)
            and ec_connector.has_cache_item(mm_hash, request)
        )
        if loadable and ec_connector is not None and ec_connector.is_async_load(mm_hash):
            decision.to_load_async.append(i)
            decision.num_new_tokens = max(start_pos - num_computed_tokens, 0)
            decision.waiting_for_load = True
            break
        if loadable:
            decision.to_load.append(i)
        else:
            decision.to_compute.append(i)
            decision.compute_embeds += num_embeds
    # A cut chunk may no longer reach items chosen before the cut.
    cut_end = num_computed_tokens + decision.num_new_tokens
    if cut_end < end:
        decision.to_compute = [
            i for i in decision.to_compute if request.mm_features[i].mm_position.offset < cut_end
        ]
        decision.to_load = [
            i for i in decision.to_load if request.mm_features[i].mm_position.offset < cut_end
        ]
        decision.compute_embeds = sum(
            request.get_num_encoder_embeds(i) for i in decision.to_compute
        )
    return decision


def commit_encoder_inputs(
    request: Request,
    decision: EncoderDecision,
    encoder_cache: EncoderCacheManager,
    ec_connector: ECConnectorScheduler | None,
    ec_transfer: ECTransferState | None = None,
) -> None:
    """Allocate cache space for the chosen inputs once the request is actually scheduled."""
    for i in decision.to_compute:
        encoder_cache.allocate(request, i)
        if ec_transfer is not None:
            ec_transfer.encoded_locally(request.mm_features[i].identifier)
    for i in decision.to_load:
        encoder_cache.allocate(request, i)
        if ec_connector is not None:
            ec_connector.update_state_after_alloc(request, i)
    start_async_loads(request, decision, encoder_cache, ec_connector, ec_transfer)


def start_async_loads(
    request: Request,
    decision: EncoderDecision,
    encoder_cache: EncoderCacheManager,
    ec_connector: ECConnectorScheduler | None,
    ec_transfer: ECTransferState | None,
) -> None:
    """Start the decision's asynchronous loads, even when the request runs no token now."""
    if ec_connector is None or ec_transfer is None:
        return
    for i in decision.to_load_async:
        ec_transfer.start_async_load(request, i, encoder_cache, ec_connector)
    decision.to_load_async = []  # started once, even if called again for this decision


def free_consumed_encoder_inputs(request: Request, encoder_cache: EncoderCacheManager) -> None:
    """Drop references to items whose placeholder is fully computed (now in the KV cache)."""
    for i in encoder_cache.get_cached_input_ids(request):
        pos = request.mm_features[i].mm_position
        if pos.offset + pos.length <= request.num_computed_tokens:
            encoder_cache.free_encoder_input(request, i)

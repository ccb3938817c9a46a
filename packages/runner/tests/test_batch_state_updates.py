"""update_states + prepare_inputs against a naive model of the scheduler's diffs (no model needed).

Random step sequences mix new requests, prefill chunks, decodes, requests left
unscheduled for a step, preemption with resume on fresh blocks, and finished
requests. After every step the flat inputs must equal what a naive
per-request walk computes: token ids, positions, slots, seq_lens, sampling rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.attention.backends import AttentionMetadataBuilder
from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.input_prep import InputBuffers, prepare_inputs
from paged.runner.state_updates import update_states
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

B = 4
MAX_LEN = 48
MAX_TOKENS = 40
MAX_REQS = 4


@dataclass
class Sim:
    rid: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False
    preempted: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def _step(
    rng: random.Random, sims: dict[str, Sim], free: list[int], next_id: list[int]
) -> tuple[SchedulerOutput, dict[str, int]]:
    finished: list[str] = []
    preempted: list[str] = []
    for rid, s in list(sims.items()):
        r = rng.random()
        if s.sent and not s.preempted and r < 0.08:
            finished.append(rid)
            free.extend(s.blocks)
            del sims[rid]
        elif s.sent and not s.preempted and r < 0.16:
            preempted.append(rid)
            free.extend(s.blocks)
            s.blocks, s.computed, s.preempted = [], 0, True
    if len(sims) < MAX_REQS and rng.random() < 0.5:
        rid = f"q{next_id[0]}"
        next_id[0] += 1
        sims[rid] = Sim(rid, [rng.randrange(100) for _ in range(rng.randint(1, 12))])
    rng.shuffle(free)
    plan: dict[str, int] = {}
    budget = MAX_TOKENS
    new_reqs = []
    c: dict[str, list[Any]] = {k: [] for k in ("ids", "res", "tok", "blk", "comp", "out")}
    for rid, s in sims.items():
        remaining = len(s.tokens) - s.computed
        if rid in preempted or remaining <= 0 or budget <= 0 or rng.random() < 0.15:
            continue
        if len(s.tokens) >= MAX_LEN - 1:
            continue
        n = rng.randint(1, min(remaining, budget))
        need = -(-(s.computed + n) // B) - len(s.blocks)
        new_blocks = [free.pop() for _ in range(need)]
        s.blocks.extend(new_blocks)
        plan[rid] = n
        budget -= n
        if not s.sent:
            new_reqs.append(NewRequestData(rid, s.prompt, SamplingParams(), (list(s.blocks),), 0))
            s.sent = True
        else:
            resumed = s.preempted
            c["ids"].append(rid)
            c["res"].append(resumed)
            c["tok"].append(list(s.output) if resumed else [])
            c["blk"].append(
                (list(s.blocks),) if resumed else ((new_blocks,) if new_blocks else None)
            )
            c["comp"].append(s.computed)
            c["out"].append(len(s.output))
            s.preempted = False
    so = SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=CachedRequestData(
            c["ids"], c["res"], c["tok"], c["blk"], c["comp"], c["out"]
        ),
        num_scheduled_tokens=plan,
        total_num_scheduled_tokens=sum(plan.values()),
        finished_req_ids=finished,
        preempted_req_ids=preempted,
    )
    return so, plan


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_inputs_match_naive_walk(seed: int) -> None:
    rng = random.Random(seed)
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_TOKENS, "cpu", 128, block_sizes=[B])
    buffers = InputBuffers(MAX_TOKENS, MAX_REQS, batch.device)
    requests: dict[str, CachedRequestState] = {}
    sims: dict[str, Sim] = {}
    free = list(range(1, 200))
    next_id = [0]
    for _ in range(25):
        so, plan = _step(rng, sims, free, next_id)
        update_states(requests, batch, so, batch.device)
        batch.check_integrity()
        assert set(requests) == {rid for rid, s in sims.items() if s.sent}
        assert sorted(batch.req_ids) == sorted(plan)
        if not plan:
            continue
        inputs = prepare_inputs(batch, plan, buffers, AttentionMetadataBuilder())
        meta = inputs.attn_metadata
        ids, pos = inputs.input_ids.tolist(), inputs.positions.tolist()
        slots = meta.slot_mapping.tolist()
        start = 0
        for row, rid in enumerate(inputs.req_ids):
            s, n = sims[rid], plan[rid]
            want_pos = list(range(s.computed, s.computed + n))
            assert pos[start : start + n] == want_pos
            assert ids[start : start + n] == s.tokens[s.computed : s.computed + n]
            assert slots[start : start + n] == [s.blocks[p // B] * B + p % B for p in want_pos]
            assert int(meta.seq_lens[row]) == s.computed + n
            assert int(meta.query_start_loc[row + 1]) == start + n
            samples = s.computed + n == len(s.tokens)
            assert (row in inputs.sampling_rows.tolist()) == samples
            start += n
            s.computed += n
        # Play the runner's sampling: append a token to each sampling row.
        for row in inputs.sampling_rows.tolist():
            rid = inputs.req_ids[row]
            tok = rng.randrange(100)
            batch.append_token_ids(row, [tok])
            requests[rid].output_token_ids.append(tok)
            sims[rid].output.append(tok)
        assert np.array_equal(
            batch.num_tokens[: batch.num_reqs],
            [len(sims[r].tokens) for r in batch.req_ids],
        )


def test_bad_diffs_are_value_errors() -> None:
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_TOKENS, "cpu", 128, block_sizes=[B])
    requests: dict[str, CachedRequestState] = {}
    lora = NewRequestData("a", [1, 2], SamplingParams(), ([1],), 0, lora_request="adapter")
    with pytest.raises(ValueError, match="LoRA"):
        update_states(requests, batch, SchedulerOutput(scheduled_new_reqs=[lora]), batch.device)
    short = CachedRequestData(["a"], [False], [], [None], [0], [0])
    with pytest.raises(ValueError, match="new_token_ids has 0 entries"):
        update_states(requests, batch, SchedulerOutput(scheduled_cached_reqs=short), batch.device)
    with pytest.raises(ValueError, match="neither a new nor a cached"):
        update_states(
            requests, batch, SchedulerOutput(num_scheduled_tokens={"zz": 1}), batch.device
        )


def test_lora_requests_need_lora_enabled() -> None:
    """Refused without --enable-lora (naming it); with it the state carries the adapter name."""
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_TOKENS, "cpu", 128, block_sizes=[B])
    requests: dict[str, CachedRequestState] = {}
    lora = NewRequestData(
        "a", [1, 2], SamplingParams(), ([1],), 0, lora_request="adapter", lora_path="/x"
    )
    step = SchedulerOutput(scheduled_new_reqs=[lora], num_scheduled_tokens={"a": 2})
    with pytest.raises(ValueError, match=r"LoRA is not enabled.*--enable-lora"):
        update_states(requests, batch, step, batch.device)
    update_states(requests, batch, step, batch.device, lora_enabled=True)
    assert requests["a"].lora_request == "adapter" and batch.req_ids == ["a"]

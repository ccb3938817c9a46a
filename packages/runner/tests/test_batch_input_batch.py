"""InputBatch: add/remove/condense/swap keep rows, tokens and sampling state together."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.sampler.build import build_sampling_metadata
from paged.scheduler.sampling_params import SamplingParams

VOCAB = 50


def make_state(i: int, n_prompt: int = 3, n_out: int = 1, **sp: object) -> CachedRequestState:
    params = SamplingParams(**sp)  # type: ignore[arg-type]
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return CachedRequestState(
        req_id=f"r{i}",
        prompt_token_ids=[(i * 7 + k) % VOCAB for k in range(n_prompt)],
        sampling_params=params,
        block_ids=([i, i + 100],),
        num_computed_tokens=n_prompt,
        output_token_ids=[(i + 1) % VOCAB] * n_out,
        generator=gen,
    )


def make_batch(max_reqs: int = 8) -> InputBatch:
    return InputBatch(max_reqs, 32, 64, "cpu", VOCAB, block_sizes=[4], eos_token_ids=[2])


def check_row(batch: InputBatch, state: CachedRequestState) -> None:
    row = batch.req_id_to_index[state.req_id]
    n = state.num_tokens
    assert batch.num_tokens[row] == n
    assert batch.num_prompt_tokens[row] == state.num_prompt_tokens
    assert batch.token_ids_cpu[row, :n].tolist() == state.prompt_token_ids + state.output_token_ids
    assert batch.block_table[0].row(row) == state.block_ids[0]
    sp = state.sampling_params
    assert batch.top_p.np[row] == pytest.approx(sp.top_p)
    assert bool(batch.is_greedy[row]) == sp.is_greedy
    assert (row in batch.generators) == (sp.seed is not None)
    assert (row in batch.logit_bias) == bool(sp.logit_bias)


def test_add_remove_condense_example() -> None:
    batch = make_batch()
    states = [make_state(i, top_p=0.5 + i / 10) for i in range(5)]
    for s in states:
        batch.add_request(s)
    batch.remove_request("r1")
    batch.remove_request("r3")
    assert batch.add_request(make_state(9)) == 1  # lowest hole is reused
    batch.remove_request("r9")
    batch.condense()
    assert batch.req_ids == ["r0", "r4", "r2"]
    batch.check_integrity()
    for s in (states[0], states[2], states[4]):
        check_row(batch, s)


def test_errors() -> None:
    batch = make_batch(max_reqs=1)
    batch.add_request(make_state(0))
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(make_state(0))
    with pytest.raises(ValueError, match="batch is full"):
        batch.add_request(make_state(1))
    with pytest.raises(ValueError, match="max_model_len"):
        batch.append_token_ids(0, [1] * 40)
    with pytest.raises(ValueError, match="logit_bias"):
        make_batch().add_request(make_state(3, logit_bias={VOCAB + 1: 1.0}))
    assert batch.remove_request("nope") is None


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "condense", "swap", "append"]), st.integers(0, 30)
        ),
        max_size=40,
    )
)
def test_random_ops_keep_rows_consistent(ops: list[tuple[str, int]]) -> None:
    batch = make_batch()
    live: dict[str, CachedRequestState] = {}
    next_id = 0
    for op, arg in ops:
        if op == "add" and batch.num_reqs < batch.max_num_reqs:
            kw: dict[str, object] = {"temperature": 0.0 if arg % 2 else 0.7}
            if arg % 3 == 0:
                kw["seed"] = arg
            if arg % 5 == 0:
                kw["logit_bias"] = {arg % VOCAB: 1.5}
            if arg % 4 == 0:
                kw["min_tokens"] = 2
            s = make_state(next_id, n_prompt=1 + arg % 4, n_out=arg % 3, **kw)
            next_id += 1
            batch.add_request(s)
            live[s.req_id] = s
        elif op == "remove" and live:
            rid = sorted(live)[arg % len(live)]
            batch.remove_request(rid)
            del live[rid]
        elif op == "condense":
            batch.condense()
            assert sorted(batch.req_ids) == sorted(live)
            assert all(r is not None for r in batch._req_ids)
        elif op == "swap" and len(live) >= 2:
            batch.condense()
            a, b = arg % batch.num_reqs, (arg + 1) % batch.num_reqs
            batch.swap_states(a, b)
        elif op == "append" and live:
            rid = sorted(live)[arg % len(live)]
            batch.append_token_ids(batch.req_id_to_index[rid], [arg % VOCAB])
            live[rid].output_token_ids.append(arg % VOCAB)
        batch.check_integrity()
        for s in live.values():
            check_row(batch, s)


def test_sampling_metadata_flags_and_subset() -> None:
    batch = make_batch()
    batch.add_request(make_state(0, temperature=0.0))
    batch.add_request(make_state(1, temperature=0.8, top_k=5, seed=3))
    batch.add_request(make_state(2, temperature=0.0, presence_penalty=0.5, logprobs=3))
    meta = build_sampling_metadata(batch, np.array([1, 2]))
    assert meta.num_rows == 2 and not meta.all_greedy and not meta.all_random
    assert meta.temperature_is_greedy is not None
    assert meta.temperature_is_greedy.tolist() == [False, True]
    assert meta.top_k is not None and meta.top_k.tolist() == [5, VOCAB]
    assert meta.top_p is None and meta.min_p is None
    assert set(meta.generators) == {0}
    assert not meta.no_penalties and meta.max_num_logprobs == 3
    only_greedy = build_sampling_metadata(batch, np.array([0]))
    assert only_greedy.all_greedy and only_greedy.temperature is None
    assert only_greedy.no_penalties and only_greedy.max_num_logprobs is None

"""The C attention for short query runs (cpu_step/attention.c) against paged.kernels.reference.

Three promises: (1) the cache write is reshape_and_cache's, byte for byte;
(2) every output row is the float32 reference attention rounded once to
bfloat16 (bounded by one bfloat16 rounding step); (3) a row of a multi-row
request (speculative verification) is bit for bit the row a one-row request at
the same position (plain decode) gets. Bad layouts raise ValueError before any
attention runs; the attention layer routes short-run steps to the C call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.kernels import reference
from paged.runner.attention import cpu_decode
from paged.runner.attention.backends import AttentionBackend
from paged.runner.attention.layer import Attention
from paged.runner.attention.metadata import AttentionMetadata
from paged.runner.cpu_step import attention_ops

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not attention_ops.available(), reason="no C compiler")


class Case:
    """A random paged cache and one step: request r has q_lens[r] new rows, seq_lens[r] keys."""

    def __init__(
        self, q_lens: list[int], seq_lens: list[int], block_size: int, hq: int, hkv: int,
        d: int, seed: int,
    ) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        r = len(seq_lens)
        width = max(-(-s // block_size) for s in seq_lens) + 1
        num_blocks = r * width + 2
        self.hq, self.hkv, self.d, self.block_size = hq, hkv, d, block_size
        self.key_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(BF16)
        self.value_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(BF16)
        perm = torch.randperm(num_blocks, generator=gen)[: r * width]
        self.table = perm.view(r, width).to(torch.int32)
        self.q_lens, self.seq_lens_list = q_lens, seq_lens
        starts = [0]
        for q_len in q_lens:
            starts.append(starts[-1] + q_len)
        self.qsl = torch.tensor(starts, dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        slots = [
            int(self.table[i, p // block_size]) * block_size + p % block_size
            for i, (q_len, s) in enumerate(zip(q_lens, seq_lens, strict=True))
            for p in range(s - q_len, s)
        ]
        self.slots = torch.tensor(slots, dtype=torch.int64)
        t = starts[-1]
        self.q = (torch.randn(t, hq * d, generator=gen) * 2).to(BF16)
        self.k = torch.randn(t, hkv * d, generator=gen).to(BF16)
        self.v = torch.randn(t, hkv * d, generator=gen).to(BF16)

    def run(self, window: int | None, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(C output, float32 reference output), each [T, Hq*D]; checks the cache write."""
        t, d = self.q.shape[0], self.d
        ref_k, ref_v = self.key_cache.clone(), self.value_cache.clone()
        reference.reshape_and_cache(
            self.k.view(t, self.hkv, d), self.v.view(t, self.hkv, d), ref_k, ref_v, self.slots
        )
        want = reference.paged_attention(
            self.q.view(t, self.hq, d).float(), ref_k.float(), ref_v.float(), self.table,
            self.qsl, self.seq_lens, 0.125, max_query_len=max(self.q_lens),
            max_seq_len=max(self.seq_lens_list), sliding_window=window, soft_cap=cap,
        )  # fmt: skip
        got = attention_ops.attention_rows(
            self.q, self.k, self.v, self.key_cache, self.value_cache, self.slots, self.table,
            self.qsl, self.seq_lens, 0.125, window, cap,
        )  # fmt: skip
        assert torch.equal(self.key_cache, ref_k) and torch.equal(self.value_cache, ref_v)
        return got, want.reshape(t, -1)

    def one_row(self, req: int, row: int, window: int | None, cap: float | None) -> torch.Tensor:
        """Request `req`'s row `row` attended alone, as a decode row at its position."""
        t0 = int(self.qsl[req]) + row
        pos = self.seq_lens_list[req] - self.q_lens[req] + row
        return attention_ops.attention_rows(
            self.q[t0 : t0 + 1], self.k[t0 : t0 + 1], self.v[t0 : t0 + 1],
            self.key_cache, self.value_cache, torch.tensor([-1]), self.table[req : req + 1],
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([pos + 1], dtype=torch.int32),
            0.125, window, cap,
        )  # fmt: skip


def _within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (bf16) is want (float32) rounded once: |diff| <= 2^-8 |want| + float slack."""
    diff = (got.float() - want).abs()
    bound = want.abs() * 2**-8 + 1e-5
    assert bool((diff <= bound).all()), float((diff - bound).max())


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "block_size", "window", "cap"),
    [
        (9, 3, 64, 16, None, None),  # the default model's shape
        (9, 3, 64, 16, 40, None),
        (8, 2, 64, 16, None, 30.0),
        (4, 4, 40, 5, None, None),  # a head size off the vector width: the portable path
        (4, 1, 256, 32, 24, 50.0),  # Gemma-style head size, blocks of two chunks
    ],
)
def test_matches_the_reference_for_decode_and_verification_rows(
    hq: int, hkv: int, d: int, block_size: int, window: int | None, cap: float | None
) -> None:
    case = Case([1, 4, 8, 1, 16], [1, 20, 100, 250, 60], block_size, hq, hkv, d, seed=hq + d)
    got, want = case.run(window, cap)
    assert got.shape == (sum(case.q_lens), hq * d)
    _within_one_rounding(got, want)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 4, 16, 20, 32]),
    heads=st.sampled_from([(1, 1), (9, 3), (4, 2)]),
    d=st.sampled_from([16, 24, 64]),
    window=st.one_of(st.none(), st.integers(1, 70)),
    cap=st.one_of(st.none(), st.just(20.0)),
)
def test_verification_rows_are_decode_rows_bit_for_bit(
    data: st.DataObject, block_size: int, heads: tuple[int, int], d: int,
    window: int | None, cap: float | None,
) -> None:  # fmt: skip
    n = data.draw(st.integers(1, 4))
    seq_lens = data.draw(st.lists(st.integers(1, 150), min_size=n, max_size=n))
    q_lens = [data.draw(st.integers(1, min(s, 9))) for s in seq_lens]
    case = Case(q_lens, seq_lens, block_size, heads[0], heads[1], d, seed=sum(seq_lens))
    got, want = case.run(window, cap)
    _within_one_rounding(got, want)
    for req in range(n):
        for row in range(q_lens[req]):
            t = int(case.qsl[req]) + row
            assert torch.equal(case.one_row(req, row, window, cap)[0], got[t]), (req, row)


def test_the_portable_c_path_matches_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled without AVX-512 (the plain loops): the same promises."""
    lib = attention_ops._build_and_load("cc", [*attention_ops._FLAGS, "-mno-avx512f"])
    assert lib is not None
    monkeypatch.setattr(attention_ops, "_lib", lambda: lib)
    case = Case([1, 4, 8, 1], [1, 20, 100, 250], 16, 9, 3, 64, seed=11)
    got, want = case.run(30, None)
    _within_one_rounding(got, want)
    for req, row in [(1, 2), (2, 0), (2, 7), (3, 0)]:
        t = int(case.qsl[req]) + row
        assert torch.equal(case.one_row(req, row, 30, None)[0], got[t])


def test_the_float32_avx512_path_matches_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled without AVX512-BF16 (keys widened to float32, the pair path off): the same
    promises at the default model's shape, prefill chunks included."""
    lib = attention_ops._build_and_load("cc", [*attention_ops._FLAGS, "-mno-avx512bf16"])
    assert lib is not None
    monkeypatch.setattr(attention_ops, "_lib", lambda: lib)
    case = Case([1, 4, 40, 1], [1, 20, 100, 250], 16, 9, 3, 64, seed=12)
    got, want = case.run(None, None)
    _within_one_rounding(got, want)
    for req, row in [(1, 2), (2, 0), (2, 39), (3, 0)]:
        t = int(case.qsl[req]) + row
        assert torch.equal(case.one_row(req, row, None, None)[0], got[t])


def test_padding_slots_are_skipped_and_bad_layouts_raise() -> None:
    case = Case([1, 2], [5, 9], 4, 2, 1, 64, seed=3)

    def call(
        slots: torch.Tensor = case.slots, table: torch.Tensor = case.table,
        seq_lens: torch.Tensor = case.seq_lens, query: torch.Tensor = case.q,
    ) -> torch.Tensor:  # fmt: skip
        return attention_ops.attention_rows(
            query, case.k, case.v, case.key_cache, case.value_cache, slots, table, case.qsl,
            seq_lens, 0.1, None, None,
        )  # fmt: skip

    padded = case.slots.clone()
    padded[1] = -1
    before = case.key_cache.clone()
    call(slots=padded)
    flat_before, flat_after = before.view(-1, 64), case.key_cache.view(-1, 64)
    assert torch.equal(flat_after[int(case.slots[1])], flat_before[int(case.slots[1])])
    assert torch.equal(flat_after[int(padded[0])], case.k[0])
    bad = case.slots.clone()
    bad[2] = case.key_cache.shape[0] * 4
    with pytest.raises(ValueError, match="slot"):
        call(slots=bad)
    table = case.table.clone()
    table[1, 0] = 10_000
    with pytest.raises(ValueError, match="block"):
        call(table=table)
    with pytest.raises(ValueError, match="block"):  # more keys than the table's columns hold
        call(seq_lens=torch.tensor([5, 4 * case.table.shape[1] + 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_start_loc"):  # 2 rows for a 1-token request
        call(seq_lens=torch.tensor([5, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slots=case.slots[:2])
    with pytest.raises(ValueError, match="query"):
        call(query=case.q.float())


def _metadata(case: Case, **extra: object) -> AttentionMetadata:
    fields: dict[str, object] = dict(
        num_actual_tokens=int(case.qsl[-1]), query_start_loc=case.qsl, seq_lens=case.seq_lens,
        block_table=case.table, slot_mapping=case.slots, max_query_len=max(case.q_lens),
        max_seq_len=max(case.seq_lens_list),
    )  # fmt: skip
    fields.update(extra)
    return AttentionMetadata(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 5, 3]])
def test_the_layer_takes_the_c_call_for_short_runs_and_shares_one_plan(q_lens: list[int]) -> None:
    case = Case(q_lens, [3, 40, 77], 16, 9, 3, 64, seed=5)
    meta = _metadata(case)
    t = int(case.qsl[-1])
    layer = Attention(9, 64, 0.125, 3, backend=AttentionBackend("torch"))
    kv = torch.stack([case.key_cache, case.value_cache])
    torch_kv = kv.clone()
    got = layer(case.q, case.k, case.v, kv, meta)
    plan = cpu_decode.decode_plan(meta, t)
    assert plan is not None and cpu_decode.decode_plan(meta, t) is plan  # once per step
    # the float32 reference on the bytes the torch path writes (its SDPA runs
    # multi-row chunks in bf16, coarser than this call; decode rows in float32)
    reference.reshape_and_cache(
        case.k.view(t, 3, 64), case.v.view(t, 3, 64), torch_kv[0], torch_kv[1], case.slots
    )
    assert torch.equal(kv, torch_kv)
    want = reference.paged_attention(
        case.q.view(t, 9, 64).float(), torch_kv[0].float(), torch_kv[1].float(), case.table,
        case.qsl, case.seq_lens, 0.125, max_query_len=max(q_lens), max_seq_len=77,
    )  # fmt: skip
    _within_one_rounding(got, want.reshape(t, -1))


@pytest.mark.parametrize(("window", "cap"), [(None, None), (50, None), (None, 30.0)])
def test_a_step_with_prefill_chunks_takes_the_c_call_for_every_row(
    window: int | None, cap: float | None
) -> None:
    """Prefill chunks (whole prompts, or a later chunk over cached keys) and decode rows in
    one C call: every row the float32 reference rounded once, each row's bits its own."""
    case = Case([64, 1, 200, 3], [64, 300, 250, 30], 16, 9, 3, 64, seed=6)
    meta = _metadata(case)
    plan = cpu_decode.decode_plan(meta, 268)
    assert isinstance(plan, cpu_decode.DecodePlan) and plan.max_query_len == 200
    layer = Attention(9, 64, 0.125, 3, backend=AttentionBackend("torch"), sliding_window=window,
                      logits_soft_cap=cap)  # fmt: skip
    kv = torch.stack([case.key_cache, case.value_cache])
    got = layer(case.q, case.k, case.v, kv, meta)
    case.key_cache, case.value_cache = kv[0], kv[1]  # written by the layer
    _, want = case.run(window, cap)  # the reference (rewrites the same cache bytes)
    _within_one_rounding(got, want)
    for req, row in [(0, 0), (0, 63), (1, 0), (2, 0), (2, 117), (2, 199), (3, 2)]:
        t = int(case.qsl[req]) + row
        assert torch.equal(case.one_row(req, row, window, cap)[0], got[t]), (req, row)


def test_a_step_with_image_spans_keeps_sdpa_for_its_multi_row_requests() -> None:
    """Bidirectional spans are not causal: those requests go to SDPA, one-row ones to C."""
    case = Case([20, 1, 3], [40, 9, 30], 16, 9, 3, 64, seed=6)
    no_span = torch.tensor([[0, 0]], dtype=torch.int32).expand(24, 2).contiguous()
    meta = _metadata(case, bidirectional_ranges=no_span)
    plan = cpu_decode.decode_plan(meta, 24)
    assert isinstance(plan, cpu_decode.SplitPlan)
    assert plan.long_rows.tolist() == [*range(20), 21, 22, 23]
    assert plan.short_rows.tolist() == [20]
    layer = Attention(9, 64, 0.125, 3, backend=AttentionBackend("torch"))
    kv = torch.stack([case.key_cache, case.value_cache])
    got = layer(case.q, case.k, case.v, kv, meta)
    case.key_cache, case.value_cache = kv[0], kv[1]  # written by the layer
    _, want = case.run(None, None)  # the reference (rewrites the same cache bytes)
    _within_one_rounding(got[20:21], want[20:21])  # the C row
    diff = (got.float() - want).abs()  # the bf16 SDPA rows: coarser
    assert bool((diff <= want.abs() * 2**-6 + 2e-2).all())
    assert torch.equal(case.one_row(1, 0, None, None)[0], got[20])


def test_bidirectional_spans_and_padding_rows_keep_the_torch_path() -> None:
    long = Case([17, 20], [40, 29], 16, 9, 3, 64, seed=6)
    assert isinstance(cpu_decode.decode_plan(_metadata(long), 37), cpu_decode.DecodePlan)
    short = Case([2, 1], [40, 9], 16, 9, 3, 64, seed=7)
    ranges = torch.zeros(3, 2, dtype=torch.int32)
    image_step = cpu_decode.decode_plan(_metadata(short, bidirectional_ranges=ranges), 3)
    assert isinstance(image_step, cpu_decode.SplitPlan)  # only the one-row request in C
    assert image_step.short_rows.tolist() == [2]
    assert cpu_decode.decode_plan(_metadata(short), 4) is None  # padding rows: not this call
    assert cpu_decode.decode_plan(_metadata(short), 3) is not None

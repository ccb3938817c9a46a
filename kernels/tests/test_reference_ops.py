"""Reference ops against naive scalar-style computations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.kernels import PAD_SLOT_ID, RopeScaling, compute_cos_sin_cache, reference


# ---------------------------------------------------------------- cache writes and copies
def test_reshape_and_cache_writes_slots_and_skips_padding(gen: torch.Generator) -> None:
    n, b, h, d = 4, 3, 2, 5
    key = torch.randn(6, h, d, generator=gen)
    value = torch.randn(6, h, d, generator=gen)
    kc, vc = torch.zeros(n, b, h, d), torch.zeros(n, b, h, d)
    slots = torch.tensor([7, PAD_SLOT_ID, 0, 11, PAD_SLOT_ID])  # 5 of 6 tokens: last is padding
    reference.reshape_and_cache(key, value, kc, vc, slots)
    want_k, want_v = torch.zeros(n, b, h, d), torch.zeros(n, b, h, d)
    for t, slot in enumerate(slots.tolist()):
        if slot != PAD_SLOT_ID:
            want_k[slot // b, slot % b] = key[t]
            want_v[slot // b, slot % b] = value[t]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_reshape_and_cache_then_gather_round_trips(data: st.DataObject) -> None:
    """Invariant: every non-pad token written to a distinct slot reads back unchanged,
    and no other slot changes."""
    n, b = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    num_tokens = data.draw(st.integers(0, n * b))
    slots = data.draw(st.permutations(list(range(n * b))))[:num_tokens]
    pads = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slot_list = [PAD_SLOT_ID if p else s for s, p in zip(slots, pads, strict=True)]
    key = torch.arange(num_tokens * 2 * 3, dtype=torch.float32).reshape(num_tokens, 2, 3) + 1
    kc, vc = torch.zeros(n, b, 2, 3), torch.zeros(n, b, 2, 3)
    reference.reshape_and_cache(key, -key, kc, vc, torch.tensor(slot_list, dtype=torch.int64))
    flat_k, flat_v = kc.reshape(n * b, 2, 3), vc.reshape(n * b, 2, 3)
    written = {s for s in slot_list if s != PAD_SLOT_ID}
    for t, s in enumerate(slot_list):
        if s != PAD_SLOT_ID:
            assert torch.equal(flat_k[s], key[t]) and torch.equal(flat_v[s], -key[t])
    for s in set(range(n * b)) - written:
        assert flat_k[s].abs().sum() == 0 and flat_v[s].abs().sum() == 0


def test_reshape_and_cache_rejects_bad_input() -> None:
    kc = torch.zeros(2, 2, 1, 4)
    key = torch.zeros(3, 1, 4)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        reference.reshape_and_cache(key, key, kc, kc, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping values"):
        reference.reshape_and_cache(key, key, kc, kc, torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="does not match key_cache"):
        reference.reshape_and_cache(
            torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), kc, kc, torch.tensor([0, 1, 2])
        )


def test_copy_blocks_gathers_and_scatters(gen: torch.Generator) -> None:
    src = torch.randn(5, 2, 3, generator=gen)
    dst = torch.zeros(4, 2, 3)
    reference.copy_blocks(src, dst, torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0]))
    assert (
        torch.equal(dst[1], src[4]) and torch.equal(dst[3], src[0]) and torch.equal(dst[0], src[2])
    )
    assert dst[2].abs().sum() == 0
    with pytest.raises(ValueError, match="dst_block_ids must be in"):
        reference.copy_blocks(src, dst, torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(ValueError, match="block shape"):
        reference.copy_blocks(src, torch.zeros(4, 3, 3), torch.tensor([0]), torch.tensor([0]))


# ---------------------------------------------------------------- rope
def naive_inv_freq(dim: int, base: float, s: RopeScaling | None) -> list[float]:
    freqs = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    if s is None or s.rope_type != "llama3":
        return freqs
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        RopeScaling("linear", factor=4.0),
        RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64),
    ],
)  # fmt: skip
def test_cos_sin_cache_matches_formula(scaling: RopeScaling | None) -> None:
    dim, max_pos, base = 16, 40, 10000.0
    cache = compute_cos_sin_cache(dim, max_pos, base, scaling, torch.float32)
    assert cache.shape == (max_pos, dim)
    inv = naive_inv_freq(dim, base, scaling)
    for p in (0, 1, 17, 39):
        t = p / scaling.factor if scaling is not None and scaling.rope_type == "linear" else p
        want = [math.cos(t * f) for f in inv] + [math.sin(t * f) for f in inv]
        torch.testing.assert_close(cache[p].double(), torch.tensor(want, dtype=torch.float64),
                                   atol=2e-5, rtol=0)  # fmt: skip


def test_rope_scaling_validation() -> None:
    with pytest.raises(ValueError, match="rope_type"):
        RopeScaling("yarn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeScaling("llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        compute_cos_sin_cache(7, 10, 10000.0, None, torch.float32)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_rotary_matches_pairwise_rotation(
    is_neox: bool, rotary_dim: int, gen: torch.Generator
) -> None:
    t, hq, hkv, d = 5, 3, 1, 8
    cache = compute_cos_sin_cache(rotary_dim, 32, 10000.0, None, torch.float32)
    positions = torch.tensor([0, 3, 31, 7, 3])
    q = torch.randn(t, hq * d, generator=gen)
    k = torch.randn(t, hkv * d, generator=gen)
    q0, k0 = q.clone(), k.clone()
    got_q, got_k = reference.rotary_embedding(positions, q, k, d, cache, is_neox)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched
    half = rotary_dim // 2
    for x, got in ((q, got_q), (k, got_k)):
        want = x.clone().reshape(t, -1, d)
        heads = x.reshape(t, -1, d)
        for i, p in enumerate(positions.tolist()):
            for j in range(half):
                cos, sin = cache[p, j].item(), cache[p, half + j].item()
                a, b = (j, j + half) if is_neox else (2 * j, 2 * j + 1)
                x1, x2 = heads[i, :, a], heads[i, :, b]
                want[i, :, a] = x1 * cos - x2 * sin
                want[i, :, b] = x2 * cos + x1 * sin
        torch.testing.assert_close(got, want.reshape(x.shape))


def test_rotary_rejects_out_of_range_positions() -> None:
    cache = compute_cos_sin_cache(4, 8, 10000.0, None, torch.float32)
    with pytest.raises(ValueError, match="positions must be in"):
        reference.rotary_embedding(
            torch.tensor([8]), torch.zeros(1, 4), torch.zeros(1, 4), 4, cache, True
        )
    with pytest.raises(ValueError, match="head_size"):
        reference.rotary_embedding(
            torch.tensor([1]), torch.zeros(1, 6), torch.zeros(1, 4), 4, cache, True
        )


# ---------------------------------------------------------------- norms and activations
@pytest.mark.parametrize("gemma_style", [False, True])
def test_rms_norm_and_fused_add(gemma_style: bool, gen: torch.Generator) -> None:
    x = torch.randn(3, 6, generator=gen)
    res = torch.randn(3, 6, generator=gen)
    w = torch.randn(6, generator=gen)
    eps = 1e-5

    def naive(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        for i in range(rows.shape[0]):
            ms = sum(float(v) ** 2 for v in rows[i]) / rows.shape[1]
            for j in range(rows.shape[1]):
                scale = float(w[j]) + (1.0 if gemma_style else 0.0)
                out[i, j] = float(rows[i, j]) / math.sqrt(ms + eps) * scale
        return out

    torch.testing.assert_close(reference.rms_norm(x, w, eps, gemma_style=gemma_style), naive(x))
    normed, new_res = reference.fused_add_rms_norm(x, res, w, eps, gemma_style=gemma_style)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, naive(x + res))
    with pytest.raises(ValueError, match="weight must be"):
        reference.rms_norm(x, torch.ones(5), eps)
    with pytest.raises(ValueError, match="residual must match"):
        reference.fused_add_rms_norm(x, res[:2], w, eps)


def test_gated_activations(gen: torch.Generator) -> None:
    x = torch.randn(4, 10, generator=gen)
    gate, up = x[:, :5], x[:, 5:]
    silu = gate / (1 + torch.exp(-gate)) * up
    c = math.sqrt(2 / math.pi)
    gelu = 0.5 * gate * (1 + torch.tanh(c * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(reference.silu_and_mul(x), silu)
    torch.testing.assert_close(reference.gelu_tanh_and_mul(x), gelu)
    with pytest.raises(ValueError, match="must be even"):
        reference.silu_and_mul(torch.zeros(2, 3))


def test_half_precision_rounds_once(gen: torch.Generator) -> None:
    x = torch.randn(4, 8, generator=gen).half()
    want = torch.nn.functional.silu(x.float()[:, :4]) * x.float()[:, 4:]
    assert reference.silu_and_mul(x).dtype == torch.float16
    torch.testing.assert_close(reference.silu_and_mul(x), want.half())


# ---------------------------------------------------------------- sampling helpers
def naive_top_k_top_p(row: list[float], k: int | None, p: float | None) -> set[int]:
    """Indices kept, computed from sorted order by hand."""
    kept = set(range(len(row)))
    if k is not None and 0 < k < len(row):
        kth = sorted(row, reverse=True)[k - 1]
        kept = {i for i in kept if row[i] >= kth}
    if p is not None:
        order = sorted(kept, key=lambda i: row[i], reverse=True)
        m = max(row[i] for i in kept)
        z = sum(math.exp(row[i] - m) for i in kept)
        mass, chosen = 0.0, set()
        for i in order:
            chosen.add(i)
            mass += math.exp(row[i] - m) / z
            if mass >= p - 1e-6:
                break
        kept = chosen
    return kept


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.lists(st.integers(-20, 20), min_size=6, max_size=6), min_size=1, max_size=4),
    use_k=st.booleans(),
    use_p=st.booleans(),
    data=st.data(),
)
def test_top_k_top_p_matches_naive(
    logits: list[list[int]], use_k: bool, use_p: bool, data: st.DataObject
) -> None:
    rows = [[v / 4 for v in row] for row in logits]
    batch = len(rows)
    ks = [data.draw(st.integers(-1, 7)) for _ in range(batch)]
    ps = [data.draw(st.sampled_from([0.13, 0.5, 0.87, 1.0])) for _ in range(batch)]
    t = torch.tensor(rows)
    got = reference.apply_top_k_top_p(
        t, torch.tensor(ks) if use_k else None, torch.tensor(ps) if use_p else None
    )
    assert got is t
    for r in range(batch):
        kept = naive_top_k_top_p(rows[r], ks[r] if use_k else None, ps[r] if use_p else None)
        got_kept = {i for i, v in enumerate(got[r].tolist()) if v != float("-inf")}
        if use_p:
            # Tied logits have equal probability, so which member of a tie at the
            # boundary is kept is arbitrary; the count and the value order are not.
            assert len(got_kept) == len(kept)
            dropped = set(range(6)) - got_kept
            assert all(rows[r][i] >= rows[r][j] for i in got_kept for j in dropped)
        else:
            assert got_kept == kept
        for i in got_kept:
            assert got[r, i].item() == rows[r][i]


def test_penalties_match_naive(gen: torch.Generator) -> None:
    logits = torch.randn(2, 6, generator=gen) * 3
    prompt = torch.zeros(2, 6, dtype=torch.bool)
    prompt[0, [1, 2]] = True
    counts = torch.zeros(2, 6, dtype=torch.int64)
    counts[0, 2], counts[0, 4], counts[1, 0] = 3, 1, 2
    pres, freq, rep = torch.tensor([0.5, 0.0]), torch.tensor([0.25, 1.0]), torch.tensor([1.5, 2.0])
    want = logits.clone()
    for b in range(2):
        for v in range(6):
            x = want[b, v].item()
            if prompt[b, v] or counts[b, v] > 0:
                x = x / rep[b].item() if x > 0 else x * rep[b].item()
            x -= freq[b].item() * counts[b, v].item()
            x -= pres[b].item() * (1.0 if counts[b, v] > 0 else 0.0)
            want[b, v] = x
    got = reference.apply_penalties(logits, prompt, counts, pres, freq, rep)
    assert got is logits
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="prompt_mask must be bool"):
        reference.apply_penalties(logits, counts, counts, pres, freq, rep)

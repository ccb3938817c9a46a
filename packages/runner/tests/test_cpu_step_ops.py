"""The fused C ops of the CPU decode step (paged.runner.cpu_step) against paged.kernels.reference.

Norms and rotary are bit-identical to the reference; the gated activations and
the decode attention are float32 maths rounded once to bfloat16, bounded here
by one bfloat16 rounding step. Also: bad inputs raise ValueError before any C
code runs, and everything falls back to torch when the library is off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged.kernels import ops as kernel_ops
from paged.kernels import reference
from paged.runner.attention import cpu_decode, torch_attention
from paged.runner.attention.backends import AttentionBackend
from paged.runner.attention.layer import Attention
from paged.runner.attention.metadata import AttentionMetadata
from paged.runner.cpu_step import build, ops
from paged.runner.layers.layernorm import RMSNorm
from paged.runner.layers.rotary import RotaryEmbedding

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: torch ops only")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _within_one_bf16_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """|got - want| <= one bfloat16 rounding step of want (2^-7 relative) + a tiny floor."""
    diff = (got.float() - want.float()).abs()
    return bool((diff <= want.float().abs() * 2**-7 + 1e-6).all())


@pytest.mark.parametrize("hidden", [8, 48, 576, 577, 1000, 2048, 5120])
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_rms_norm_is_torch_rms_norm_bit_for_bit(hidden: int, scale: float) -> None:
    x = _randn(17, hidden, seed=hidden, scale=scale)
    x[:, 3] *= 50  # an outlier channel, as real residual streams have
    w = _randn(hidden, seed=1).abs()
    want = F.rms_norm(x, (hidden,), w, 1e-5).to(BF16)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), want)  # float32 in
    xb = x.to(BF16)
    want_b = F.rms_norm(xb.float(), (hidden,), w, 1e-5).to(BF16)
    assert torch.equal(ops.rms_norm(xb, w, 1e-5), want_b)
    wide = torch.cat([x, x], dim=1)
    assert torch.equal(ops.rms_norm(wide[:, hidden:], w, 1e-5), want)  # strided rows


def test_add_rms_norm_updates_the_stream_in_place_like_the_reference() -> None:
    x, w = _randn(9, 576, seed=2).to(BF16), _randn(576, seed=4)
    res = _randn(9, 576, seed=3, scale=20)
    want_normed, want_res = reference.fused_add_rms_norm(x.float(), res, w, 1e-6)
    stream = res.clone()
    normed = ops.add_rms_norm_(x, stream, w, 1e-6)
    assert torch.equal(stream, want_res)  # float32 sum, exactly x + residual
    assert torch.equal(normed, want_normed.to(BF16))


def test_rms_norm_module_keeps_a_float32_stream_on_cpu() -> None:
    norm = RMSNorm(64, 1e-6, dtype=BF16)
    norm.load_weight("weight", _randn(64, seed=5), None)
    x = _randn(3, 64, seed=6).to(BF16)
    normed, stream = norm.start_residual(x)
    assert stream.dtype == torch.float32 and torch.equal(stream, x.float())
    assert stream.data_ptr() != x.data_ptr()  # the stream's own copy: x is never written
    assert torch.equal(normed, reference.rms_norm(x, norm.weight, 1e-6))
    delta = _randn(3, 64, seed=7).to(BF16)
    want = reference.fused_add_rms_norm(delta.float(), stream.clone(), norm.weight.float(), 1e-6)
    normed2, stream2 = norm.add_residual_norm_(delta, stream)
    assert stream2 is stream and torch.equal(stream, want[1])
    assert torch.equal(normed2, want[0].to(BF16))


@pytest.mark.parametrize("kind", [ops.SILU, ops.GELU_TANH])
def test_gated_activations_within_one_rounding_of_the_reference(kind: int) -> None:
    x = _randn(6, 2 * 1536, seed=8, scale=3).to(BF16)
    want = reference.silu_and_mul(x) if kind == ops.SILU else reference.gelu_tanh_and_mul(x)
    got = ops.gated_act(x, kind)
    assert got.shape == (6, 1536) and got.dtype == BF16
    assert _within_one_bf16_step(got, want)
    # The C exp (Cephes polynomial) against torch's: silu measured bit-identical on
    # 196k values; gelu (as x * sigmoid(2y), not torch's tanh) 7% one bf16 step apart.
    assert (got != want).float().mean() < (1e-3 if kind == ops.SILU else 0.1)


def test_rotary_is_the_reference_bit_for_bit_on_strided_qkv_views() -> None:
    cache = kernel_ops.compute_cos_sin_cache(64, 4096, 10000.0, None, torch.float32)
    qkv = _randn(5, 64 * (9 + 3 + 3), seed=9).to(BF16)
    q, k = qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64]
    positions = torch.tensor([0, 3, 100, 4095, 7])
    got = ops.rotary_neox(positions, q, k, 64, cache)
    want = reference.rotary_embedding(positions, q, k, 64, cache, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_neox(torch.tensor([0, 1, 2, 3, 4096]), q, k, 64, cache)
    rope = RotaryEmbedding(64, 64, 4096, 10000.0, None)  # the module takes the same call
    got_module = rope(positions.to(torch.int32), q, k)
    assert torch.equal(got_module[0], want[0]) and torch.equal(got_module[1], want[1])


def _paged_case(
    seq_lens: list[int], block_size: int, hq: int, hkv: int, d: int = 64, seed: int = 10
) -> dict[str, torch.Tensor]:
    r = len(seq_lens)
    width = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = r * width + 3
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=gen)[: r * width].view(r, width).to(torch.int32)
    slots = torch.tensor(
        [int(table[i, (s - 1) // block_size]) * block_size + (s - 1) % block_size
         for i, s in enumerate(seq_lens)]
    )  # fmt: skip
    return {
        "key_cache": _randn(num_blocks, block_size, hkv, d, seed=seed + 1).to(BF16),
        "value_cache": _randn(num_blocks, block_size, hkv, d, seed=seed + 2).to(BF16),
        "q": _randn(r, hq * d, seed=seed + 3).to(BF16),
        "k": _randn(r, hkv * d, seed=seed + 4).to(BF16),
        "v": _randn(r, hkv * d, seed=seed + 5).to(BF16),
        "table": table,
        "slots": slots,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "window", "cap"),
    [(9, 3, 16, None, None), (4, 4, 5, None, None), (9, 3, 16, 40, None), (8, 2, 16, None, 30.0)],
)
def test_decode_attention_matches_reference_cache_write_and_attention(
    hq: int, hkv: int, block_size: int, window: int | None, cap: float | None
) -> None:
    seq_lens = [1, 17, 100, 250]
    c = _paged_case(seq_lens, block_size, hq, hkv)
    r, d = len(seq_lens), 64
    ref_k, ref_v = c["key_cache"].clone(), c["value_cache"].clone()
    reference.reshape_and_cache(
        c["k"].view(r, hkv, d), c["v"].view(r, hkv, d), ref_k, ref_v, c["slots"]
    )
    want = reference.paged_attention(
        c["q"].view(r, hq, d), ref_k, ref_v, c["table"], torch.arange(r + 1, dtype=torch.int32),
        c["seq_lens"], 0.125, max_query_len=1, max_seq_len=max(seq_lens),
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip
    got_k, got_v = c["key_cache"].clone(), c["value_cache"].clone()
    got = ops.decode_attention(
        c["q"], c["k"], c["v"], got_k, got_v, c["slots"], c["table"], c["seq_lens"],
        0.125, window, cap,
    )  # fmt: skip
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)  # the same cache bytes
    assert got.shape == (r, hq * d)
    assert _within_one_bf16_step(got, want.reshape(r, -1))


def test_decode_attention_skips_padding_slots_and_rejects_bad_tables() -> None:
    c = _paged_case([5, 9], 4, 2, 1)
    slots = c["slots"].clone()
    slots[1] = -1
    before = c["key_cache"].clone()
    args = (c["q"], c["k"], c["v"], c["key_cache"], c["value_cache"])
    ops.decode_attention(*args, slots, c["table"], c["seq_lens"], 0.125, None, None)
    flat_before, flat_after = before.view(-1, 64), c["key_cache"].view(-1, 64)
    assert torch.equal(flat_after[int(c["slots"][1])], flat_before[int(c["slots"][1])])
    assert torch.equal(flat_after[int(slots[0])], c["k"][0])
    with pytest.raises(ValueError, match="slot"):
        bad = c["slots"].clone()
        bad[0] = c["key_cache"].shape[0] * 4
        ops.decode_attention(*args, bad, c["table"], c["seq_lens"], 0.125, None, None)
    with pytest.raises(ValueError, match="block"):
        table = c["table"].clone()
        table[0, 0] = 10_000
        ops.decode_attention(*args, c["slots"], table, c["seq_lens"], 0.125, None, None)
    with pytest.raises(ValueError, match="block"):  # seq_len needs more columns than the table has
        long = torch.tensor([5, 4 * c["table"].shape[1] + 1], dtype=torch.int32)
        ops.decode_attention(*args, c["slots"], c["table"], long, 0.125, None, None)
    with pytest.raises(ValueError, match="query"):
        ops.decode_attention(c["q"].float(), *args[1:], c["slots"], c["table"], c["seq_lens"],
                             0.125, None, None)  # fmt: skip


def _metadata(c: dict[str, torch.Tensor], max_query_len: int = 1) -> AttentionMetadata:
    r = c["seq_lens"].shape[0]
    return AttentionMetadata(
        num_actual_tokens=r, query_start_loc=torch.arange(r + 1, dtype=torch.int32),
        seq_lens=c["seq_lens"], block_table=c["table"], slot_mapping=c["slots"],
        max_query_len=max_query_len, max_seq_len=int(c["seq_lens"].max()),
    )  # fmt: skip


def test_attention_layer_takes_the_c_path_for_bf16_decode_and_shares_one_plan() -> None:
    c = _paged_case([3, 40, 77], 16, 9, 3)
    meta = _metadata(c)
    layer = Attention(9, 64, 0.125, 3, backend=AttentionBackend("torch"))
    kv = torch.stack([c["key_cache"], c["value_cache"]])
    torch_kv = kv.clone()
    got = layer(c["q"], c["k"], c["v"], kv, meta)
    plan = cpu_decode.decode_plan(meta, 3)
    assert plan is not None and cpu_decode.decode_plan(meta, 3) is plan  # once per step
    r = 3
    torch_attention.reshape_and_cache(
        c["k"].view(r, 3, 64), c["v"].view(r, 3, 64), torch_kv[0], torch_kv[1], c["slots"]
    )
    want = torch_attention.paged_attention(
        c["q"].view(r, 9, 64), torch_kv[0], torch_kv[1], c["table"], meta.query_start_loc,
        c["seq_lens"], 0.125, max_query_len=1, max_seq_len=77,
    )  # fmt: skip
    assert torch.equal(kv, torch_kv)
    assert _within_one_bf16_step(got, want.reshape(r, -1))
    # Not a pure decode step (or float32): the torch path, no plan.
    assert cpu_decode.decode_plan(_metadata(c, max_query_len=2), 3) is None


def test_everything_falls_back_to_torch_when_the_library_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(build.ENABLE_ENV, "off")
    build.forget()
    monkeypatch.setattr(build, "_default", [])  # read again, and restored afterwards
    assert not ops.available()
    norm = RMSNorm(32, 1e-6, dtype=BF16)
    norm.load_weight("weight", _randn(32, seed=11), None)
    x = _randn(2, 32, seed=12).to(BF16)
    assert torch.equal(norm(x), reference.rms_norm(x, norm.weight, 1e-6))
    c = _paged_case([4, 9], 16, 2, 1)
    assert cpu_decode._make_plan(_metadata(c), 2) is None
    monkeypatch.setenv(build.ENABLE_ENV, "maybe")
    with pytest.raises(ValueError, match=build.ENABLE_ENV):
        build.enabled()


def test_a_missing_compiler_logs_and_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    assert build.load_step_ops(compiler="/nonexistent/cc") is None
    assert "unavailable" in caplog.text

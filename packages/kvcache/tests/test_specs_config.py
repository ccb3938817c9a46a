"""Spec page sizes and validation; get_kv_cache_config grouping and sizing."""

from __future__ import annotations

import pytest

from paged.kvcache import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    get_dtype_size,
    get_kv_cache_config,
)

ATTN = {"num_kv_heads": 2, "head_size": 8, "dtype": "bfloat16"}


def test_page_sizes() -> None:
    full = FullAttentionSpec(block_size=16, **ATTN)  # type: ignore[arg-type]
    assert full.page_size_bytes == 2 * 16 * 2 * 8 * 2
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16")
    assert mla.page_size_bytes == 16 * 576 * 2
    mamba = MambaSpec(block_size=16, shapes=((4, 8), (3,)), dtypes=("float32", "float16"))
    assert mamba.page_size_bytes == 4 * 8 * 4 + 3 * 2
    padded = MambaSpec(block_size=16, shapes=((3,),), dtypes=("float16",), page_size_padded=64)
    assert padded.page_size_bytes == 64
    assert full.max_memory_usage_bytes(33) == 3 * full.page_size_bytes
    sink = SinkFullAttentionSpec(block_size=16, sink_len=32, **ATTN)  # type: ignore[arg-type]
    assert sink.max_memory_usage_bytes(33) == 5 * full.page_size_bytes
    assert get_dtype_size("torch.float32") == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_size": 0}, "head_size"),
        ({"dtype": "int3"}, "dtype"),
    ],
)
def test_bad_attention_spec(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"block_size": 16, **ATTN, **kwargs}
    with pytest.raises(ValueError, match=match):
        FullAttentionSpec(**args)  # type: ignore[arg-type]


def test_bad_other_specs() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(block_size=16, sliding_window=0, **ATTN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shapes"):
        MambaSpec(block_size=16, shapes=((4,),), dtypes=())
    with pytest.raises(ValueError, match="page_size_padded"):
        MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",), page_size_padded=3)
    with pytest.raises(ValueError, match="sink_len is required"):
        SinkFullAttentionSpec(block_size=16, **ATTN)  # type: ignore[arg-type]


def test_uniform_config() -> None:
    spec = FullAttentionSpec(block_size=16, **ATTN)  # type: ignore[arg-type]
    specs = {f"layers.{i}": spec for i in range(3)}
    cfg = get_kv_cache_config(specs, available_memory=spec.page_size_bytes * 3 * 100 + 5)
    assert cfg.num_blocks == 100
    assert len(cfg.kv_cache_groups) == 1
    assert cfg.kv_cache_groups[0].layer_names == ["layers.0", "layers.1", "layers.2"]
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [["layers.0"], ["layers.1"], ["layers.2"]]
    assert all(t.size == 100 * spec.page_size_bytes for t in cfg.kv_cache_tensors)
    over = get_kv_cache_config(specs, 10**9, num_gpu_blocks_override=7)
    assert over.num_blocks == 7


def test_hybrid_config_shares_tensors() -> None:
    full = FullAttentionSpec(block_size=16, **ATTN)  # type: ignore[arg-type]
    window = SlidingWindowSpec(block_size=16, sliding_window=128, **ATTN)  # type: ignore[arg-type]
    specs = {
        "l0": window,
        "l1": window,
        "l2": window,
        "l3": full,
        "l4": window,
        "l5": window,
        "l6": window,
        "l7": full,
    }
    cfg = get_kv_cache_config(specs, available_memory=full.page_size_bytes * 2 * 10)
    # 6 window layers and 2 full ones: groups of 2 layers; 2 tensors shared by 4 groups.
    assert [g.layer_names for g in cfg.kv_cache_groups] == [
        ["l0", "l1"],
        ["l2", "l4"],
        ["l5", "l6"],
        ["l3", "l7"],
    ]
    assert cfg.num_blocks == 10
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [
        ["l0", "l2", "l5", "l3"],
        ["l1", "l4", "l6", "l7"],
    ]


def test_differing_page_sizes_are_unified_or_rejected() -> None:
    big = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype="float16")
    small = SlidingWindowSpec(
        block_size=16, sliding_window=64, num_kv_heads=2, head_size=8, dtype="float16"
    )
    cfg = get_kv_cache_config({"a": big, "b": small}, available_memory=big.page_size_bytes * 8)
    sizes = sorted(g.kv_cache_spec.block_size for g in cfg.kv_cache_groups)
    assert sizes == [16, 32]  # the small page doubled its block size
    odd = ChunkedLocalAttentionSpec(
        block_size=16, attention_chunk_size=64, num_kv_heads=3, head_size=8, dtype="float16"
    )
    with pytest.raises(ValueError, match="cannot unify page sizes"):
        get_kv_cache_config({"a": big, "c": odd}, available_memory=10**6)


def test_config_bad_inputs() -> None:
    spec = CrossAttentionSpec(block_size=16, **ATTN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one layer"):
        get_kv_cache_config({}, 100)
    with pytest.raises(ValueError, match="available_memory"):
        get_kv_cache_config({"x": spec}, -1)
    with pytest.raises(ValueError, match="at least 2 are needed"):
        get_kv_cache_config({"x": spec}, spec.page_size_bytes)
    with pytest.raises(ValueError, match="max_model_len"):
        get_kv_cache_config({"x": spec}, spec.page_size_bytes * 4, max_model_len=1000)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        get_kv_cache_config({"x": spec}, 10**6, num_gpu_blocks_override=0)


def test_a_length_that_does_not_fit_names_the_longest_that_does_and_the_flags() -> None:
    spec = FullAttentionSpec(block_size=16, **ATTN)  # type: ignore[arg-type]
    # 10 blocks: 1 null + 9 for the request, so 9 * 16 = 144 tokens fit, 145 do not
    budget = spec.page_size_bytes * 10
    assert get_kv_cache_config({"x": spec}, budget, max_model_len=144).num_blocks == 10
    with pytest.raises(ValueError) as info:
        get_kv_cache_config({"x": spec}, budget, max_model_len=8192)
    message = str(info.value)
    assert "max_model_len=8192" in message
    assert "the estimated maximum model length is 144" in message
    for flag in ("--kv-cache-memory", "VLLM_CPU_KVCACHE_SPACE", "--max-model-len"):
        assert flag in message

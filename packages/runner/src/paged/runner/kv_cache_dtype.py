"""`--kv-cache-dtype`: the dtype the KV cache stores, vLLM 0.33's names.

vLLM 0.33 lists its cache dtypes in vllm/config/cache.py (`CacheDType`, line
44). paged builds the plain ones:

    auto       the model's dtype (no conversion)
    float16    K/V cast to float16 on write, back to the model dtype on read
    bfloat16   likewise in bfloat16
    fp8        = fp8_e4m3 (vLLM: "CUDA 11.8+ supports fp8 (=fp8_e4m3)")
    fp8_e4m3   torch.float8_e4m3fn with one scale for K and one for V per layer
    fp8_e5m2   torch.float8_e5m2, same scales

The fp8 scales are 1.0, vLLM 0.33's default when a checkpoint carries none
(set_default_quant_scales, vllm/model_executor/layers/attention/attention.py:133);
0.33 has no `calculate_kv_scales` option any more, and paged reads no
checkpoint scales yet. The rest of vLLM's list (fp8_inc, fp8_ds_mla, the
nvfp4 / turboquant / octave / per-token-head formats) is refused by name, so a
user learns that paged lacks the format rather than that the name is wrong.

Stdlib only (the CLI checks the flag before torch is imported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from paged.kvcache.specs import AttentionSpec, KVCacheSpec

__all__ = [
    "BUILT_KV_CACHE_DTYPES",
    "VLLM_KV_CACHE_DTYPES",
    "check_kv_cache_dtype",
    "kv_cache_spec_dtype",
    "with_kv_cache_dtype",
]

BUILT_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

# vllm/config/cache.py CacheDType in 0.33.0, in its order.
VLLM_KV_CACHE_DTYPES = (
    *BUILT_KV_CACHE_DTYPES,
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "octave_k3v4",
    "octave_k3v3",
    "octave_k3v3_compact",
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)

# Storage dtype names, as KV cache specs carry them (paged.kvcache.specs).
_SPEC_DTYPES = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def check_kv_cache_dtype(value: str) -> str:
    """`value` if paged builds it; else a ValueError saying whether vLLM knows the name."""
    if value in BUILT_KV_CACHE_DTYPES:
        return value
    built = ", ".join(BUILT_KV_CACHE_DTYPES)
    if value in VLLM_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: {value!r} is a vLLM 0.33 KV cache format that paged does not "
            f"build; use one of {built}"
        )
    raise ValueError(f"kv_cache_dtype: {value!r} is not a KV cache dtype; use one of {built}")


def kv_cache_spec_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype name a layer's KV cache spec stores under `kv_cache_dtype`."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else _SPEC_DTYPES[kv_cache_dtype]


def with_kv_cache_dtype(
    specs: Mapping[str, KVCacheSpec], kv_cache_dtype: str
) -> dict[str, KVCacheSpec]:
    """The model's specs with every attention layer's storage dtype set by `kv_cache_dtype`.

    The page size follows the dtype, so the same byte budget holds more blocks
    (fp8: four times as many as float32, twice as many as bfloat16).
    """
    out: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        if isinstance(spec, AttentionSpec):
            spec = dataclasses.replace(spec, dtype=kv_cache_spec_dtype(kv_cache_dtype, spec.dtype))
        out[name] = spec
    return out

"""Every Triton kernel compiles for a real GPU target (sm_90) without register spills,
and without needing a GPU.

The interpreter runs kernels as Python, so it cannot catch what only the
compiler rejects (constexpr loop carries, unsupported ops, type mismatches).
This compiles each kernel to a CUDA binary with Triton's bundled toolchain in a
subprocess (the test process has TRITON_INTERPRET=1 set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, os, subprocess, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged.kernels.triton_ops import attention_kernels as ak, cache, layers, rotary

def build(fn, types, consts, warps=4):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # What the JIT infers at launch for these args (pointers and strides of the
    # cache layout are multiples of 16), so codegen matches a real launch.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or (n.startswith("stride_") and n != "stride_bt")}
    return ASTSource(fn, sig, consts, attrs), warps

# Launch configurations as choose_launch() makes them.
attn = dict(HEAD_SIZE=128, D_PAD=128, QUERIES_PER_KV=4, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=4,
            BLOCK_N=64, NUM_SEGMENTS=4, USE_SOFT_CAP=True, USE_WINDOW=True, USE_RANGES=False,
            DOT_PRECISION="tf32", KV_FP8=False)
# Gemma3 image prompts: bidirectional spans inside a prefill.
attn_prefill = dict(attn, HEAD_SIZE=256, D_PAD=256, BLOCK_M=64, BLOCK_Q=16, BLOCK_N=32,
                    NUM_SEGMENTS=1, USE_RANGES=True)
attn_fp32 = dict(attn, HEAD_SIZE=80, D_PAD=128, QUERIES_PER_KV=1, BLOCK_M=64, BLOCK_Q=64,
                 BLOCK_N=32, NUM_SEGMENTS=1, USE_SOFT_CAP=False, USE_WINDOW=False,
                 DOT_PRECISION="ieee")
# --kv-cache-dtype fp8: e4m3 cache tiles dequantised into bf16 dots.
attn_fp8 = dict(attn, KV_FP8=True)
def attn_types(dt, cache_dt=None):
    t = {n: f"*{dt}" for n in ("out_ptr", "q_ptr")}
    t.update({n: f"*{cache_dt or dt}" for n in ("k_cache_ptr", "v_cache_ptr")})
    t.update({n: "*fp32" for n in ("seg_out_ptr", "seg_max_ptr", "seg_sum_ptr")})
    t.update({"block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
              "ranges_ptr": "*i32",
              "scale": "fp32", "k_scale": "fp32", "v_scale": "fp32", "soft_cap": "fp32"})
    return t
cases = {
    "attention_bf16_split": build(ak._paged_attention_kernel, attn_types("bf16"), attn),
    "attention_bf16_prefill": build(ak._paged_attention_kernel, attn_types("bf16"),
                                    attn_prefill, 8),
    "attention_fp32": build(ak._paged_attention_kernel, attn_types("fp32"), attn_fp32, 8),
    "attention_bf16_fp8_cache": build(ak._paged_attention_kernel,
                                      attn_types("bf16", "fp8e4nv"), attn_fp8),
    "reduce_segments": build(ak._reduce_segments_kernel,
        {"out_ptr": "*bf16", "seg_out_ptr": "*fp32", "seg_max_ptr": "*fp32",
         "seg_sum_ptr": "*fp32", "query_start_loc_ptr": "*i32"},
        dict(HEAD_SIZE=128, D_PAD=128, NUM_SEGMENTS=4)),
    "reshape_and_cache": build(cache._reshape_and_cache_kernel,
        {"key_ptr": "*fp16", "value_ptr": "*fp16", "key_cache_ptr": "*fp16",
         "value_cache_ptr": "*fp16", "slot_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32"},
        dict(NUM_KV_HEADS=8, HEAD_SIZE=128, BLOCK_SIZE=16, H_PAD=8, D_PAD=128,
             FP8_MANT=0, FP8_MIN_NORMAL=0.0, FP8_MAX=0.0)),
    "reshape_and_cache_fp8": build(cache._reshape_and_cache_kernel,
        {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*fp8e4nv",
         "value_cache_ptr": "*fp8e4nv", "slot_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32"},
        dict(NUM_KV_HEADS=8, HEAD_SIZE=128, BLOCK_SIZE=16, H_PAD=8, D_PAD=128,
             FP8_MANT=3, FP8_MIN_NORMAL=2.0**-6, FP8_MAX=448.0)),
    "copy_blocks": build(cache._copy_blocks_kernel,
        {"src_ptr": "*bf16", "dst_ptr": "*bf16", "src_ids_ptr": "*i64", "dst_ids_ptr": "*i64",
         "num_src_blocks": "i64", "num_dst_blocks": "i64", "block_numel": "i64",
         "stride_src": "i64", "stride_dst": "i64"}, dict(CHUNK=4096)),
    "rms_norm": build(layers._rms_norm_kernel,
        {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
         "residual_out_ptr": "*bf16", "eps": "fp32"},
        dict(HAS_RESIDUAL=True, GEMMA=True, BLOCK_H=4096)),
    "gelu_and_mul": build(layers._gated_kernel, {"x_ptr": "*fp16", "out_ptr": "*fp16"},
        dict(ACT=1, BLOCK=1024)),
    "rotary": build(rotary._rotary_kernel,
        {"positions_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cache_ptr": "*fp32"},
        dict(HEAD_SIZE=128, HALF=64, IS_NEOX=False, HQ_PAD=32, HKV_PAD=8, HALF_PAD=64)),
}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
done = {}
for name, (src, warps) in cases.items():
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
    except Exception as exc:  # report every failure, not just the first
        done[name] = f"{type(exc).__name__}: {exc}"[:2000]
        continue
    done[name] = "ok"
    if os.path.exists(cuobjdump):  # register spills show up as a stack frame
        path = os.path.join(os.environ["OUT_DIR"], name + ".cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                               text=True).stdout
        if "STACK:0 " not in usage:
            done[name] = "spills registers: " + usage[-300:]
print(json.dumps(done))
"""


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["OUT_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900
    )
    if proc.returncode != 0:
        if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
            pytest.skip("Triton's bundled ptxas is not available")
        pytest.fail(proc.stderr[-4000:])
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert failed == {}, failed
    assert len(results) == 11

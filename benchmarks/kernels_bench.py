"""Paged attention benchmark: decode bandwidth and prefill throughput, vs SDPA.

On CUDA (Triton backend): decode attention for batch sizes 1..256 and contexts
512..32k, reporting achieved GB/s (K/V bytes read / time) and the fraction of
the device's measured copy bandwidth, and prefill TFLOP/s; both next to
``torch.nn.functional.scaled_dot_product_attention`` on the same work (dense
K/V already gathered, and including the gather from the paged cache), and
compiled FlexAttention for prefill when it is available. On CPU it
runs the torch *reference* path on small shapes and says so in the JSON.

Prints one JSON line. ``python benchmarks/kernels_bench.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from paged.kernels import ops
from paged.kernels.testing import PagedBatch, make_paged_batch


@dataclass(frozen=True, slots=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype


def _timer(device: torch.device, fn: Callable[[], object], iters: int) -> float:
    """Seconds per call after one warm-up call.

    CUDA: mean over ``iters`` back-to-back launches between two synchronisations
    (so launch latency overlaps, as in a real forward pass). CPU: the median call.
    """
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters
    times: list[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(device: torch.device, nbytes: int, iters: int) -> float:
    """Device-to-device copy: bytes read + bytes written per second."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _timer(device, lambda: dst.copy_(src), iters)
    return 2 * nbytes / seconds / 1e9


def _batch(
    shape: Shape, q_lens: list[int], seq_lens: list[int], device: torch.device
) -> PagedBatch:
    return make_paged_batch(
        q_lens, seq_lens, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size, block_size=shape.block_size, dtype=shape.dtype,
        device=device, extra_blocks=0,
    )  # fmt: skip


def _paged(b: PagedBatch, scale: float) -> Callable[[], object]:
    return lambda: ops.paged_attention(
        b.query, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
        scale, max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
    )  # fmt: skip


def _sdpa_inputs(b: PagedBatch, q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Equal-length requests: [R, H, L, D] layouts for SDPA.
    num_reqs = b.seq_lens.shape[0]
    q = b.query[: num_reqs * q_len].reshape(num_reqs, q_len, -1, b.query.shape[-1]).transpose(1, 2)
    k = torch.stack(b.dense_keys).transpose(1, 2)
    v = torch.stack(b.dense_values).transpose(1, 2)
    return q, k, v


def _gather(b: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    # What an SDPA backend must do first on a paged cache: gather blocks to dense.
    seq_len = int(b.max_seq_len)
    blocks = b.block_table[:, : -(-seq_len // b.key_cache.shape[1])].long()
    k = b.key_cache[blocks].flatten(1, 2)[:, :seq_len].transpose(1, 2)
    v = b.value_cache[blocks].flatten(1, 2)[:, :seq_len].transpose(1, 2)
    return k, v


def bench_decode(shape: Shape, batch: int, ctx: int, device: torch.device, iters: int,
                 copy_gbs: float) -> dict[str, object]:  # fmt: skip
    b = _batch(shape, [1] * batch, [ctx] * batch, device)
    scale = shape.head_size**-0.5
    itemsize = torch.empty((), dtype=shape.dtype).element_size()
    kv_bytes = 2 * batch * ctx * shape.num_kv_heads * shape.head_size * itemsize
    io_bytes = kv_bytes + 2 * b.query.numel() * itemsize
    t_paged = _timer(device, _paged(b, scale), iters)
    q, k, v = _sdpa_inputs(b, 1)
    gqa = shape.num_heads != shape.num_kv_heads
    t_sdpa = _timer(device, lambda: F.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=gqa), iters)  # fmt: skip

    def sdpa_with_gather() -> object:
        kg, vg = _gather(b)
        return F.scaled_dot_product_attention(q, kg, vg, scale=scale, enable_gqa=gqa)

    t_gather = _timer(device, sdpa_with_gather, iters)
    gbs = io_bytes / t_paged / 1e9
    return {
        "batch": batch, "ctx": ctx, "paged_ms": t_paged * 1e3, "paged_gbs": gbs,
        "fraction_of_copy_bw": gbs / copy_gbs, "sdpa_dense_ms": t_sdpa * 1e3,
        "sdpa_with_gather_ms": t_gather * 1e3, "speedup_vs_sdpa_with_gather": t_gather / t_paged,
    }  # fmt: skip


def bench_prefill(shape: Shape, batch: int, seq: int, device: torch.device,
                  iters: int) -> dict[str, object]:  # fmt: skip
    b = _batch(shape, [seq] * batch, [seq] * batch, device)
    scale = shape.head_size**-0.5
    # Causal: about half of the q.k and p.v products, 2 FLOPs each.
    flops = 4 * batch * shape.num_heads * shape.head_size * seq * (seq + 1) / 2
    t_paged = _timer(device, _paged(b, scale), iters)
    q, k, v = _sdpa_inputs(b, seq)
    gqa = shape.num_heads != shape.num_kv_heads
    t_sdpa = _timer(device, lambda: F.scaled_dot_product_attention(
        q, k, v, scale=scale, is_causal=True, enable_gqa=gqa), iters)  # fmt: skip
    row: dict[str, object] = {
        "batch": batch, "seq": seq, "paged_ms": t_paged * 1e3,
        "paged_tflops": flops / t_paged / 1e12, "sdpa_ms": t_sdpa * 1e3,
        "sdpa_tflops": flops / t_sdpa / 1e12,
    }  # fmt: skip
    if device.type == "cuda":
        try:
            t_flex = _timer(device, _flex_causal(q, k, v, scale, gqa), iters)
            row.update(flex_ms=t_flex * 1e3, flex_tflops=flops / t_flex / 1e12)
        except Exception as exc:  # optional comparison: record why it did not run
            row["flex"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    return row


def _flex_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool
) -> Callable[[], object]:
    """Compiled FlexAttention with a causal block mask (dense K/V; CUDA only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return q_idx >= kv_idx

    mask = create_block_mask(causal, None, None, q.shape[2], k.shape[2], device=q.device)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    parser.add_argument("--max-kv-gib", type=float, default=40.0, help="skip bigger decode caches")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        shape = Shape(32, 8, 128, 16, torch.bfloat16)  # Llama-3-8B attention
        batches = [1, 4, 16, 64, 256] if not args.quick else [1, 64]
        contexts = [512, 2048, 8192, 32768] if not args.quick else [512, 8192]
        prefill = [(1, 512), (1, 2048), (4, 2048), (1, 8192)] if not args.quick else [(1, 2048)]
        iters, copy_bytes = (20 if not args.quick else 5), 1 << 30
        backend = "triton"
    else:
        shape = Shape(8, 2, 64, 16, torch.float32)
        batches, contexts = ([1, 4], [128, 512]) if not args.quick else ([1], [128])
        prefill = [(1, 128), (2, 256)] if not args.quick else [(1, 64)]
        iters, copy_bytes = 7, 1 << 26
        backend = "reference"
        # One intra-op thread: on a shared CPU, thread hand-offs dominate small ops.
        torch.set_num_threads(1)
    ops.set_backend(backend)  # type: ignore[arg-type]
    copy_gbs = copy_bandwidth_gbs(device, copy_bytes, iters)
    itemsize = torch.empty((), dtype=shape.dtype).element_size()
    decode = []
    for batch in batches:
        for ctx in contexts:
            kv_gib = 2 * batch * ctx * shape.num_kv_heads * shape.head_size * itemsize / 2**30
            if kv_gib * 3 > args.max_kv_gib:  # cache + SDPA's dense copy + gathered copy
                decode.append({"batch": batch, "ctx": ctx, "skipped": f"{kv_gib:.1f} GiB K/V"})
                continue
            decode.append(bench_decode(shape, batch, ctx, device, iters, copy_gbs))
            if cuda:
                torch.cuda.empty_cache()
    result = {
        "bench": "kernels",
        "device": torch.cuda.get_device_name()
        if cuda
        else f"cpu ({platform.processor() or 'x86'})",
        "backend": backend,
        "note": "Triton kernels on CUDA"
        if cuda
        else "CPU: torch reference path on small shapes, timings on a shared CPU; "
        "GPU figures (Triton kernels) not measured by this run; FlexAttention only on CUDA",
        "shape": {**asdict(shape), "dtype": str(shape.dtype)},
        "torch": torch.__version__,
        "cpu_threads": None if cuda else torch.get_num_threads(),
        "copy_bandwidth_gbs": copy_gbs,
        "decode": decode,
        "prefill": [bench_prefill(shape, b, s, device, iters) for b, s in prefill],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

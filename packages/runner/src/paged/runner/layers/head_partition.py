"""Which attention heads each tensor-parallel rank holds (q heads and their KV heads).

vLLM splits heads evenly: it needs `tp | num_heads`, and either `tp | num_kv_heads`
(KV heads split) or `num_kv_heads | tp` (each rank holds one KV head, replicated
on `tp / num_kv_heads` ranks). Anything else is refused. paged keeps exactly
that layout wherever it applies, and extends it so that any `tp <= num_heads`
works (the default model, SmolLM2-135M, has 9 q heads and 3 KV heads):

- `num_kv_heads >= tp`: the GQA groups (one KV head and the `g = H / K` q heads
  that read it) are dealt out whole, contiguously, the first `K % tp` ranks
  getting one group more. KV heads are split, never replicated.

      H=9 K=3 tp=2 (g=3)   rank 0: q 0-5, kv 0-1     rank 1: q 6-8, kv 2

- `num_kv_heads < tp`: each rank holds one KV head; KV head k is replicated on
  `tp // K` or `tp // K + 1` ranks (the first `tp % K` heads get the extra
  rank), and the g q heads of that group are split among those ranks, the
  first ones getting one head more.

      H=9 K=3 tp=4         rank 0: q 0-1, kv 0   rank 1: q 2, kv 0
                           rank 2: q 3-5, kv 1   rank 3: q 6-8, kv 2

Every rank's q heads are contiguous, so o_proj's input columns for rank r are
one range (`q_start * head_size`, `num_heads * head_size`) and the all-reduce
after o_proj is unchanged. Within a rank the q heads read their KV heads in
the usual GQA pattern (`num_heads` is a multiple of `num_kv_heads`), so the
attention backends need no change. The first rank always holds the most KV
heads, so KV cache blocks sized from rank 0's spec fit every rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """One rank's heads: q heads [q_start, q_start + num_heads), KV heads likewise."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def _split(total: int, parts: int) -> list[int]:
    """`total` dealt into `parts` contiguous counts, the first `total % parts` one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def partition_heads(total_heads: int, total_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """Every rank's `HeadShard`, in rank order (see the module docstring)."""
    if total_heads < 1 or total_kv_heads < 1 or tp_size < 1:
        raise ValueError(
            f"num_heads, num_kv_heads and tensor_parallel_size must be >= 1, got "
            f"{total_heads}, {total_kv_heads}, {tp_size}"
        )
    if total_heads % total_kv_heads != 0:
        raise ValueError(
            f"num_heads ({total_heads}) must be a multiple of num_kv_heads ({total_kv_heads})"
        )
    if tp_size > total_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp_size} is more than the model's {total_heads} attention "
            "heads; a rank would hold no head"
        )
    group = total_heads // total_kv_heads
    shards: list[HeadShard] = []
    if total_kv_heads >= tp_size:
        kv_start = 0
        for n_groups in _split(total_kv_heads, tp_size):
            shards.append(HeadShard(kv_start * group, n_groups * group, kv_start, n_groups))
            kv_start += n_groups
        return shards
    for kv, n_ranks in enumerate(_split(tp_size, total_kv_heads)):
        q_start = kv * group
        for n_heads in _split(group, n_ranks):
            shards.append(HeadShard(q_start, n_heads, kv, 1))
            q_start += n_heads
    return shards


def head_shard(total_heads: int, total_kv_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    """Rank `tp_rank`'s heads."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank}")
    return partition_heads(total_heads, total_kv_heads, tp_size)[tp_rank]


def is_vllm_even_split(total_heads: int, total_kv_heads: int, tp_size: int) -> bool:
    """True where vLLM accepts this TP size (and paged's layout is vLLM's)."""
    if total_heads % tp_size != 0:
        return False
    return total_kv_heads % tp_size == 0 or tp_size % total_kv_heads == 0

"""The scheduler tells the KV cache manager when a step starts (mamba "align" caching)."""

from __future__ import annotations

from paged.kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import BLOCK_SIZE, FakeRunner, make_request


def hybrid_scheduler() -> Scheduler:
    attn = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype="float32")
    state = MambaSpec(
        block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=("float32",), mamba_cache_mode="align"
    )
    config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attn"], attn), KVCacheGroupSpec(["mamba"], state)],
    )
    return Scheduler(SchedulerConfig(max_model_len=64), config, BLOCK_SIZE, hash_seed=0)


def test_a_state_cached_this_step_is_hit_from_the_next_step_on() -> None:
    sched = hybrid_scheduler()
    prompt = list(range(1, 9))  # two full blocks: the state after token 8 is cached
    sched.add_request(make_request("a", prompt, max_tokens=4))
    sched.add_request(make_request("b", [*prompt, 50, 51, 52], max_tokens=4))
    runner = FakeRunner()
    so = sched.schedule()
    # b's hit is a's state block, which this very step writes: b waits.
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"]
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    (new_b,) = so.scheduled_new_reqs
    assert new_b.req_id == "b" and new_b.num_computed_tokens == 8
    assert so.num_scheduled_tokens["b"] == 3

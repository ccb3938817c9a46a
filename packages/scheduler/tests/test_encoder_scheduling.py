"""The scheduler drives the worker's encoder cache: budget, sharing, lazy eviction, frees.

`WorkerEncoderCache` plays the runner's side exactly as the seed describes it
(free `free_encoder_mm_hashes`, run `scheduled_encoder_inputs`, then gather
the embeddings each scheduled token range needs) and asserts at every step
that nothing the model needs is missing and nothing freed is still needed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.request import Request
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import FakeRunner, make_request, make_scheduler


def image(mm_hash: str, offset: int, length: int, *, breaks: int = 0) -> MultiModalFeatureSpec:
    # `breaks` special tokens at each end of the span receive no embedding (Gemma3's boi/eoi).
    is_embed = None
    if breaks:
        is_embed = [False] * breaks + [True] * (length - 2 * breaks) + [False] * breaks
    return MultiModalFeatureSpec("image", mm_hash, PlaceholderRange(offset, length, is_embed))


def distinct(base: int, n: int) -> list[int]:
    return [base * 1000 + i for i in range(n)]


@dataclass
class WorkerEncoderCache:
    """The runner's `encoder_cache: dict[mm_hash, output]`, checked against each step."""

    features: dict[str, list[MultiModalFeatureSpec]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    cache: set[str] = field(default_factory=set)
    encoder_runs: Counter[str] = field(default_factory=Counter)
    num_preempted: int = 0

    def step(self, sched: Scheduler, so: SchedulerOutput) -> None:
        for new in so.scheduled_new_reqs:
            self.features[new.req_id] = list(new.mm_features or [])
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, num in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.computed[rid] = num
        self.num_preempted += len(so.preempted_req_ids)
        self.cache -= set(so.free_encoder_mm_hashes)
        for rid, items in so.scheduled_encoder_inputs.items():
            for i in items:
                mm_hash = self.features[rid][i].identifier
                assert mm_hash not in self.cache, f"{mm_hash} encoded again while cached"
                self.cache.add(mm_hash)
                self.encoder_runs[mm_hash] += 1
        for rid, n in so.num_scheduled_tokens.items():
            start, end = self.computed[rid], self.computed[rid] + n
            for f in self.features.get(rid, []):
                pos = f.mm_position
                lo, hi = max(start, pos.offset), min(end, pos.end)
                mask = pos.is_embed or [True] * pos.length
                if lo < hi and any(mask[lo - pos.offset : hi - pos.offset]):
                    assert f.identifier in self.cache, f"{rid} needs {f.identifier}, not cached"
        # The worker holds exactly what the scheduler accounts for.
        assert self.cache == set(sched.state.encoder_cache.cached)
        sched.state.encoder_cache.check_integrity()


def drive(sched: Scheduler, max_steps: int = 2000) -> WorkerEncoderCache:
    runner, worker = FakeRunner(), WorkerEncoderCache()
    for _ in range(max_steps):
        if not sched.has_requests():
            break
        so = sched.schedule()
        worker.step(sched, so)
        sched.update_from_output(so, runner.execute(so))
    else:
        raise AssertionError("did not finish")
    return worker


def test_tiny_encoder_cache_evicts_lazily_reports_frees_and_leaks_nothing() -> None:
    # Room for one image (8 embeddings): three requests, three different images.
    sched = make_scheduler(
        max_tokens_per_mm_item=8, encoder_cache_size=8, max_num_encoder_input_tokens=8
    )
    for n, h in enumerate(("x", "y", "z")):
        sched.add_request(make_request(h, distinct(n + 1, 16), mm=[image(h, 4, 8)], max_tokens=2))
    frees: list[str] = []
    runner, worker = FakeRunner(), WorkerEncoderCache()
    while sched.has_requests():
        so = sched.schedule()
        frees.extend(so.free_encoder_mm_hashes)
        worker.step(sched, so)
        sched.update_from_output(so, runner.execute(so))
    # One encoder run per image, one image per step; each eviction reported once, in order.
    assert worker.encoder_runs == Counter({"x": 1, "y": 1, "z": 1})
    assert frees == ["x", "y"]
    ec = sched.state.encoder_cache
    # The last image stays cached but unreferenced (freeable), for a later hit.
    assert ec.cached == {"z": set()} and list(ec.freeable) == ["z"]
    assert ec.num_freeable_slots == ec.cache_size
    # A repeat of the last image hits the freeable entry: no encoder run.
    sched.add_request(make_request("z2", distinct(9, 16), mm=[image("z", 2, 8)]))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {} and so.num_scheduled_tokens == {"z2": 16}


def test_embeds_not_placeholder_tokens_count_against_the_budget() -> None:
    # Two images of 6 tokens with 4 embeddings each fit a budget of 8 in one step.
    sched = make_scheduler(
        max_tokens_per_mm_item=4, encoder_cache_size=8, max_num_encoder_input_tokens=8
    )
    mm = [image("a", 2, 6, breaks=1), image("b", 10, 6, breaks=1)]
    sched.add_request(make_request("r", distinct(1, 20), mm=mm))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"r": [0, 1]}
    assert sched.state.encoder_cache.num_free_slots == 0


def test_chunk_across_a_placeholder_encodes_once_and_keeps_it_until_consumed() -> None:
    sched = make_scheduler(max_tokens_per_mm_item=8, max_num_batched_tokens=6, max_num_seqs=4)
    sched.add_request(make_request("r", distinct(1, 16), mm=[image("img", 4, 8)], max_tokens=1))
    worker = WorkerEncoderCache()
    runner = FakeRunner()
    steps: list[tuple[int, dict[str, list[int]]]] = []
    while sched.has_requests():
        so = sched.schedule()
        worker.step(sched, so)
        steps.append((so.num_scheduled_tokens.get("r", 0), dict(so.scheduled_encoder_inputs)))
        refs = sched.state.encoder_cache.cached.get("img")
        if len(steps) == 1:
            assert refs == {"r"}  # the placeholder continues into the next chunk
        sched.update_from_output(so, runner.execute(so))
    assert steps[:3] == [(6, {"r": [0]}), (6, {}), (4, {})]
    assert worker.encoder_runs == Counter({"img": 1})


def test_disable_chunked_mm_input_moves_the_whole_item_to_the_next_step() -> None:
    sched = make_scheduler(
        max_tokens_per_mm_item=8,
        max_num_batched_tokens=10,
        max_num_seqs=4,
        disable_chunked_mm_input=True,
    )
    sched.add_request(make_request("r", distinct(1, 20), mm=[image("img", 6, 8)], max_tokens=1))
    runner, worker = FakeRunner(), WorkerEncoderCache()
    steps: list[tuple[int, dict[str, list[int]]]] = []
    while sched.has_requests():
        so = sched.schedule()
        worker.step(sched, so)
        steps.append((so.num_scheduled_tokens.get("r", 0), dict(so.scheduled_encoder_inputs)))
        sched.update_from_output(so, runner.execute(so))
    # The 10-token budget would end inside [6, 14): the first chunk stops before it.
    assert steps[:3] == [(6, {}), (10, {"r": [0]}), (4, {})]
    assert worker.encoder_runs == Counter({"img": 1})


def test_preemption_drops_encoder_references_and_resume_reuses_or_recomputes() -> None:
    # 9 usable blocks of 4 tokens: two 16-token image prompts cannot both grow.
    sched = make_scheduler(num_blocks=10, max_tokens_per_mm_item=8, encoder_cache_size=16)
    sched.add_request(make_request("a", distinct(1, 16), mm=[image("ia", 2, 8)], max_tokens=12))
    sched.add_request(make_request("b", distinct(2, 16), mm=[image("ib", 2, 8)], max_tokens=12))
    worker = drive(sched)
    ec = sched.state.encoder_cache
    assert all(not refs for refs in ec.cached.values())  # nothing referenced at the end
    assert worker.num_preempted > 0
    # The victim recomputes from scratch; its image is still cached (freeable,
    # 16 slots hold both), so the resumed request hits it: one run per image.
    assert worker.encoder_runs == Counter({"ia": 1, "ib": 1})


def test_mm_hash_enters_block_keys_same_image_hits_other_image_misses() -> None:
    prompt = distinct(1, 24)
    sched = make_scheduler(max_tokens_per_mm_item=8)
    sched.add_request(make_request("a", prompt, mm=[image("cat", 4, 8)], max_tokens=1))
    drive(sched)
    kv = sched.state.kv

    def hit(mm_hash: str) -> int:
        req = Request.from_engine_core_request(
            make_request("q", prompt, mm=[image(mm_hash, 4, 8)]),
            max_model_len=256,
            block_hasher=sched._block_hasher,
        )
        return kv.get_computed_blocks(req)[1]

    # Block 0 (tokens 0-3) precedes the image; every later block overlaps or follows it.
    assert hit("cat") == 20  # all full blocks but the last token's block
    assert hit("dog") == 4
    # Fully cached image prompt: the encoder does not run for it at all.
    sched.add_request(make_request("b", prompt, mm=[image("cat", 4, 8)], max_tokens=1))
    sched.state.encoder_cache.reset()
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 4} and so.scheduled_encoder_inputs == {}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 12), st.integers(1, 3)),
        min_size=1,
        max_size=6,
    ),
    st.integers(8, 24),
    st.integers(8, 32),
    st.booleans(),
)
def test_random_image_workloads_never_miss_an_embedding(
    reqs: list[tuple[int, int, int]], cache_size: int, budget: int, no_split: bool
) -> None:
    sched = make_scheduler(
        num_blocks=40,
        max_tokens_per_mm_item=8,
        encoder_cache_size=cache_size,
        max_num_encoder_input_tokens=8,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        disable_chunked_mm_input=no_split,
    )
    for n, (img, offset, count) in enumerate(reqs):
        mm = [image(f"h{(img + k) % 5}", offset + 10 * k, 8, breaks=k % 2) for k in range(count)]
        prompt = distinct(n + 1, offset + 10 * count + 3)
        sched.add_request(make_request(f"r{n}", prompt, mm=mm, max_tokens=3))
    drive(sched)
    ec = sched.state.encoder_cache
    assert all(not refs for refs in ec.cached.values())
    assert ec.num_freeable_slots == ec.cache_size

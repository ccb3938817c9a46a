"""Gemma3ForConditionalGeneration (SigLIP + projector + Gemma 3 text) through the real
Scheduler + ModelRunner, against ONE transformers forward over the whole sequence.

transformers applies Gemma 3's bidirectional image mask (token_type_ids) in that
forward; paged gets it from AttentionMetadata.bidirectional_ranges. Every hidden
state the runner computes is recorded (positions + rows) and turned into
logits, so each prompt position and each generated token is compared, within
1e-5 in float32. The tiny checkpoint is built here: 3 text layers (sliding,
global, sliding; window 6, shorter than an image), a 2-layer SigLIP on
16x16 images with 4x4 patches pooled to 4 tokens per image.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.encoder_runner import EncoderRunner
from paged.runner.model_runner import ModelRunner
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler

ATOL = 1e-5
# The image token lies outside the text vocabulary (as in HF's tiny test models), so a
# random model can never generate it.
VOCAB, BOI, EOI, IMG = 64, 60, 61, 64
TOKENS_PER_IMAGE = 4
IMAGE_SIZE = 16
BLOCK = 4
MAX_LEN = 160
NEW_TOKENS = 4


def build_checkpoint(path: Path) -> Path:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=12,
        sliding_window=6, max_position_embeddings=256, rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=4, num_channels=3, vision_use_head=False,
        layer_norm_eps=1e-6,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMG,
        boi_token_index=BOI, eoi_token_index=EOI,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = Gemma3ForConditionalGeneration(config)
    model = model.float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight") and "vision_tower" not in name:
                param.copy_(torch.randn_like(param) * 0.3)  # Gemma norms: w, used as 1 + w
            elif name.endswith("mm_input_projection_weight"):
                param.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gemma3mm") / "ckpt")


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> Any:
    from transformers import Gemma3ForConditionalGeneration

    model: Any = Gemma3ForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


# ------------------------------------------------------------------ prompts


def image(seed: int) -> np.ndarray[Any, Any]:
    return (
        np.random.default_rng(seed)
        .standard_normal((1, 3, IMAGE_SIZE, IMAGE_SIZE))
        .astype(np.float32)
    )


@dataclass
class Prompt:
    token_ids: list[int]
    features: list[MultiModalFeatureSpec] = field(default_factory=list)
    pixels: list[np.ndarray[Any, Any]] = field(default_factory=list)


def make_prompt(parts: list[int | list[int]], images: dict[int, int] | None = None) -> Prompt:
    """parts: text token lists and image seeds (ints); an image becomes boi img*4 eoi."""
    prompt = Prompt([])
    for part in parts:
        if isinstance(part, list):
            prompt.token_ids.extend(part)
            continue
        offset = len(prompt.token_ids)
        prompt.token_ids.extend([BOI, *[IMG] * TOKENS_PER_IMAGE, EOI])
        pixels = image(part)
        prompt.pixels.append(pixels)
        data = {"pixel_values": TensorData(pixels.dtype.str, list(pixels.shape), pixels.tobytes())}
        is_embed = [False, *[True] * TOKENS_PER_IMAGE, False]
        prompt.features.append(
            MultiModalFeatureSpec(
                "image", f"img-{part}", PlaceholderRange(offset, TOKENS_PER_IMAGE + 2, is_embed),
                data,
            )
        )  # fmt: skip
    return prompt


def text(seed: int, n: int) -> list[int]:
    tokens: list[int] = np.random.default_rng(1000 + seed).integers(3, BOI, n).tolist()
    return tokens


def hf_logits(hf: Any, prompt: Prompt, generated: list[int]) -> torch.Tensor:
    """ONE forward over prompt + generated tokens: float32 logits [L, V]."""
    ids = torch.tensor([prompt.token_ids + generated])
    kwargs: dict[str, Any] = {"token_type_ids": (ids == IMG).long()}
    if prompt.pixels:
        kwargs["pixel_values"] = torch.from_numpy(np.concatenate(prompt.pixels))
    with torch.no_grad():
        logits: torch.Tensor = hf(input_ids=ids, use_cache=False, **kwargs).logits[0].float()
    return logits


# ------------------------------------------------------------------ engine


class Engine:
    """Scheduler + ModelRunner, recording the hidden state of every computed position."""

    def __init__(
        self, checkpoint: Path, *, budget: int, num_blocks: int = 128,
        encoder_cache_size: int | None = None, max_num_seqs: int = 4,
        disable_chunked_mm_input: bool = True, attention_backend: Any = "auto",
    ) -> None:  # fmt: skip
        mc = ModelConfig.from_pretrained(
            str(checkpoint), max_model_len=MAX_LEN, attention_backend=attention_backend
        )
        assert mc.requires_unchunked_mm_input
        self.runner = ModelRunner(
            mc, CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 22),
            SchedulerLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), "cpu",
        )  # fmt: skip
        self.runner.load_model()
        kv = get_kv_cache_config(
            self.runner.get_kv_cache_spec(), 1 << 22, num_gpu_blocks_override=num_blocks
        )
        self.runner.initialize_kv_cache(kv)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=MAX_LEN, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                disable_chunked_mm_input=disable_chunked_mm_input,
                max_num_encoder_input_tokens=TOKENS_PER_IMAGE,
                encoder_cache_size=encoder_cache_size,
            ),
            kv, BLOCK, max_tokens_per_mm_item=TOKENS_PER_IMAGE,
        )  # fmt: skip
        self.hidden: dict[str, dict[int, torch.Tensor]] = {}
        self.steps: list[tuple[Any, list[str]]] = []
        self.preempted_at: dict[str, list[int]] = {}
        model: Any = self.runner.model
        self.model = model
        forward = model.forward
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

        def recording_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            out: torch.Tensor = forward(*args, **kwargs)
            self._last = (args[1].clone(), out.clone())
            return out

        model.forward = recording_forward

    @property
    def encoder(self) -> EncoderRunner:
        assert self.runner.encoder_runner is not None
        return self.runner.encoder_runner

    def add(self, rid: str, prompt: Prompt, arrival: float = 0.0) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        self.scheduler.add_request(
            EngineCoreRequest(rid, prompt.token_ids, params, None, arrival,
                              mm_features=prompt.features or None)
        )  # fmt: skip
        self.hidden[rid] = {}

    def step(self) -> dict[str, list[int]]:
        so = self.scheduler.schedule()
        for rid in so.preempted_req_ids:  # how far it had got (positions recorded so far)
            self.preempted_at.setdefault(rid, []).append(len(self.hidden[rid]))
        self._last = None
        out = self.runner.execute_model(so)
        pending = self.runner._pending
        if out is None:
            out = self.runner.sample_tokens(None)
        if pending is not None and self._last is not None:
            positions, hidden = self._last
            start = 0
            for rid, n in zip(pending.inputs.req_ids, pending.inputs.num_scheduled.tolist(),
                              strict=True):  # fmt: skip
                for i in range(start, start + n):
                    self.hidden[rid][int(positions[i])] = hidden[i]
                start += n
        self.steps.append((so, list(pending.inputs.req_ids) if pending else []))
        new: dict[str, list[int]] = {}
        for outputs in self.scheduler.update_from_output(so, out).values():
            for o in outputs.outputs:
                new.setdefault(o.request_id, []).extend(o.new_token_ids)
        return new

    def run(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {rid: [] for rid in self.hidden}
        for _ in range(500):
            if not self.scheduler.has_requests():
                return tokens
            for rid, toks in self.step().items():
                tokens.setdefault(rid, []).extend(toks)
        raise AssertionError("the engine did not finish")

    def logits(self, rid: str) -> dict[int, torch.Tensor]:
        rows = self.hidden[rid]
        with torch.no_grad():
            logits = self.model.compute_logits(torch.stack(list(rows.values())))
        return dict(zip(rows, logits, strict=True))


def check(engine: Engine, hf: Any, rid: str, prompt: Prompt, generated: list[int]) -> None:
    """Every recorded position of `rid` (prompt and output) equals HF's one forward."""
    assert len(generated) == NEW_TOKENS
    ref = hf_logits(hf, prompt, generated)
    ours = engine.logits(rid)
    # The last generated token is sampled but never fed back: positions 0 .. L+N-2.
    assert set(ours) == set(range(len(prompt.token_ids) + NEW_TOKENS - 1)), rid
    for pos, row in ours.items():
        torch.testing.assert_close(row, ref[pos], atol=ATOL, rtol=0, msg=f"{rid} position {pos}")
    want = ref[len(prompt.token_ids) - 1 :].argmax(-1).tolist()
    assert generated == want[:NEW_TOKENS]


PROMPTS = {
    "text_only": lambda: make_prompt([text(0, 13)]),
    "one_image": lambda: make_prompt([text(1, 5), 11, text(2, 4)]),
    "two_images": lambda: make_prompt([text(3, 3), 11, text(4, 2), 12, text(5, 3)]),
    "image_first": lambda: make_prompt([13, text(6, 6)]),
    "image_last": lambda: make_prompt([text(7, 7), 14]),
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_whole_prompt_matches_hf(checkpoint: Path, hf: Any, name: str) -> None:
    prompt = PROMPTS[name]()
    engine = Engine(checkpoint, budget=64)
    engine.add("r", prompt)
    tokens = engine.run()
    check(engine, hf, "r", prompt, tokens["r"])
    assert engine.encoder.num_encoded_items == len(prompt.features)
    assert_nothing_referenced(engine)


def assert_nothing_referenced(engine: Engine) -> None:
    """After every request finished: the scheduler's encoder cache holds no reference
    (entries stay only as freeable, lazily evicted), and the runner's cache holds
    nothing the scheduler has already freed."""
    manager = engine.scheduler.state.encoder_cache
    manager.check_integrity()
    assert all(not refs for refs in manager.cached.values())
    assert manager.num_freeable_slots == manager.cache_size
    assert set(engine.encoder.encoder_cache) <= set(manager.cached)


def test_bidirectional_rule_matters(checkpoint: Path, hf: Any) -> None:
    """Without the image spans the logits move: the parity above tests the rule."""
    prompt = PROMPTS["one_image"]()
    engine = Engine(checkpoint, budget=64)
    engine.add("r", prompt)
    forward = engine.model.forward

    def causal_only(ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, **kw: Any) -> Any:
        for meta in [ctx.attn_metadata, *(ctx.layer_metadata or [])]:
            if meta is not None:
                meta.bidirectional_ranges = None
        return forward(ids, pos, ctx, **kw)

    engine.model.forward = causal_only
    engine.step()
    ref = hf_logits(hf, prompt, [])
    last = len(prompt.token_ids) - 1
    assert (engine.logits("r")[last] - ref[last]).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", range(TOKENS_PER_IMAGE + 2, 19))
def test_every_chunk_size(checkpoint: Path, hf: Any, chunk: int) -> None:
    """Token budgets 6..18 cut the 20-token two-image prompt at every offset; an image's
    6-token placeholder is never split (disable_chunked_mm_input: the chunk stops before
    it), which is also why a budget below 6 could never schedule an image (as in vLLM)."""
    prompt = PROMPTS["two_images"]()
    engine = Engine(checkpoint, budget=chunk, max_num_seqs=1)
    engine.add("r", prompt)
    tokens = engine.run()
    check(engine, hf, "r", prompt, tokens["r"])
    assert engine.encoder.num_encoder_calls == 2


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernels run on CUDA or under TRITON_INTERPRET=1",
)
def test_triton_backend_matches_hf(checkpoint: Path, hf: Any) -> None:
    """The same rule in the Triton kernel: two images, chunks of 7, a prefill then decodes."""
    pytest.importorskip("paged.kernels.triton_ops")
    prompt = PROMPTS["two_images"]()
    engine = Engine(checkpoint, budget=7, max_num_seqs=1, attention_backend="triton")
    assert engine.runner.attn_backend.name == "triton"
    engine.add("r", prompt)
    tokens = engine.run()
    check(engine, hf, "r", prompt, tokens["r"])


def test_split_image_is_rejected_by_the_runner(checkpoint: Path) -> None:
    """If a scheduler did split an image, the runner refuses instead of computing garbage."""
    prompt = make_prompt([text(1, 2), 11, text(2, 2)])
    engine = Engine(checkpoint, budget=4, disable_chunked_mm_input=False, max_num_seqs=1)
    engine.add("r", prompt)
    with pytest.raises(ValueError, match="disable_chunked_mm_input"):
        engine.run()


def test_repeated_image_runs_the_encoder_once(checkpoint: Path, hf: Any) -> None:
    """Two requests with the same image (and one in flight with it): one encoder run."""
    a = make_prompt([text(8, 3), 21, text(9, 5)])
    b = make_prompt([text(10, 6), 21, text(11, 2)])
    engine = Engine(checkpoint, budget=64)
    engine.add("a", a, 0.0)
    engine.add("b", b, 1.0)
    tokens = engine.run()
    check(engine, hf, "a", a, tokens["a"])
    check(engine, hf, "b", b, tokens["b"])
    assert engine.encoder.num_encoded_items == 1
    # Later, after both finished: the scheduler's cache still holds it (lazy eviction).
    c = make_prompt([text(12, 2), 21])
    engine.add("c", c, 2.0)
    tokens = engine.run()
    check(engine, hf, "c", c, tokens["c"])
    assert engine.encoder.num_encoded_items == 1


def test_prefix_cache_hit_on_image_prompt(checkpoint: Path, hf: Any) -> None:
    """The same image prompt again hits the prefix cache; a different image does not."""
    first = make_prompt([text(13, 3), 31, text(14, 9)])
    engine = Engine(checkpoint, budget=64)
    engine.add("a", first)
    tokens = engine.run()
    check(engine, hf, "a", first, tokens["a"])
    engine.add("b", first, 1.0)
    engine.step()
    so = engine.steps[-1][0]
    hit = so.scheduled_new_reqs[0].num_computed_tokens
    assert hit >= 12  # blocks over the image and the text after it were reused
    tokens_b = engine.run()
    generated = [*engine_tokens_of(engine, "b"), *tokens_b.get("b", [])]
    ref = hf_logits(hf, first, generated)
    for pos, row in engine.logits("b").items():
        assert pos >= hit
        torch.testing.assert_close(row, ref[pos], atol=ATOL, rtol=0)
    # Same text, another picture: block 0 already holds the image's boi token, so the
    # image hash is in its key and nothing is reused.
    other = make_prompt([text(13, 3), 32, text(14, 9)])
    engine.add("c", other, 2.0)
    engine.step()
    assert engine.steps[-1][0].scheduled_new_reqs[0].num_computed_tokens == 0


def engine_tokens_of(engine: Engine, rid: str) -> Iterator[int]:
    request = engine.scheduler.state.requests.get(rid)
    if request is not None:
        yield from request.output_token_ids


def test_preemption_in_the_middle_of_an_image_prompt(checkpoint: Path, hf: Any) -> None:
    """A tiny KV pool: the later request is preempted mid-prompt and recomputes."""
    a = make_prompt([text(15, 2), 41, text(16, 6)])
    b = make_prompt([text(17, 3), 42, text(18, 3), 43, text(19, 2)])
    engine = Engine(checkpoint, budget=7, num_blocks=20, max_num_seqs=2)
    engine.add("a", a, 0.0)
    engine.add("b", b, 1.0)
    tokens = engine.run()
    # b is preempted with 12 of its 20 prompt positions computed: after its first image,
    # before its second; it recomputes from scratch (prefix hits, cached encoder output).
    assert engine.preempted_at == {"b": [12]}, "the KV pool was meant to preempt b mid-prompt"
    assert len(b.token_ids) > 12
    for rid, prompt in (("a", a), ("b", b)):
        check(engine, hf, rid, prompt, tokens[rid])


def test_tiny_encoder_cache_evicts_and_leaks_nothing(checkpoint: Path, hf: Any) -> None:
    """An encoder cache of one image: distinct images in turn evict each other; at the end
    neither the scheduler's manager nor the runner's cache references a finished request."""
    engine = Engine(checkpoint, budget=64, encoder_cache_size=TOKENS_PER_IMAGE, max_num_seqs=1)
    prompts = {f"r{i}": make_prompt([text(20 + i, 2), 50 + i, text(30 + i, 2)]) for i in range(3)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        engine.add(rid, prompt, float(i))
    tokens = engine.run()
    for rid, prompt in prompts.items():
        check(engine, hf, rid, prompt, tokens[rid])
    assert engine.encoder.num_encoded_items == 3
    assert_nothing_referenced(engine)
    assert len(engine.encoder.encoder_cache) <= 1  # the evicted outputs were freed here too

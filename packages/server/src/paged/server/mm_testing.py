"""Offline tiny Gemma3 processor for tests and benchmarks (no download).

`save_tiny_gemma3_processor(dir)` writes a byte-level BPE tokenizer with
Gemma3's special tokens, a `Gemma3ImageProcessor` at a small resolution, a
Gemma-style chat template and `processor_config.json`, so that
`AutoProcessor.from_pretrained(dir)` returns a real `Gemma3Processor`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

GEMMA3_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
# Gemma3's template, cut to what tests use: roles, text and image parts.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
_CORPUS = [
    "describe this image please",
    "what is in the picture? a red square, a blue circle and a green line",
    "hello world the quick brown fox jumps over the lazy dog",
    "compare the two images and tell me which one is brighter",
    "user model system 0123456789 , . ! ? \n\n",
]


def build_tiny_gemma3_processor(
    image_size: int = 32, mm_tokens_per_image: int = 4, vocab_size: int = 320
) -> Any:
    """A `transformers.Gemma3Processor` built in memory (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3 import image_processing_pil_gemma3 as pil_module

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=GEMMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(_CORPUS, trainer)
    fast: Any = PreTrainedTokenizerFast
    tokenizer = fast(
        tokenizer_object=tk,
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
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    image_processor = pil_module.Gemma3ImageProcessorPil(
        size={"height": image_size, "width": image_size}
    )
    processor: Any = Gemma3Processor
    return processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )


def save_tiny_gemma3_processor(path: str | Path, **kwargs: Any) -> Any:
    """Build the processor and save it (tokenizer, image processor, template) to `path`."""
    processor = build_tiny_gemma3_processor(**kwargs)
    processor.save_pretrained(str(path))
    return processor


def random_png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """A random RGB picture as PNG bytes (distinct seeds: distinct pictures)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(seed: int, size: tuple[int, int] = (40, 30)) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(random_png(seed, size)).decode()


def save_tiny_gemma3_model(
    path: str | Path,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    mm_tokens_per_image: int = 4,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    random_projector: bool = False,
) -> Path:
    """A random `Gemma3ForConditionalGeneration` (text + SigLIP) and its processor, in `path`.

    The processor's tokenizer sets the vocabulary; the image token ids in the
    config are the tokenizer's, so transformers and paged read one checkpoint.
    transformers initialises the projector's `mm_input_projection_weight` to
    zeros, so every image embedding is zero; `random_projector=True` fills it
    with random values, for tests whose result must depend on the image.
    """
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    processor = save_tiny_gemma3_processor(
        path, image_size=image_size, mm_tokens_per_image=mm_tokens_per_image
    )
    tok = processor.tokenizer
    text_config = {
        "vocab_size": len(tok),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "max_position_embeddings": 1024,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2)
        + ["sliding_attention"] * (num_layers % 2),
        "query_pre_attn_scalar": hidden_size // 4,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    vision_config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": patch_size,
        "vision_use_head": False,
    }
    config_cls: Any = Gemma3Config
    config = config_cls(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=mm_tokens_per_image,
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model: Any = Gemma3ForConditionalGeneration(config)
    model = model.to(torch.float32).eval()
    if random_projector:
        with torch.no_grad():
            weight = model.model.multi_modal_projector.mm_input_projection_weight
            weight.copy_(torch.randn_like(weight) * 0.2)
    model.save_pretrained(str(path))
    return Path(path)

"""Hugging Face architecture name -> where its model class lives (data only).

The table maps the `architectures[0]` string of a config.json (or the
`general.architecture` of a GGUF file, translated by the loader) to the module
and class implementing it. Reading a config needs only this table, so it
imports no model code; registry.py imports the classes.
"""

from __future__ import annotations

# The Llama-family entries share LlamaForCausalLM; the differences (qkv bias,
# q/k norm, sliding window, tied embeddings) are read from the config.
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    # Gemma 3: sandwich norms, per-type rope bases, interleaved sliding layers.
    "Gemma3ForCausalLM": ("paged.runner.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": (
        "paged.runner.models.gemma3_mm",
        "Gemma3ForConditionalGeneration",
    ),
}


# Decoder classification architectures -> the causal-LM class that runs their body
# (built without an LM head; the pooler reads the `score` head: pooling/seq_cls.py).
DECODER_SEQ_CLS_ARCHITECTURES: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


def is_decoder_seq_cls(architecture: str) -> bool:
    """A decoder classifier architecture paged runs on its causal-LM body."""
    return architecture in DECODER_SEQ_CLS_ARCHITECTURES


def body_architecture(architecture: str) -> str:
    """The causal-LM architecture whose model class runs `architecture`'s body."""
    return DECODER_SEQ_CLS_ARCHITECTURES.get(architecture, architecture)


# Architectures whose model takes encoder inputs (images) and implements
# `paged.runner.models.interface.SupportsMultiModal`.
_MULTIMODAL = frozenset({"Gemma3ForConditionalGeneration"})


def is_multimodal(architecture: str) -> bool:
    return architecture in _MULTIMODAL


def supported_architectures() -> list[str]:
    """The Hugging Face architecture names paged can run, sorted."""
    return sorted(MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in MODELS


def check_architecture(architecture: str) -> None:
    """Raise a ValueError naming the supported architectures if `architecture` is not one."""
    if architecture not in MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported by paged; "
            f"supported architectures: {', '.join(supported_architectures())}. "
            "Pass --model pointing at a checkpoint of one of these."
        )

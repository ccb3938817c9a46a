"""`--runner` / `--convert`: whether a model generates or pools, read from its config only.

vLLM 0.33 resolves them in vllm/config/model.py:1283-1380 (`_get_runner_type`,
`_get_convert_type`) with the architecture-suffix table of :2340-2357 and a
sentence-transformers check (`get_pooling_config`: a `modules.json`): a
`*ForCausalLM` directory with sentence-transformers files is a pooling model
(Qwen3-Embedding), `BertModel` embeds, `*ForSequenceClassification`
classifies. Everything here reads files only, so a bad flag stops start-up
before any weight is loaded. `supported_tasks` is vLLM's
`get_supported_tasks` (gpu_model_runner.py:3099-3131) computed from the same
facts: a generate runner serves "generate", a pooling runner its pooler's tasks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from paged.runner.models.architectures import is_supported as is_generative_architecture

RUNNER_OPTIONS: Final[tuple[str, ...]] = ("auto", "generate", "pooling", "draft")
# vllm/config/model.py:87-88: ConvertType is none/embed/classify in 0.33.
CONVERT_OPTIONS: Final[tuple[str, ...]] = ("auto", "none", "embed", "classify")

# vllm/config/model.py:2340-2357 (higher entries win).
_SUFFIX_TO_DEFAULTS: Final[tuple[tuple[str, str, str], ...]] = (
    ("ForCausalLM", "generate", "none"),
    ("ForConditionalGeneration", "generate", "none"),
    ("ChatModel", "generate", "none"),
    ("LMHeadModel", "generate", "none"),
    ("ForTextEncoding", "pooling", "embed"),
    ("EmbeddingModel", "pooling", "embed"),
    ("ForSequenceClassification", "pooling", "classify"),
    ("ForTokenClassification", "pooling", "classify"),
    ("ClassificationModel", "pooling", "classify"),
    ("ForRewardModeling", "pooling", "embed"),
    ("RewardModel", "pooling", "embed"),
    ("Model", "pooling", "embed"),
)

EMBED_TASKS: Final[tuple[str, ...]] = ("embed", "token_embed")
CLASSIFY_TASKS: Final[tuple[str, ...]] = ("classify", "token_classify")


def _suffix_defaults(architecture: str, runner_type: str | None = None) -> tuple[str, str] | None:
    for suffix, runner, convert in _SUFFIX_TO_DEFAULTS:
        if (runner_type is None or runner == runner_type) and architecture.endswith(suffix):
            return runner, convert
    return None


def has_sentence_transformers_config(model_dir: str | Path | None) -> bool:
    """vLLM's `get_pooling_config` test: the directory is a sentence-transformers model."""
    return model_dir is not None and (Path(model_dir) / "modules.json").is_file()


def is_pooling_architecture(architecture: str) -> bool:
    """An architecture paged runs whose own class pools (the BERT family's encoders).

    Decoder `*ForSequenceClassification` checkpoints (no LM head, a `score`
    head) run on their causal-LM body (pooling/seq_cls.py); the suffix table
    makes them pooling/classify.
    """
    from paged.runner.models.bert import ENCODER_ONLY_ARCHITECTURES

    return architecture in ENCODER_ONLY_ARCHITECTURES


def resolve_runner_type(
    architecture: str, model_dir: str | Path | None, runner: str, convert: str
) -> str:
    """vLLM's `_get_runner_type` (config/model.py:1283-1329)."""
    if runner not in RUNNER_OPTIONS:
        raise ValueError(f"runner: {runner!r} is not one of {', '.join(RUNNER_OPTIONS)}")
    if convert not in CONVERT_OPTIONS:
        raise ValueError(f"convert: {convert!r} is not one of {', '.join(CONVERT_OPTIONS)}")
    if runner == "draft":
        raise ValueError(
            "runner: 'draft' is for a speculative draft model (--speculative-config), "
            "not the served model; use auto, generate or pooling"
        )
    if runner != "auto":
        return runner
    if convert not in ("auto", "none"):
        return "pooling"
    if has_sentence_transformers_config(model_dir):
        return "pooling"  # some sentence-transformers models use *ForCausalLM
    if is_pooling_architecture(architecture):
        return "pooling"
    if is_generative_architecture(architecture):
        return "generate"
    match = _suffix_defaults(architecture)
    return match[0] if match is not None else "generate"


def resolve_convert_type(architecture: str, runner_type: str, convert: str) -> str:
    """vLLM's `_get_convert_type` (config/model.py:1331-1380)."""
    if convert not in CONVERT_OPTIONS:
        raise ValueError(f"convert: {convert!r} is not one of {', '.join(CONVERT_OPTIONS)}")
    if convert != "auto":
        return convert
    if runner_type == "generate" and is_generative_architecture(architecture):
        return "none"
    if runner_type == "pooling" and is_pooling_architecture(architecture):
        return "none"
    match = _suffix_defaults(architecture, runner_type)
    if match is not None:
        return match[1]
    return "embed" if runner_type == "pooling" else "none"


def check_runner_supported(architecture: str, runner_type: str, convert_type: str) -> None:
    """A ValueError naming the flag when this model cannot run as asked."""
    if runner_type == "generate":
        if convert_type != "none":
            raise ValueError(
                f"convert: {convert_type!r} turns a model into a pooling model; "
                "it needs --runner pooling (or auto)"
            )
        if not is_generative_architecture(architecture):
            raise ValueError(
                f"runner: the model architecture {architecture!r} cannot generate text; "
                "use --runner pooling"
            )
        return
    if is_pooling_architecture(architecture) or is_generative_architecture(architecture):
        return
    from paged.runner.models.architectures import is_decoder_seq_cls

    if is_decoder_seq_cls(architecture):
        return
    raise ValueError(
        f"model architecture {architecture!r} is not supported by paged as a pooling model; "
        "supported: the BERT-family encoders, the decoder *ForSequenceClassification "
        "architectures and the generative architectures (converted with --convert embed "
        "or classify)"
    )


def pooling_tasks(architecture: str, convert_type: str) -> tuple[str, ...]:
    """The pooler's tasks: a classifier head classifies, anything else embeds."""
    if architecture.endswith("ForSequenceClassification") or convert_type == "classify":
        return CLASSIFY_TASKS
    return EMBED_TASKS


def supported_tasks(architecture: str, runner_type: str, convert_type: str) -> tuple[str, ...]:
    """vLLM's `get_supported_tasks`: generate for a generate runner, else the pooler's."""
    if runner_type == "generate":
        return ("generate",)
    return pooling_tasks(architecture, convert_type)

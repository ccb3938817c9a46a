"""`--generation-config`: the sampling defaults a model's generation_config.json sets.

vLLM 0.33 (vllm/config/model.py `get_diff_sampling_param`, the OpenAI
`to_sampling_params` and `get_max_tokens`): a request field left out falls
back to the server default, then to OpenAI's. The server defaults are the
generation config's non-default values among

    temperature top_p top_k min_p repetition_penalty presence_penalty
    frequency_penalty skip_special_tokens max_new_tokens (-> max_tokens)

- `auto`: the model's own generation config (generation_config.json in the
  model directory; without one, the generation fields of config.json). A GGUF
  file carries none in its metadata: paged reads a generation_config.json
  beside the file, if there is one.
- `vllm`: none (vLLM's neutral defaults).
- a directory: its generation_config.json; its `max_new_tokens` then also
  caps every request's max_tokens (vLLM's `override_max_tokens`).

EOS ids: the model's generation config gives them (runner ModelConfig) under
`auto` and `vllm` alike, as vLLM reads the model's for both; a directory's
ids replace the model's extra ones (the first, the primary EOS, stays).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_NAME = "generation_config.json"
# vLLM's `available_params`, in its order.
SAMPLING_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
    "skip_special_tokens",
)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Server-side defaults for request fields left out (vLLM's names: max_tokens)."""

    sampling: dict[str, Any] = field(default_factory=dict)
    # A server-wide limit on max_tokens (only from a --generation-config DIR).
    max_tokens_cap: int | None = None
    # A --generation-config DIR's eos_token_id(s); empty: the model's.
    eos_token_ids: tuple[int, ...] = ()

    def eos_token_ids_for(self, model_eos: Sequence[int]) -> list[int]:
        """The EOS ids requests stop at: the model's primary one first, then the others
        (vLLM's update_from_generation_config: a directory's become stop token ids)."""
        if not self.eos_token_ids or not model_eos:
            return list(model_eos or self.eos_token_ids)
        primary = model_eos[0]
        return [primary, *(t for t in dict.fromkeys(self.eos_token_ids) if t != primary)]

    @property
    def default_max_tokens(self) -> int | None:
        value = self.sampling.get("max_tokens")
        return int(value) if value is not None else None


def _from_directory(directory: Path) -> dict[str, Any]:
    """The generation config's non-default values (transformers' own reading)."""
    from transformers import AutoConfig, GenerationConfig

    if (directory / GENERATION_CONFIG_NAME).is_file():
        config = GenerationConfig.from_pretrained(str(directory))
        return dict(config.to_diff_dict())
    if (directory / "config.json").is_file():
        # vLLM's fallback: the generation fields of the model's config.json.
        model_config = AutoConfig.from_pretrained(str(directory))
        return dict(GenerationConfig.from_model_config(model_config).to_diff_dict())
    return {}


def _sampling_of(config: dict[str, Any]) -> dict[str, Any]:
    found = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if "max_new_tokens" in found:  # HF's max_new_tokens is vLLM's max_tokens
        found["max_tokens"] = found.pop("max_new_tokens")
    return found


def model_directory(model: str | None) -> Path | None:
    """Where `auto` looks: the model directory, or a GGUF file's directory (None: default model)."""
    if model is None:
        return None
    path = Path(model)
    return path.parent if path.is_file() else path


def load_generation_defaults(model: str | None, source: str = "auto") -> GenerationDefaults:
    """The defaults `--generation-config source` gives for `model` (ValueError if unreadable)."""
    if source == "vllm":
        return GenerationDefaults()
    directory = model_directory(model) if source == "auto" else Path(source)
    if directory is None or not directory.is_dir():
        return GenerationDefaults()  # the default model ships no generation config
    try:
        config = _from_directory(directory)
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {directory}: {e}") from e
    sampling = _sampling_of(config)
    if sampling:
        logger.warning(
            "Default sampling parameters have been overridden by %s: %s. If this is not "
            "intended, relaunch with --generation-config vllm.",
            "the model's generation_config.json" if source == "auto" else source,
            sampling,
        )
    if source == "auto":
        return GenerationDefaults(sampling)
    cap = sampling.get("max_tokens")
    eos = config.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return GenerationDefaults(sampling, int(cap) if cap is not None else None, eos_ids)

"""LoRA limits, vLLM 0.33's `LoRAConfig` (vllm/config/lora.py) reduced to what paged serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

__all__ = ["LORA_DTYPES", "MAX_LORA_RANKS", "LoRAAdapterSpec", "LoRAConfig", "LoRADType"]

LoRADType = Literal["auto", "float16", "bfloat16", "float32"]
LORA_DTYPES: tuple[str, ...] = ("auto", "float16", "bfloat16", "float32")
# vLLM 0.33 accepts these ranks only (vllm/config/lora.py: MaxLoRARanks).
MAX_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """`--enable-lora` and its limits.

    - `max_loras`: distinct adapters in one step (the scheduler keeps to it; the
      runner holds this many device slots).
    - `max_lora_rank`: the largest adapter rank accepted; slots are this wide.
    - `max_cpu_loras`: adapters kept loaded in host memory (LRU beyond it,
      reloaded from their path when needed again); None: `max_loras`.
    - `lora_dtype`: the deltas' dtype; "auto": the base model's dtype
      ("float32" is paged's addition, for exact comparisons).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: LoRADType = "auto"

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank: must be one of {list(MAX_LORA_RANKS)}, got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype: must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")

    @property
    def cpu_capacity(self) -> int:
        """How many adapters stay loaded in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class LoRAAdapterSpec(msgspec.Struct, frozen=True):
    """An adapter to load, as the engine sends it to every worker (vLLM's LoRARequest).

    `name` identifies it everywhere (requests, block hashes, events); `int_id` is
    vLLM's `lora_int_id` (kept for metrics and the offline API); `path` is a PEFT
    directory or a llama.cpp GGUF LoRA file.
    """

    name: str
    path: str
    int_id: int = 0

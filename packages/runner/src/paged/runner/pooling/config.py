"""`--pooler-config`: vLLM 0.33's PoolerConfig keys, checked where they enter.

vLLM reference: vllm/config/pooler.py:29-175 (the fields, the removed `normalize`
key, `logit_sigma != 0`, `pooling_type` resolving into `seq_pooling_type` or
`tok_pooling_type`) and vllm/tasks.py:10-30 (task names, removed `score` /
`encode` tasks). vLLM validates with pydantic (unknown keys rejected); here
`PoolerConfig.from_json` raises a ValueError naming the key instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

PoolingTask = Literal[
    "embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"
]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)
SequencePoolingType = Literal["CLS", "LAST", "MEAN"]
SEQ_POOLING_TYPES: tuple[str, ...] = get_args(SequencePoolingType)
TokenPoolingType = Literal["ALL", "STEP"]
TOK_POOLING_TYPES: tuple[str, ...] = get_args(TokenPoolingType)

# vllm/tasks.py:20-25: the messages vLLM gives for the tasks it removed.
_REMOVED_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}


def check_removed_pooling_task(task: object, *, argument: str = "task") -> None:
    """Raise vLLM's message for a removed task name (`score`, `encode`)."""
    if isinstance(task, str) and task in _REMOVED_TASKS:
        raise ValueError(f"{argument}: {_REMOVED_TASKS[task]}")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns final hidden states into outputs (vLLM's fields).

    `pooling_type` is the convenience key: after construction it has been copied
    into `seq_pooling_type` (CLS/LAST/MEAN) or `tok_pooling_type` (ALL/STEP).
    Fields left None are filled by `load_pooler_config` from the model's
    sentence-transformers files and the architecture's defaults.
    """

    task: PoolingTask | None = None
    pooling_type: str | None = None
    seq_pooling_type: SequencePoolingType | None = None
    tok_pooling_type: TokenPoolingType | None = None
    use_activation: bool | None = None
    enable_flash_late_interaction: bool = True
    dimensions: int | None = None
    enable_chunked_processing: bool = False
    max_embed_len: int | None = None
    logit_mean: float | None = None
    logit_sigma: float | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.pooling_type is not None:
            if self.seq_pooling_type is not None:
                raise ValueError("Cannot set both `pooling_type` and `seq_pooling_type`")
            if self.tok_pooling_type is not None:
                raise ValueError("Cannot set both `pooling_type` and `tok_pooling_type`")
            # Frozen dataclass: the resolution happens once, here, like vLLM's
            # __post_init__ (config/pooler.py:150-173).
            if self.pooling_type in SEQ_POOLING_TYPES:
                object.__setattr__(self, "seq_pooling_type", self.pooling_type)
            else:
                object.__setattr__(self, "tok_pooling_type", self.pooling_type)

    @classmethod
    def from_json(cls, value: str | Mapping[str, Any]) -> PoolerConfig:
        """Parse `--pooler-config` (a JSON object or its dict); bad keys raise ValueError."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"pooler-config: not valid JSON ({exc})") from exc
        if not isinstance(value, Mapping):
            raise ValueError(f"pooler-config: expected a JSON object, got {type(value).__name__}")
        if "normalize" in value:
            # vllm/config/pooler.py:139-142
            raise ValueError(
                "pooler-config: Parameter `normalize` was removed; use `use_activation` instead."
            )
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(
                    f"pooler-config: unknown key {key!r}; valid keys: {', '.join(sorted(known))}"
                )
        return cls(**dict(value))

    def with_defaults(self, **defaults: Any) -> PoolerConfig:
        """A copy where each given field that is still None takes the given value."""
        changes = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **changes) if changes else self

    def get_seq_pooling_type(self) -> SequencePoolingType:
        if self.seq_pooling_type is None:
            raise ValueError("seq_pooling_type is not set; resolve it with load_pooler_config")
        return self.seq_pooling_type

    def get_tok_pooling_type(self) -> TokenPoolingType:
        if self.tok_pooling_type is None:
            raise ValueError("tok_pooling_type is not set; resolve it with load_pooler_config")
        return self.tok_pooling_type


def _check_fields(cfg: PoolerConfig) -> None:
    """Type and range checks: each failure names the key and the value received."""
    check_removed_pooling_task(cfg.task, argument="pooler-config: task")
    _one_of("task", cfg.task, POOLING_TASKS)
    _one_of("pooling_type", cfg.pooling_type, SEQ_POOLING_TYPES + TOK_POOLING_TYPES)
    _one_of("seq_pooling_type", cfg.seq_pooling_type, SEQ_POOLING_TYPES)
    _one_of("tok_pooling_type", cfg.tok_pooling_type, TOK_POOLING_TYPES)
    for name in ("use_activation", "enable_flash_late_interaction", "enable_chunked_processing"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"pooler-config: {name} must be a boolean, got {value!r}")
    for name in ("dimensions", "max_embed_len"):
        value = getattr(cfg, name)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"pooler-config: {name} must be a positive integer, got {value!r}")
    if cfg.step_tag_id is not None and not _is_int(cfg.step_tag_id):
        raise ValueError(f"pooler-config: step_tag_id must be an integer, got {cfg.step_tag_id!r}")
    ids = cfg.returned_token_ids
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(i) for i in ids)):
        raise ValueError(
            f"pooler-config: returned_token_ids must be a list of integers, got {ids!r}"
        )
    for name in ("logit_mean", "logit_sigma"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"pooler-config: {name} must be a number, got {value!r}")
    if cfg.logit_sigma is not None and cfg.logit_sigma == 0:
        raise ValueError("pooler-config: logit_sigma cannot be 0 (division by zero)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise ValueError(
            f"pooler-config: {name} must be one of {', '.join(allowed)}, got {value!r}"
        )

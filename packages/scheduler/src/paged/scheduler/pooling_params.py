"""`PoolingParams`: what one pooling request (embed, classify, ...) asks for.

vLLM 0.33's field names and defaults (vllm/pooling_params.py:88-130), as a
frozen msgspec Struct like `SamplingParams` so it crosses the frontend ->
engine-core boundary as msgpack. vLLM mutates the params in `verify`; here
`verify` returns the resolved copy (pooler-config defaults merged, activation
default set, `skip_reading_prefix_cache` decided) and the caller keeps that.

The model facts `verify` needs (served name, hidden size, Matryoshka support,
the pooler config's defaults) come in a `PoolingModelInfo`, because the
scheduler package cannot import the runner's `PoolerConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, Literal, get_args

import msgspec

from paged.scheduler.sampling_params import RequestOutputKind

# vllm/tasks.py:9-17; "plugin" and "embed&token_classify" are not served here.
PoolingTask = Literal["embed", "classify", "token_embed", "token_classify"]
POOLING_TASKS: Final[tuple[str, ...]] = get_args(PoolingTask)

# vllm/tasks.py:20-25: tasks vLLM removed, with the message it gives.
_REMOVED_POOLING_TASK_MESSAGES: Final[dict[str, str]] = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}

# vllm/pooling_params.py:132-142: which request fields each task accepts.
_ALL_PARAMETERS: Final[tuple[str, ...]] = ("dimensions", "use_activation")
_VALID_PARAMETERS: Final[dict[str, tuple[str, ...]]] = {
    "embed": ("dimensions", "use_activation"),
    "classify": ("use_activation",),
    "token_embed": ("dimensions", "use_activation"),
    "token_classify": ("use_activation",),
}
_STEP_PARAMETERS: Final[tuple[str, ...]] = ("step_tag_id", "returned_token_ids")

# Tasks whose output covers every prompt token: a prefix-cache hit would skip
# the hidden states of the cached tokens (vllm/pooling_params.py:198-205).
ALL_TOKEN_TASKS: Final[frozenset[str]] = frozenset({"token_embed", "token_classify"})


def check_removed_pooling_task(task: object) -> None:
    """Raise vLLM's message for a task name vLLM removed (`score`, `encode`)."""
    if isinstance(task, str) and task in _REMOVED_POOLING_TASK_MESSAGES:
        raise ValueError(_REMOVED_POOLING_TASK_MESSAGES[task])


@dataclasses.dataclass(frozen=True)
class PoolingModelInfo:
    """The facts about the served model that `PoolingParams.verify` checks against.

    `embedding_size`: the model's hidden size (vLLM's ModelConfig.embedding_size);
    `matryoshka_dimensions`: the allowed `dimensions` values when the HF config
    lists them. The `default_*` fields and `tok_pooling_type` come from the
    model's pooler config (vLLM's PoolerConfig); `has_pooler_config=False` means
    no pooler config at all, and then nothing is merged (as vLLM).
    """

    served_model_name: str
    embedding_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    has_pooler_config: bool = True
    default_dimensions: int | None = None
    default_use_activation: bool | None = None
    tok_pooling_type: str | None = None
    default_step_tag_id: int | None = None
    default_returned_token_ids: tuple[int, ...] | None = None


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, kw_only=True):
    """API parameters of a pooling request, with vLLM 0.33's names and defaults.

    `use_activation`: apply the pooler's activation (normalize for embed,
    softmax/sigmoid for classify); None = the pooler's default.
    `dimensions`: Matryoshka truncation of embeddings.
    `step_tag_id` / `returned_token_ids`: STEP pooling (reward models).
    `task`, `requires_token_ids`, `skip_reading_prefix_cache`, `extra_kwargs`:
    filled in by the frontend (vLLM marks them internal).
    `truncate_prompt_tokens` is not here: as in vLLM 0.33 it is a tokenizer
    argument of `encode`/`embed`, not a pooling parameter.
    """

    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        check_removed_pooling_task(self.task)
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError(
                f"For pooling output_kind has to be FINAL_ONLY, got {self.output_kind!r}"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
        ):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")

    @property
    def all_parameters(self) -> list[str]:
        """The request fields some task accepts (vLLM's `all_parameters`)."""
        return list(_ALL_PARAMETERS)

    @property
    def valid_parameters(self) -> dict[str, list[str]]:
        """The request fields each task accepts (vLLM's `valid_parameters`)."""
        return {task: list(names) for task, names in _VALID_PARAMETERS.items()}

    def clone(self) -> PoolingParams:
        """A copy (the struct is frozen, so a shallow replace is a full copy of state)."""
        return msgspec.structs.replace(
            self,
            returned_token_ids=(
                None if self.returned_token_ids is None else list(self.returned_token_ids)
            ),
            extra_kwargs=None if self.extra_kwargs is None else dict(self.extra_kwargs),
        )

    def with_task(self, task: str) -> PoolingParams:
        """These params for `task` (the frontend sets it from the API call)."""
        return msgspec.structs.replace(self, task=task)

    def verify(self, model: PoolingModelInfo) -> PoolingParams:
        """The params resolved against the model, or ValueError naming the bad field.

        vllm/pooling_params.py:148-180: merge the pooler config's defaults,
        set the task's defaults, then reject fields the task does not accept.
        """
        if self.task is None:
            raise ValueError("task must be set before verifying pooling parameters")
        resolved = self._merge_default_parameters(model)
        resolved = resolved._set_default_parameters(model)
        resolved._verify_valid_parameters()
        return resolved

    def _merge_default_parameters(self, model: PoolingModelInfo) -> PoolingParams:
        # vllm/pooling_params.py:182-207
        if not model.has_pooler_config:
            return self
        assert self.task is not None
        valid = _VALID_PARAMETERS[self.task]
        changes: dict[str, Any] = {}
        defaults: dict[str, Any] = {
            "dimensions": model.default_dimensions,
            "use_activation": model.default_use_activation,
        }
        for name in valid:
            if defaults[name] is not None and getattr(self, name) is None:
                changes[name] = defaults[name]
        if self.skip_reading_prefix_cache is None:
            changes["skip_reading_prefix_cache"] = self.task in ALL_TOKEN_TASKS
        # vllm/pooling_params.py:209-235: step fields only with STEP pooling.
        if model.tok_pooling_type != "STEP":
            invalid = [name for name in _STEP_PARAMETERS if getattr(self, name) is not None]
            if invalid:
                raise ValueError(
                    f"Task {self.task} only supports {list(valid)} parameters, "
                    f"does not support {invalid} parameters"
                )
        else:
            if self.step_tag_id is None and model.default_step_tag_id is not None:
                changes["step_tag_id"] = model.default_step_tag_id
            if self.returned_token_ids is None and model.default_returned_token_ids is not None:
                changes["returned_token_ids"] = list(model.default_returned_token_ids)
        return msgspec.structs.replace(self, **changes) if changes else self

    def _set_default_parameters(self, model: PoolingModelInfo) -> PoolingParams:
        # vllm/pooling_params.py:237-272
        result = self
        if self.use_activation is None:
            result = msgspec.structs.replace(self, use_activation=True)
        if self.task in ("embed", "token_embed") and self.dimensions is not None:
            dims = self.dimensions
            name = model.served_model_name
            if not model.is_matryoshka:
                raise ValueError(
                    f"Model {name!r} does not support Matryoshka embeddings; "
                    f"dimensions must be unset (received dimensions={dims})."
                )
            if not 1 <= dims <= model.embedding_size:
                raise ValueError(
                    f"Model {name!r} only supports dimensions in range "
                    f"[1, {model.embedding_size}], got {dims}."
                )
            allowed = model.matryoshka_dimensions
            if allowed is not None and dims not in allowed:
                raise ValueError(
                    f"Model {name!r} only supports Matryoshka dimensions {list(allowed)}, "
                    f"got {dims}."
                )
        return result

    def _verify_valid_parameters(self) -> None:
        # vllm/pooling_params.py:274-292
        assert self.task is not None
        valid = _VALID_PARAMETERS[self.task]
        invalid = [n for n in _ALL_PARAMETERS if n not in valid and getattr(self, n) is not None]
        if invalid:
            raise ValueError(
                f"Task {self.task!r} only supports {list(valid)} parameters, "
                f"does not support {invalid} parameters"
            )

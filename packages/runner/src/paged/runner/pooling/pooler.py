"""The Pooler: final hidden states of whole prompts -> embeddings, scores, token vectors.

    hidden [n, H] --pool--> [H] (CLS/LAST/MEAN) or [n, H] (ALL/STEP)
      embed / token_embed      -> Dense projector -> [:dimensions] -> L2 normalise (use_activation)
      classify / token_classify -> classifier -> (x - logit_mean) / logit_sigma -> softmax/sigmoid

vLLM reference: layers/pooler/seqwise/methods.py:37-106 (CLS/LAST/MEAN, mean in
fp32), tokwise/methods.py:36-149 (ALL; STEP keeps `returned_token_ids` columns
then the rows whose token is `step_tag_id`), seqwise/heads.py:59-117 and
:154-204 (embedding head: projector, Matryoshka slice, normalise; classifier
head: calibration then activation), tokwise/heads.py:91-192, special.py:25-57
(tasks per model kind), vllm/pooling_params.py:182-289 (defaults merged from the
pooler config; the parameters each task accepts; the `dimensions` checks and
their messages).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from paged.runner.pooling.activations import Activation, dense_activation, normalize
from paged.runner.pooling.config import PoolerConfig
from paged.runner.pooling.heads import ClassifierHead
from paged.runner.pooling.st_files import DenseLayer

EMBED_TASKS = frozenset({"embed", "token_embed"})
CLASSIFY_TASKS = frozenset({"classify", "token_classify"})
_SEQ_TASKS = frozenset({"embed", "classify"})
# vllm/pooling_params.py:131-138
_VALID_PARAMETERS: dict[str, tuple[str, ...]] = {
    "embed": ("dimensions", "use_activation"),
    "classify": ("use_activation",),
    "token_embed": ("dimensions", "use_activation"),
    "token_classify": ("use_activation",),
}
# vllm/config/model.py:1941-1950 (get_pooling_task's priority).
_TASK_PRIORITY = ("embed", "classify", "token_embed", "token_classify")


@dataclass(frozen=True)
class PoolingInput:
    """One finished prompt to pool."""

    hidden_states: torch.Tensor  # [n_prompt_tokens, hidden], after the model's final norm
    prompt_token_ids: list[int]
    task: str  # "embed" | "classify" | "token_embed" | "token_classify"
    dimensions: int | None = None  # Matryoshka truncation (embed tasks)
    use_activation: bool | None = None  # None: the pooler config's, else True
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None


def check_dimensions(
    dimensions: int, *, hf_config: Mapping[str, Any], embedding_size: int, model_name: str
) -> None:
    """Raise vLLM's ValueError when the model cannot return `dimensions`-wide embeddings.

    A model supports Matryoshka truncation when its config has a non-empty
    `matryoshka_dimensions` or `is_matryoshka: true`; a listed set restricts
    the sizes further. vllm/config/model.py:2083-2091, pooling_params.py:240-264.
    """
    mds = hf_config.get("matryoshka_dimensions")
    if not (bool(mds) or bool(hf_config.get("is_matryoshka", False))):
        raise ValueError(
            f"dimensions: Model {model_name!r} does not support Matryoshka embeddings; "
            f"dimensions must be unset (received dimensions={dimensions})."
        )
    if not 1 <= dimensions <= embedding_size:
        raise ValueError(
            f"dimensions: Model {model_name!r} only supports dimensions in range "
            f"[1, {embedding_size}], got {dimensions}."
        )
    if mds is not None and dimensions not in mds:
        raise ValueError(
            f"dimensions: Model {model_name!r} only supports Matryoshka dimensions "
            f"{mds!s}, got {dimensions}."
        )


class Projector:
    """The sentence-transformers Dense modules applied after pooling (float32)."""

    def __init__(self, layers: Sequence[DenseLayer]) -> None:
        if not layers:
            raise ValueError("a projector needs at least one Dense layer")
        self._layers: list[tuple[torch.Tensor, torch.Tensor | None, Activation]] = [
            (layer.weight.float(), layer.bias, dense_activation(layer.activation))
            for layer in layers
        ]
        self.in_features = int(layers[0].weight.shape[1])
        self.out_features = int(layers[-1].weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for weight, bias, act in self._layers:
            x = act(F.linear(x, weight, bias))
        return x


class Pooler:
    """Pools the final hidden states of finished prompts; built once per model.

    Outputs are float32 CPU tensors, one per input: embed [D'], classify
    [num_labels], token_embed [n, D'], token_classify [n', num_labels]
    (n' < n only under STEP pooling with a `step_tag_id`). Bad per-request
    parameters raise a ValueError naming the parameter before anything runs.
    """

    def __init__(
        self,
        *,
        config: PoolerConfig,
        hf_config: Mapping[str, Any],
        hidden_size: int,
        projector: Projector | None,
        classifier: ClassifierHead | None,
        activation: Activation,
    ) -> None:
        self.config = config
        self._hf_config = hf_config
        self._projector = projector
        self._classifier = classifier
        self._activation = activation
        self.hidden_size = hidden_size
        self.embedding_size = projector.out_features if projector else hidden_size
        self.supported_tasks: frozenset[str] = CLASSIFY_TASKS if classifier else EMBED_TASKS
        self.model_name = str(hf_config.get("_name_or_path") or hf_config.get("model_type", ""))
        if config.task is not None and config.task not in self.supported_tasks:
            raise ValueError(
                f"pooler-config: task {config.task!r} is not supported by this model; "
                f"supported tasks: {sorted(self.supported_tasks)}"
            )

    @property
    def default_task(self) -> str:
        """The task a request without one gets (`task` of the config, else vLLM's priority)."""
        if self.config.task is not None:
            return self.config.task
        return next(t for t in _TASK_PRIORITY if t in self.supported_tasks)

    def check_input(self, inp: PoolingInput) -> None:
        """Raise a ValueError naming the bad field of one request (vLLM's messages)."""
        if inp.task not in self.supported_tasks:
            raise ValueError(
                f"task: {inp.task!r} is not supported by this model; "
                f"supported tasks: {sorted(self.supported_tasks)}"
            )
        valid = _VALID_PARAMETERS[inp.task]
        given = {"dimensions": inp.dimensions, "use_activation": inp.use_activation}
        invalid = [k for k, v in given.items() if v is not None and k not in valid]
        if self.config.tok_pooling_type != "STEP" or inp.task in _SEQ_TASKS:
            step = {"step_tag_id": inp.step_tag_id, "returned_token_ids": inp.returned_token_ids}
            invalid += [k for k, v in step.items() if v is not None]
        if invalid:
            raise ValueError(
                f"Task {inp.task!r} only supports {list(valid)} parameters, "
                f"does not support {invalid} parameters"
            )
        if inp.hidden_states.dim() != 2 or inp.hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden_states: expected [n, {self.hidden_size}], "
                f"got {list(inp.hidden_states.shape)}"
            )
        if inp.hidden_states.shape[0] == 0:
            raise ValueError("hidden_states: a prompt to pool needs at least one token")
        if len(inp.prompt_token_ids) != inp.hidden_states.shape[0]:
            raise ValueError(
                f"prompt_token_ids: {len(inp.prompt_token_ids)} ids for "
                f"{inp.hidden_states.shape[0]} hidden states"
            )
        dims = self._dimensions(inp)
        if dims is not None and inp.task in EMBED_TASKS:
            check_dimensions(
                dims,
                hf_config=self._hf_config,
                embedding_size=self.embedding_size,
                model_name=self.model_name,
            )

    def __call__(self, inputs: Sequence[PoolingInput]) -> list[torch.Tensor]:
        for inp in inputs:
            self.check_input(inp)
        out: list[torch.Tensor | None] = [None] * len(inputs)
        # Sequence tasks: pool each prompt, then run the head once per task on
        # the stacked rows (one matmul for a whole batch of short prompts).
        for task, head in (("embed", self._embed_rows), ("classify", self._classify_rows)):
            idx = [i for i, inp in enumerate(inputs) if inp.task == task]
            if idx:
                pooled = torch.stack([self._seq_pool(inputs[i].hidden_states) for i in idx])
                for i, row in zip(idx, head(pooled, [inputs[i] for i in idx]), strict=True):
                    out[i] = row
        for i, inp in enumerate(inputs):
            if inp.task in ("token_embed", "token_classify"):
                out[i] = self._token_output(inp)
        return [t.float().cpu() for t in out if t is not None]

    # -- pooling methods -------------------------------------------------
    def _seq_pool(self, hs: torch.Tensor) -> torch.Tensor:
        kind = self.config.get_seq_pooling_type()
        if kind == "CLS":
            return hs[0].float()
        if kind == "LAST":
            return hs[-1].float()
        return hs.float().mean(dim=0)  # MEAN accumulates in fp32, as vLLM's index_add_

    def _tok_pool(self, inp: PoolingInput) -> torch.Tensor:
        data = inp.hidden_states.float()
        if self.config.get_tok_pooling_type() == "STEP":
            returned = inp.returned_token_ids or self.config.returned_token_ids
            if returned:
                data = data[:, returned]
            step_tag = inp.step_tag_id if inp.step_tag_id is not None else self.config.step_tag_id
            if step_tag is not None:
                ids = torch.tensor(inp.prompt_token_ids)
                data = data[(ids == step_tag).nonzero(as_tuple=True)[0]]
        return data

    # -- heads -------------------------------------------------------------
    def _dimensions(self, inp: PoolingInput) -> int | None:
        return inp.dimensions if inp.dimensions is not None else self.config.dimensions

    def _use_activation(self, inp: PoolingInput) -> bool:
        if inp.use_activation is not None:
            return inp.use_activation
        return self.config.use_activation if self.config.use_activation is not None else True

    def _embed(self, x: torch.Tensor, inp: PoolingInput) -> torch.Tensor:
        dims = self._dimensions(inp)
        if dims is not None:
            x = x[..., :dims]
        return normalize(x) if self._use_activation(inp) else x

    def _embed_rows(self, pooled: torch.Tensor, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        x = self._projector(pooled) if self._projector else pooled
        return [self._embed(row, inp) for row, inp in zip(x, inputs, strict=True)]

    def _logits_out(self, logits: torch.Tensor, inp: PoolingInput) -> torch.Tensor:
        if self.config.logit_mean is not None:
            logits = logits - self.config.logit_mean
        if self.config.logit_sigma is not None:
            logits = logits / self.config.logit_sigma
        return self._activation(logits) if self._use_activation(inp) else logits

    def _classify_rows(
        self, pooled: torch.Tensor, inputs: list[PoolingInput]
    ) -> list[torch.Tensor]:
        assert self._classifier is not None  # supported_tasks guarantees it
        logits = self._classifier.seq(pooled)
        return [self._logits_out(row, inp) for row, inp in zip(logits, inputs, strict=True)]

    def _token_output(self, inp: PoolingInput) -> torch.Tensor:
        data = self._tok_pool(inp)
        if inp.task == "token_embed":
            x = self._projector(data) if self._projector else data
            return self._embed(x, inp)
        assert self._classifier is not None
        return self._logits_out(self._classifier.token(data), inp)

"""Which API a model serves: its tasks, and the 400s for asking the wrong one.

vLLM 0.33 only registers the routes of the served model's tasks (a
generation route on a pooling model is a 404 there:
vllm/entrypoints/launchers/api_server/routers.py:55-83,
vllm/entrypoints/pooling/factories.py:110-144). paged keeps every route and
answers such a request with a 400 that names the model's task, worded as
vLLM's offline checks (vllm/entrypoints/llm.py:461-466,
vllm/entrypoints/pooling/offline.py:136-186,344-359).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paged.server.errors import InvalidRequestError
from paged.server.st_score_template import SavedScoreTemplate, score_template_for

logger = logging.getLogger(__name__)

GENERATE = "generate"
# vllm/config/model.py:1940-1951: the order in which the model's pooling task is picked.
_POOLING_TASK_PRIORITY = ("embed", "classify", "token_embed", "token_classify")


@dataclass(frozen=True)
class ModelTasks:
    """What the served model can do, and the facts the pooling APIs read from its config.

    `supported_tasks`: vLLM's task names ("generate", "embed", "classify",
    "token_embed", "token_classify"); `pooler_task`: the task the pooler
    config fixes (`--pooler-config '{"task": ...}'`), if any; `id2label` and
    `num_labels` from the Hugging Face config (classification heads);
    `use_sep_token`: whether a cross-encoder's pair gets the tokenizer's
    separator (False for an LLM used as a reranker, vLLM's hf_config flag);
    `score_template`: the server's `--chat-template`, which cross-encoder pairs are
    rendered through (vLLM uses only an explicit template for scoring, never the
    tokenizer's own); `saved_score_template`: the one the model brings (a
    sentence-transformers CrossEncoder's, a GGUF reranker's rerank prompt), used when
    there is no explicit one.
    """

    supported_tasks: tuple[str, ...] = (GENERATE,)
    pooler_task: str | None = None
    id2label: Mapping[int, str] = field(default_factory=dict)
    num_labels: int = 0
    use_sep_token: bool = True
    score_template: str | None = None
    # The model's own score template (st_score_template.py), used when score_template is None.
    saved_score_template: SavedScoreTemplate | None = None

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Any,
        supported_tasks: tuple[str, ...],
        pooler_task: str | None = None,
        score_template: str | None = None,
        saved_score_template: SavedScoreTemplate | None = None,
    ) -> ModelTasks:
        raw = getattr(hf_config, "id2label", None) or {}
        id2label = {int(k): str(v) for k, v in dict(raw).items()}
        num_labels = int(getattr(hf_config, "num_labels", len(id2label)) or 0)
        use_pad = getattr(hf_config, "use_pad_token", None)  # vLLM's deprecated spelling
        use_sep = getattr(hf_config, "use_sep_token", True) if use_pad is None else use_pad
        if (
            getattr(hf_config, "is_original_qwen3_reranker", False)
            and score_template is None
            and saved_score_template is None
            and "classify" in supported_tasks
        ):
            # vllm/entrypoints/pooling/scoring/io_processor.py:477-493
            logger.warning(
                "Serving an original Qwen3 reranker without a --chat-template. The model was "
                "trained with a specific prompt template; running without it may produce "
                "inaccurate relevance scores. Consider specifying `--chat-template "
                "qwen3_reranker.jinja` (vLLM's examples/pooling/score/template/)."
            )
        return cls(
            supported_tasks,
            pooler_task,
            id2label,
            num_labels,
            bool(use_sep),
            score_template,
            saved_score_template,
        )

    def score_template_for(
        self, request_kwargs: Mapping[str, Any] | None
    ) -> tuple[str | None, Mapping[str, Any] | None]:
        """The template a score request renders with and its kwargs (st_score_template.py)."""
        return score_template_for(self.score_template, self.saved_score_template, request_kwargs)

    @property
    def pooling_task(self) -> str | None:
        """The task /pooling and /score use by default (vLLM's get_pooling_task)."""
        if self.pooler_task is not None and self.pooler_task in self.supported_tasks:
            return self.pooler_task
        return next((t for t in _POOLING_TASK_PRIORITY if t in self.supported_tasks), None)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_task is not None

    def _describe(self) -> str:
        return self.pooling_task if self.pooling_task is not None else GENERATE

    def require_generate(self, api: str) -> None:
        """A 400 when `api` (a generation API) is asked of a pooling-only model."""
        if GENERATE in self.supported_tasks:
            return
        raise InvalidRequestError(
            "model",
            f"The model does not support {api}: it is a pooling model (task: "
            f"{self._describe()}), and {api} is only supported for generative models. "
            "Try passing `--runner generate` to use the model as a generative model.",
            code="model_not_supported",
        )

    def require_pooling(self, api: str, task: str) -> None:
        """A 400 unless the model serves `task` (embed, classify, ...) for `api`."""
        if task in self.supported_tasks:
            return
        if not self.is_pooling:
            message = (
                f"The model does not support {api}: it is a generative model (task: "
                f"{GENERATE}), and {api} is only supported for pooling models. Try passing "
                "`--runner pooling` to use the model as a pooling model."
            )
        elif task in ("embed", "token_embed"):
            message = (
                f"Embedding API is not supported by this model (task: {self._describe()}). "
                "Try converting the model using `--convert embed`."
            )
        elif task in ("classify", "token_classify"):
            message = (
                f"Classification API is not supported by this model (task: "
                f"{self._describe()}). Try converting the model using `--convert classify`."
            )
        else:
            message = f"Unsupported task: {task!r} Supported tasks: {self.supported_tasks}"
        raise InvalidRequestError("model", message, code="model_not_supported")

    def score_task(self, api: str) -> str:
        """The task scoring runs: "embed" (bi-encoder) or "classify" (cross-encoder).

        vLLM 0.33 serves /score and /rerank for embedding models and for
        classifiers with exactly one label (pooling/utils.py:220-238).
        """
        task = self.pooling_task
        if task is None:
            self.require_pooling(api, "classify")
        if task == "classify" and self.num_labels != 1:
            raise InvalidRequestError(
                "model",
                "Scoring API is only enabled for num_labels == 1 "
                f"(this classifier has {self.num_labels}).",
                code="model_not_supported",
            )
        if task not in ("embed", "classify"):
            raise InvalidRequestError(
                "model",
                f"This model does not support the Scoring API (task: {task}).",
                code="model_not_supported",
            )
        return task

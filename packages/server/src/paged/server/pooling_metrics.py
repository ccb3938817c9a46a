"""Pooling requests counted apart from generation (paged's own metrics).

vLLM 0.33 has no pooling-specific metric: its pooling requests only show in
`vllm:request_success` and `vllm:prompt_tokens` next to generation ones
(vllm/v1/metrics/loggers.py). These are paged's own, registered under the
default `paged` naming only (like the EPD encoder counters): with
`--metrics-prefix vllm` the exposition stays exactly vLLM's. Recorded by the
API layer once a request's pooled outputs are all in.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

# vLLM 0.33's pooling task names (vllm/tasks.py:9-17) that paged serves.
POOLING_TASK_LABELS = ("embed", "classify", "token_embed", "token_classify")


class PoolingMetrics:
    """`paged:pooling_requests` and `paged:pooling_prompt_tokens`, by model and task.

    One engine request per pooled prompt: an /v1/embeddings call with three
    inputs counts 3; a /score of one query against N documents counts what
    the engine pooled (N pairs for a cross-encoder, 1 + N for a bi-encoder).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model = model_name
        self.requests = Counter(
            "paged:pooling_requests",
            "Finished pooling requests (one per pooled prompt), by task",
            ["model_name", "task"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "paged:pooling_prompt_tokens",
            "Prompt tokens of finished pooling requests, by task",
            ["model_name", "task"],
            registry=registry,
        )
        for task in POOLING_TASK_LABELS:  # zeros exported, so dashboards see every series
            self.requests.labels(model_name, task)
            self.prompt_tokens.labels(model_name, task)

    def record(self, task: str, num_requests: int, num_prompt_tokens: int) -> None:
        """Count `num_requests` finished requests of `task` and their prompt tokens."""
        if task not in POOLING_TASK_LABELS:
            raise ValueError(f"task must be one of {list(POOLING_TASK_LABELS)}, got {task!r}")
        self.requests.labels(self._model, task).inc(num_requests)
        self.prompt_tokens.labels(self._model, task).inc(num_prompt_tokens)

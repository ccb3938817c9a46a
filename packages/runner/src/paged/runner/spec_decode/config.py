"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON, parsed and validated.

vLLM's keys (same names, same defaults):

    method                  "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens  drafted tokens per step (k >= 1); required
    prompt_lookup_min/max   n-gram sizes to match (ngram); one given sets the
                            other, none given: both 5, as vLLM
    model                   the draft model (draft_model): any model paged
                            loads, with the target's tokenizer
    disable_by_batch_size   with at least this many requests decoding in a
                            step, nobody drafts (default: no limit)

paged's own keys for adaptive drafting (vLLM has none; defaults keep it on):

    acceptance_rate_threshold  a request whose recent acceptance rate (an
                               exponential average) falls below this stops
                               drafting for a while (0 disables the rule)
    acceptance_backoff_steps   steps a low-acceptance request goes without
                               drafts before it is probed again (doubles each
                               time it is found low again)
    draft_policy               "cost" (default): drafts per request chosen by
                               the cost model of `policy.py` (n-gram only);
                               "fixed": every match drafts up to k
    row_costs                  the cost policy's row-cost curve, [[rows, cost],
                               ...] from [1, 1.0] (benchmarks/verify_cost.py
                               prints it); default: the measured curve of the
                               runner's compute path (policy.RowCostModel.for_path);
                               a configured curve has no per-request cost

Every error is a `ValueError` naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from paged.runner.spec_decode.policy import RowCostModel

if TYPE_CHECKING:
    from paged.runner.model_config import ModelConfig

SpecMethod = Literal["ngram", "draft_model"]
_METHODS: tuple[SpecMethod, ...] = ("ngram", "draft_model")
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "acceptance_rate_threshold",
    "acceptance_backoff_steps",
    "disable_by_batch_size",
    "draft_policy",
    "row_costs",
)
DraftPolicy = Literal["cost", "fixed"]
# vLLM's default n-gram size when neither bound is given.
_DEFAULT_NGRAM = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding setup (see the module docstring for the keys)."""

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_NGRAM
    prompt_lookup_max: int = _DEFAULT_NGRAM
    model: str | None = None
    acceptance_rate_threshold: float = 0.2
    acceptance_backoff_steps: int = 16
    disable_by_batch_size: int | None = None
    draft_policy: DraftPolicy = "cost"
    # (rows, cost) points of the policy's row-cost curve; None: the path's default.
    row_costs: tuple[tuple[int, float], ...] | None = None
    # The draft model, resolved by the engine's options (draft_model only).
    draft_model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(
                f"speculative_config.method: {self.method!r} is not supported; "
                "use 'ngram' or 'draft_model'"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min: {self.prompt_lookup_min} is larger "
                f"than prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: method 'draft_model' needs a draft model")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(
                "speculative_config.model: method 'ngram' takes no model; "
                "use method 'draft_model' for a draft model"
            )
        threshold = self.acceptance_rate_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(
                f"speculative_config.acceptance_rate_threshold: must be a number, got {threshold!r}"
            )
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(
                f"speculative_config.acceptance_rate_threshold: must be in [0, 1], got {threshold}"
            )
        _check_int("acceptance_backoff_steps", self.acceptance_backoff_steps, 1)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.draft_policy not in ("cost", "fixed"):
            raise ValueError(
                f"speculative_config.draft_policy: {self.draft_policy!r}; use 'cost' or 'fixed'"
            )
        if self.row_costs is not None:
            try:
                curve = RowCostModel.from_pairs(self.row_costs)
            except ValueError as e:
                raise ValueError(f"speculative_config.{e}") from None
            object.__setattr__(self, "row_costs", curve.points)

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots the scheduler reserves beyond a step's tokens for the proposer's own KV.

        A draft model writes the KV of the tokens it drafts (k beyond the last
        known one); the n-gram proposer writes nothing.
        """
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def _check_int(key: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{key}: must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"speculative_config.{key}: must be >= {minimum}, got {value}")


def parse_speculative_config(value: str | dict[str, Any]) -> SpeculativeConfig:
    """`--speculative-config` JSON text (or a dict from `LLM(...)`) -> `SpeculativeConfig`.

    The draft model is not resolved here (`draft_model_config` stays None):
    that needs the target's dtype and device, known to the engine options.
    """
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
    else:
        data = value
    if not isinstance(data, dict):
        raise ValueError(f"speculative_config: must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config.{unknown[0]}: unknown key; supported keys: {', '.join(_KEYS)}"
        )
    method: Any = data.get("method")
    if method is None:
        # vLLM infers the method from the model when none is given.
        method = "draft_model" if data.get("model") else None
    if method is None:
        raise ValueError("speculative_config.method: missing; use 'ngram' or 'draft_model'")
    if "num_speculative_tokens" not in data:
        raise ValueError("speculative_config.num_speculative_tokens: missing")
    lo: Any = data.get("prompt_lookup_min")
    hi: Any = data.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = _DEFAULT_NGRAM
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    extra: dict[str, Any] = {}
    for key in (
        "acceptance_rate_threshold",
        "acceptance_backoff_steps",
        "disable_by_batch_size",
        "draft_policy",
        "row_costs",
    ):
        if key in data:
            extra[key] = data[key]
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=data["num_speculative_tokens"],
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        model=data.get("model"),
        **extra,
    )

"""`SamplingParams`: how one request samples and when it stops.

A frozen msgspec Struct so it crosses the frontend -> engine-core boundary
as compact msgpack. `validate()` is the single place bad values are rejected,
with a `ValueError` naming the field; everything downstream trusts it.
"""

from __future__ import annotations

import enum

import msgspec


class RequestOutputKind(enum.IntEnum):
    """How a request's outputs are reported to the user."""

    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


# Greedy sampling is temperature 0; below this we treat the request as greedy
# to avoid dividing logits by ~0.
_GREEDY_TEMPERATURE = 1e-5
DEFAULT_MAX_LOGPROBS = 20


class StructuredOutputsParams(
    msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, kw_only=True
):
    """One output constraint, as vLLM's `StructuredOutputsParams` (exactly one field set).

    `json`: a JSON schema as JSON text; `json_object`: any JSON object;
    `regex`: a regular expression the whole output matches; `choice`: the output is
    one of these strings; `grammar`: an EBNF/Lark grammar; `structural_tag`: vLLM's
    structural-tag JSON text. Which backend enforces it is the engine's choice.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    # Do not allow whitespace-only freedom beyond what the schema needs (vLLM's flag).
    disable_any_whitespace: bool = False
    # vLLM's per-request `reasoning_ended` (EngineCoreRequest): with a reasoning parser,
    # True constrains from the first token; None lets the engine read the prompt's tags.
    reasoning_ended: bool | None = None

    def kinds(self) -> list[str]:
        """The names of the constraint fields that are set."""
        set_fields = [
            ("json", self.json is not None),
            ("regex", self.regex is not None),
            ("choice", self.choice is not None),
            ("grammar", self.grammar is not None),
            ("json_object", self.json_object),
            ("structural_tag", self.structural_tag is not None),
        ]
        return [name for name, is_set in set_fields if is_set]


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, kw_only=True
):
    """Sampling and stopping parameters, with vLLM's names and defaults.

    `top_k`: 0 or -1 disables it (vLLM accepts both). `max_tokens=None` means
    "as many as fit in max_model_len"; the frontend fills it in before the
    request reaches the engine. `logprobs`/`prompt_logprobs`: number of top
    alternatives to return per position (0 = only the chosen token).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # An output constraint (JSON schema, regex, choice, grammar); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def effective_top_k(self) -> int:
        """top_k with both "off" spellings (0, -1) normalised to 0."""
        return 0 if self.top_k in (0, -1) else self.top_k

    def validate(self, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """Raise `ValueError` naming the first field whose value cannot be served."""
        _require(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(
            self.top_k >= -1,
            "top_k",
            f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}",
        )
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _require(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _require(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.max_tokens is not None:
            _require(
                self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}"
            )
        _require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None:
                _require(value >= 0, name, f"must be >= 0, got {value}")
                _require(
                    value <= max_logprobs,
                    name,
                    f"must be <= {max_logprobs} (the configured max_logprobs), got {value}",
                )
        _require(all(s for s in self.stop), "stop", "must not contain empty strings")
        _require(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )
        if self.seed is not None:
            _require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        if self.structured_outputs is not None:
            kinds = self.structured_outputs.kinds()
            _require(
                len(kinds) == 1,
                "structured_outputs",
                f"must set exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {kinds or 'none'}",
            )
            choice = self.structured_outputs.choice
            if choice is not None:
                _require(bool(choice), "structured_outputs", "choice must not be empty")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")

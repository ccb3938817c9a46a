"""Request constraint fields -> one `StructuredOutputsParams`, as vLLM reads them.

Sources, at most one per request (two is a 400 naming both):

    response_format     {"type": "json_object"}
                        {"type": "json_schema", "json_schema": {"schema": ...}}
                        {"type": "structural_tag", "structures": [...], "triggers": [...]}
    structured_outputs  vLLM's: json | regex | choice | grammar | json_object | structural_tag
    guided_json / guided_regex / guided_choice / guided_grammar  vLLM's older fields

Only the shape is checked here; whether the schema, regex or grammar compiles
is `paged.server.structured_output.validate`'s job (off the event loop, in AsyncLLM).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from paged.scheduler import StructuredOutputsParams
from paged.server.errors import InvalidRequestError
from paged.server.openai.protocol import ResponseFormat, SamplingFields

# vLLM's StructuredOutputsParams fields this server honours; others are refused by name.
_STRUCTURED_KEYS = frozenset(
    {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
    | {"disable_any_whitespace"}
)
# vLLM fields that only pick or tune a backend: accepted, nothing to do here.
_BACKEND_KEYS = frozenset({"backend", "disable_fallback"})


def _schema_text(param: str, schema: object) -> str:
    if isinstance(schema, str):
        return schema  # already JSON text; the compiler reports bad JSON by param
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(param, f"{param} must be a JSON schema object")
    return json.dumps(schema)


def _from_response_format(rf: ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "structural_tag":
        # vLLM passes the whole response_format as the tag's JSON; the compiler checks it.
        return StructuredOutputsParams(
            structural_tag=json.dumps(rf.model_dump(exclude_none=True, exclude={"json_schema"}))
        )
    spec = rf.json_schema
    if spec is None:
        raise InvalidRequestError(
            "response_format.json_schema", "response_format json_schema needs a json_schema object"
        )
    # OpenAI's field is "schema"; some clients send "json_schema" (vLLM accepts both).
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        raise InvalidRequestError(
            "response_format.json_schema.schema", "response_format.json_schema needs a schema"
        )
    return StructuredOutputsParams(json=_schema_text("response_format.json_schema.schema", schema))


def _from_structured_outputs(raw: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(raw) - _STRUCTURED_KEYS - _BACKEND_KEYS)
    if unknown:
        raise InvalidRequestError(
            "structured_outputs", f"structured_outputs fields not supported: {unknown}"
        )
    fields = {k: v for k, v in raw.items() if k in _STRUCTURED_KEYS and v is not None}
    for key in ("json", "structural_tag"):
        if key in fields:
            fields[key] = _schema_text(f"structured_outputs.{key}", fields[key])
    try:
        # The Struct is array_like: build it by keyword, then round-trip to check the types.
        params = StructuredOutputsParams(**fields)
        return msgspec.convert(msgspec.to_builtins(params), StructuredOutputsParams)
    except msgspec.ValidationError as e:
        raise InvalidRequestError("structured_outputs", f"structured_outputs: {e}") from None


def structured_outputs_field(raw: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's `structured_outputs` object alone (the Responses endpoint takes it too)."""
    params = _from_structured_outputs(raw)
    kinds = params.kinds()
    if len(kinds) != 1:
        raise InvalidRequestError(
            "structured_outputs",
            f"structured_outputs must set exactly one constraint, got {kinds or 'none'}",
        )
    return params


def _from_guided(req: SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.guided_json is not None:
        text = _schema_text("guided_json", req.guided_json)
        found.append(("guided_json", StructuredOutputsParams(json=text)))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputsParams(regex=req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", StructuredOutputsParams(choice=req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputsParams(grammar=req.guided_grammar)))
    return found


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; `InvalidRequestError` for two or a bad shape."""
    found = _from_guided(req)
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    if req.response_format is not None:
        rf = _from_response_format(req.response_format)
        if rf is not None:
            found.append(("response_format", rf))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise InvalidRequestError(
            names[1], f"give at most one output constraint; got {', '.join(names)}"
        )
    if not found:
        return None
    name, params = found[0]
    kinds = params.kinds()
    if len(kinds) != 1:
        raise InvalidRequestError(
            name, f"{name} must set exactly one constraint, got {kinds or 'none'}"
        )
    if params.choice is not None and not params.choice:
        raise InvalidRequestError(name, f"{name}: choice must not be empty")
    return params

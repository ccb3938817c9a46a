"""Tool calling for any model: the generic format, for chat templates that ignore `tools`.

Many chat templates (SmolLM2's, the default model's, among them) never read
`tools`: the model would not see them, and `tool_choice: "auto"` could never
call one. For such a template paged does what llama.cpp's server does with its
"generic" format (common/chat.cpp, `common_chat_params_init_generic` and
minja's tool polyfills):

- the tools, an instruction and an example call go into the system turn
  (appended to the conversation's own system message, or a new one first);
- the output is constrained to one JSON object, `{"tool_calls": [...]}` or, for
  `"auto"`, `{"response": "..."}` (`generic_tool_schema`), which
  `tool_parsers.generic` reads back into `tool_calls` or `content`;
- the tool round trip is written as text the template can render whatever
  roles it knows: an assistant's `tool_calls` become the JSON it would have
  written, and a `tool` message becomes a user turn holding the result.

Templates that do read `tools` (found by rendering a probe with and without
them, `template_ignores_tools`) keep their own format and parsers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from paged.server.chat_utils import normalize_messages
from paged.server.openai.tool_types import FunctionTool, ToolRequest, hoist_defs
from paged.server.structured_output.json_options import forbid_additional_properties
from paged.server.tokenizer import TokenizerLike
from paged.server.tool_parsers.generic import ARGUMENTS_KEY, CALLS_KEY, RESPONSE_KEY

# A tool no template knows: if it leaves no trace in the prompt, the template ignores tools.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "paged_probe_tool_4f1c",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
_PROBE_MESSAGES = [{"role": "user", "content": "probe"}]


def template_ignores_tools(tokenizer: TokenizerLike, chat_template: str) -> bool:
    """True when `chat_template` renders the same prompt with and without `tools`.

    A template that fails only when given tools cannot show them either. Any
    error (a request's own template may raise OverflowError, RecursionError, ...)
    ends the probe: the request's real render reports it as a 400.
    """

    def render(**extra: Any) -> str:
        text = tokenizer.apply_chat_template(
            _PROBE_MESSAGES,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=True,
            **extra,
        )
        return str(text)

    try:
        plain = render()
    except Exception:
        return False
    try:
        with_tools = render(tools=[_PROBE_TOOL])
    except Exception:
        return True
    return plain == with_tools


class ToolTemplateProbe:
    """`template_ignores_tools`, remembered per template text (a server sees very few)."""

    def __init__(self, tokenizer: TokenizerLike, max_entries: int = 16) -> None:
        self._tokenizer = tokenizer
        self._max_entries = max_entries
        self._known: dict[str, bool] = {}

    def ignores_tools(self, chat_template: str) -> bool:
        found = self._known.get(chat_template)
        if found is None:
            found = template_ignores_tools(self._tokenizer, chat_template)
            if len(self._known) >= self._max_entries:
                self._known.pop(next(iter(self._known)))
            self._known[chat_template] = found
        return found


# -- the schema the output follows ------------------------------------------------------


def _call_item(tool: FunctionTool) -> dict[str, Any]:
    # Closed objects: a weak model otherwise invents keys (seen: "type", "description"
    # with a paragraph of text) that the function would refuse.
    params = forbid_additional_properties(tool.parameters or {"type": "object", "properties": {}})
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.name]},
            ARGUMENTS_KEY: params,
        },
        "required": ["name", ARGUMENTS_KEY],
        "additionalProperties": False,
    }


def generic_tool_schema(req: ToolRequest) -> dict[str, Any]:
    """`{"tool_calls": [...]}`, or for "auto" that or `{"response": "..."}`.

    "named": the array holds one call of that function (vLLM's named choice). Otherwise
    it holds one call (`maxItems`) unless the request asked for `parallel_tool_calls: true`
    (llama.cpp's default too): greedy small models otherwise repeat calls until
    `max_tokens` (measured: SmolLM2-135M wrote 4-6 calls where one was asked for).
    Argument objects allow no keys beyond their `properties`.
    """
    tools = [t for t in req.tools if req.mode != "named" or t.name == req.named]
    tools, defs = hoist_defs(tools)
    items = [_call_item(t) for t in tools]
    array: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if req.mode == "named" or not req.parallel_tool_calls_asked:
        array["maxItems"] = 1  # a named choice is one call of that function, as vLLM's
    calls = {
        "type": "object",
        "properties": {CALLS_KEY: array},
        "required": [CALLS_KEY],
        "additionalProperties": False,
    }
    schema: dict[str, Any] = calls
    if req.mode == "auto":
        response = {
            "type": "object",
            "properties": {RESPONSE_KEY: {"type": "string", "minLength": 1}},
            "required": [RESPONSE_KEY],
            "additionalProperties": False,
        }
        schema = {"anyOf": [calls, response]}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


# -- the prompt ---------------------------------------------------------------------------

_EXAMPLE_VALUES: dict[str, Any] = {
    "string": "...",
    "integer": 1,
    "number": 1.5,
    "boolean": True,
    "array": [],
    "object": {},
}


def _example_value(schema: Any) -> Any:
    if not isinstance(schema, Mapping):
        return "..."
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if isinstance(schema.get("examples"), list) and schema["examples"]:
        return schema["examples"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return _EXAMPLE_VALUES.get(kind if isinstance(kind, str) else "string", "...")


def example_arguments(tool: FunctionTool) -> dict[str, Any]:
    """An arguments object for the prompt's example: the required properties, typed."""
    params = tool.parameters or {}
    props = params.get("properties")
    if not isinstance(props, Mapping):
        return {}
    required = params.get("required")
    names = [n for n in props if not isinstance(required, list) or n in required]
    return {name: _example_value(props[name]) for name in names}


def _tool_line(tool: FunctionTool) -> str:
    spec: dict[str, Any] = {"name": tool.name}
    if tool.description:
        spec["description"] = tool.description
    spec["parameters"] = tool.parameters or {"type": "object", "properties": {}}
    return json.dumps(spec, ensure_ascii=False)


def _call_json(name: str, arguments: Any) -> str:
    return json.dumps({CALLS_KEY: [{"name": name, ARGUMENTS_KEY: arguments}]}, ensure_ascii=False)


def tool_system_text(req: ToolRequest) -> str:
    """The instruction that describes the tools and the reply's shape (system turn)."""
    tools = [t for t in req.tools if req.mode != "named" or t.name == req.named]
    first = tools[0]
    lines = ["You can call these tools:", *(_tool_line(t) for t in tools), ""]
    call_shape = _call_json("<tool name>", {"<argument>": "<value>"})
    if req.mode == "auto":
        lines += [
            "Reply with one JSON object.",
            f"To call a tool, reply: {call_shape}",
            f'To answer without a tool, reply: {{"{RESPONSE_KEY}": "<your answer>"}}',
            "Call a tool when the user asks for something it does; otherwise answer. "
            "After a tool's result, answer the user with it.",
        ]
    else:
        lines.append(f"Reply by calling a tool with one JSON object: {call_shape}")
    lines.append(f"Example: {_call_json(first.name, example_arguments(first))}")
    return "\n".join(lines)


# -- the conversation ---------------------------------------------------------------------


def _call_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """tool_call_id -> function name, from the assistants' calls."""
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            if isinstance(call.get("id"), str) and isinstance(fn.get("name"), str):
                names[call["id"]] = fn["name"]
    return names


def _assistant_calls_text(calls: Sequence[Mapping[str, Any]]) -> str:
    written = [
        {"name": c["function"].get("name"), ARGUMENTS_KEY: c["function"].get("arguments") or {}}
        for c in calls
    ]
    return json.dumps({CALLS_KEY: written}, ensure_ascii=False)


def _tool_result_text(message: Mapping[str, Any], names: Mapping[str, str]) -> str:
    name = message.get("name") or names.get(message.get("tool_call_id") or "", "tool")
    return f"Result of {name}: {message.get('content') or ''}"


def generic_messages(
    messages: Sequence[Mapping[str, Any]],
    req: ToolRequest | None,
    *,
    allow_images: bool = False,
) -> list[dict[str, Any]]:
    """The conversation as a template that knows no tools can render it.

    Checked as any chat (`normalize_messages`: 400s name the message); then
    assistant calls become their generic JSON, tool results user turns, and
    for a tool choice other than "none" the tool instruction joins the system turn.
    """
    conversation = normalize_messages(messages, allow_images=allow_images)
    names = _call_names(conversation)
    out: list[dict[str, Any]] = []
    for m in conversation:
        if m["role"] == "tool":
            out.append({"role": "user", "content": _tool_result_text(m, names)})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _assistant_calls_text(m["tool_calls"])})
        else:
            out.append(m)
    if req is None or req.mode == "none" or not req.tools:
        return out
    text = tool_system_text(req)
    if out and out[0]["role"] in ("system", "developer") and isinstance(out[0]["content"], str):
        first = out[0]["content"]
        out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out

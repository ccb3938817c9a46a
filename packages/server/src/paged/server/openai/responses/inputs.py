"""Responses `instructions` + history + `input` -> chat messages for the chat template.

vLLM 0.33's order (responses/utils.py:263-305, construct_input_messages): the
request's `instructions` as a system message, the previous response's
conversation without its system messages (instructions do not carry over),
the previous response's output, then the new input. Input items map as
utils.py:326-470 does: a `function_call` joins the preceding assistant
message's `tool_calls` (or starts one), a `function_call_output` becomes a
`tool` message, a `reasoning` item becomes the assistant's `reasoning`.

Unlike vLLM, a previous response's `function_call` items are carried into the
history too (vLLM keeps only its messages), so a `function_call_output` sent
with `previous_response_id` answers a call the template can see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from paged.server.errors import InvalidRequestError
from paged.server.openai.responses.protocol import (
    FunctionToolCall,
    OutputItem,
    OutputMessage,
    ReasoningItem,
    ResponsesRequest,
)
from paged.server.reasoning import REASONING_EFFORTS, effort_template_kwargs

Message = dict[str, Any]
_ROLES = ("user", "system", "developer", "assistant")
# Reasoning items carry `reasoning_text` content and `summary_text` summaries.
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def _text_of(content: object, where: str) -> str:
    """A message's content as plain text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(where, f"{where} must be a string or a list of content parts")
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS:
            raise InvalidRequestError(
                f"{where}[{j}].type",
                f"content part type {kind!r} is not supported; use 'input_text'",
            )
        assert isinstance(part, Mapping)
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}[{j}].text", "text must be a string")
        texts.append(text)
    return "".join(texts)


def _required_str(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


def _prev_assistant(messages: list[Message]) -> Message | None:
    return messages[-1] if messages and messages[-1].get("role") == "assistant" else None


def _add_tool_call(messages: list[Message], call_id: str, name: str, arguments: str) -> None:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    prev = _prev_assistant(messages)
    if prev is not None:
        prev.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _add_assistant_text(messages: list[Message], text: str) -> None:
    prev = _prev_assistant(messages)
    if prev is not None and prev.get("content") is None:
        prev["content"] = text  # reasoning or calls came first: one assistant turn
    else:
        messages.append({"role": "assistant", "content": text})


def _add_reasoning(messages: list[Message], text: str) -> None:
    prev = _prev_assistant(messages)
    if prev is not None and prev.get("reasoning") is None:
        prev["reasoning"] = text
    else:
        messages.append({"role": "assistant", "content": None, "reasoning": text})


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    if item.get("encrypted_content"):
        raise InvalidRequestError(where, "Encrypted content is not supported.")
    for key in ("content", "summary"):  # vLLM: content first, else the summary
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            return _text_of(parts[:1], f"{where}.{key}")
    return ""


def _tool_output_text(output: object, where: str) -> str:
    if isinstance(output, str):
        return output
    return _text_of(output, where)


def _add_item(messages: list[Message], item: object, where: str) -> None:
    if not isinstance(item, Mapping):
        raise InvalidRequestError(where, f"{where} must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(
                f"{where}.role", f"role must be one of {list(_ROLES)}, got {role!r}"
            )
        text = _text_of(item.get("content"), f"{where}.content")
        if role == "assistant":
            _add_assistant_text(messages, text)
        else:
            messages.append({"role": role, "content": text})
    elif kind == "function_call":
        arguments = _required_str(item, "arguments", where)
        _add_tool_call(
            messages,
            _required_str(item, "call_id", where),
            _required_str(item, "name", where),
            arguments,
        )
    elif kind == "function_call_output":
        call_id = _required_str(item, "call_id", where)
        content = _tool_output_text(item.get("output"), f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
    elif kind == "reasoning":
        _add_reasoning(messages, _reasoning_text(item, where))
    else:
        raise InvalidRequestError(f"{where}.type", f"Unsupported input item type: {kind}")


def _add_output(messages: list[Message], output: Sequence[OutputItem]) -> None:
    """A stored response's output items, as the assistant's turn."""
    for item in output:
        if isinstance(item, OutputMessage):
            for part in item.content:
                _add_assistant_text(messages, part.text)
        elif isinstance(item, FunctionToolCall):
            _add_tool_call(messages, item.call_id, item.name, item.arguments)
        elif isinstance(item, ReasoningItem):
            continue  # vLLM skips the previous reasoning (utils.py:288)


def input_messages(
    instructions: str | None,
    request_input: str | list[dict[str, Any]],
    previous_messages: Sequence[Message] | None = None,
    previous_output: Sequence[OutputItem] | None = None,
) -> list[Message]:
    """The conversation to render; `InvalidRequestError` naming `input[i]...` for a bad item."""
    messages: list[Message] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous_messages is not None:
        messages.extend(
            json.loads(json.dumps(m)) for m in previous_messages if m.get("role") != "system"
        )
    if previous_output is not None:
        _add_output(messages, previous_output)
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
        return messages
    if not request_input and not messages:
        raise InvalidRequestError("input", "input must not be empty")
    for i, item in enumerate(request_input):
        _add_item(messages, item, f"input[{i}]")
    for m in messages:
        if m.get("content") is None and not m.get("tool_calls"):
            m["content"] = ""  # a reasoning-only turn: templates need text
    return messages


def stored_conversation(messages: Sequence[Message]) -> list[Message]:
    """What the store keeps of a request's input: the messages (a deep copy)."""
    return [json.loads(json.dumps(m)) for m in messages]


def template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """The chat template's kwargs: the request's, with `reasoning.effort` applied."""
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequestError(
            "reasoning.effort",
            f"reasoning.effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
        )
    return effort_template_kwargs(effort, req.chat_template_kwargs)

"""Chat messages -> prompt text through the tokenizer's chat template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from paged.server.errors import InvalidRequestError
from paged.server.tokenizer import TokenizerLike

VALID_ROLES = ("system", "developer", "user", "assistant", "tool")
# A plain template for tokenizers that ship none (ChatML, what SmolLM2 uses).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


IMAGE_PART_TYPES = ("image_url",)


def image_part_url(part: Mapping[str, Any], where: str) -> str:
    """The URL of an OpenAI `image_url` part ({"url": ...} or, as vLLM allows, a string)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{where}.image_url.url", "image_url.url must be a string")
    return url


def collect_image_urls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every image URL of the conversation, in order (messages, then parts)."""
    urls: list[str] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, Sequence) and not isinstance(content, str):
            for j, part in enumerate(content):
                if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                    urls.append(image_part_url(part, f"messages[{i}].content[{j}]"))
    return urls


def _content_parts(content: Sequence[object], where: str) -> list[dict[str, Any]]:
    """Text and image parts in HF chat-template form ({"type": "image"} stands for one image)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if isinstance(part, Mapping) and kind in IMAGE_PART_TYPES:
            image_part_url(part, f"{where}.content[{j}]")
            parts.append({"type": "image"})
        elif isinstance(part, Mapping) and kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{where}.content[{j}].text", "must be a string")
            parts.append({"type": "text", "text": text})
        else:
            raise InvalidRequestError(
                f"{where}.content[{j}]",
                f"content part type {kind!r} is not supported (supported: text, image_url)",
            )
    return parts


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                if kind in IMAGE_PART_TYPES:
                    raise InvalidRequestError(
                        f"{where}.content[{j}]",
                        "this model is text-only: it does not accept image inputs",
                    )
                raise InvalidRequestError(
                    f"{where}.content[{j}]", f"content part type {kind!r} is not supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{where}.content[{j}].text", "must be a string")
            parts.append(text)
        return "\n".join(parts)
    raise InvalidRequestError(f"{where}.content", "must be a string or a list of text parts")


def _may_omit_content(message: Mapping[str, Any]) -> bool:
    # OpenAI: an assistant message's content is "required unless tool_calls
    # or function_call is specified"; every other role needs content (a null
    # user or system content is a 400 there, not an empty turn).
    return message.get("role") == "assistant" and bool(
        message.get("tool_calls") or message.get("function_call")
    )


def _message_text(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if content is not None:
        return _content_text(content, where)
    if _may_omit_content(message):
        return ""
    raise InvalidRequestError(
        f"{where}.content",
        f"Invalid value for '{where}.content': expected a string or a list of text parts, "
        "got null (only an assistant message with tool_calls may omit its content)",
    )


def _template_tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant's `tool_calls` as chat templates expect them: arguments as objects.

    OpenAI sends arguments as JSON text; HF tool-use templates (and vLLM, which
    parses them the same way) iterate them as a mapping. Empty or missing -> `{}`.
    """
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise InvalidRequestError(f"{where}.tool_calls", "tool_calls must be a list")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(call, Mapping) or not isinstance(fn, Mapping):
            raise InvalidRequestError(
                f"{where}.tool_calls[{j}].function", "each tool call needs a function object"
            )
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                raise InvalidRequestError(
                    f"{where}.tool_calls[{j}].function.arguments", "arguments must be JSON text"
                ) from None
        elif not isinstance(args, Mapping | list):
            args = {}
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _has_image_parts(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    return (
        isinstance(content, Sequence)
        and not isinstance(content, str)
        and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES for p in content)
    )


def _template_message(
    message: Mapping[str, Any], where: str, allow_images: bool = False
) -> dict[str, Any]:
    content: str | list[dict[str, Any]]
    if allow_images and _has_image_parts(message):
        # A multimodal template (Gemma3's) writes its image placeholder per part.
        content = _content_parts(message["content"], where)
    else:
        content = _message_text(message, where)
    out: dict[str, Any] = {"role": str(message.get("role")), "content": content}
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = _template_tool_calls(message["tool_calls"], where)
    if out["role"] == "assistant":
        # A previous turn's thinking, under both names as vLLM 0.33 gives it to the
        # template (renderers/chat_utils/chat_message.py:655-659); `reasoning_content`
        # is the deprecated request name of `reasoning` (chat_completion/protocol.py:598).
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise InvalidRequestError(f"{where}.reasoning", "reasoning must be a string")
            out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], *, allow_images: bool = False
) -> list[dict[str, Any]]:
    """Validate messages; flatten text parts to strings; keep tool calls and their ids.

    With `allow_images` (a multimodal model), a message with image parts keeps
    its content as a list of `{"type": "text", ...}` / `{"type": "image"}` parts.
    """
    if not messages:
        raise InvalidRequestError("messages", "messages must contain at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in VALID_ROLES:
            raise InvalidRequestError(
                f"{where}.role", f"role must be one of {', '.join(VALID_ROLES)}; got {role!r}"
            )
        out.append(_template_message(message, where, allow_images))
    return out


def apply_chat_template(
    tokenizer: TokenizerLike,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    allow_images: bool = False,
) -> str:
    """Render `messages` (and `tools`, for tool-use templates) to the prompt text."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )
    conversation = normalize_messages(messages, allow_images=allow_images)
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise InvalidRequestError(
            "continue_final_message", "the final message must have role 'assistant'"
        )
    template = chat_template or getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **({"tools": list(tools)} if tools else {}),
            **dict(chat_template_kwargs or {}),
        )
    # OverflowError: the sandbox refusing a huge range(); RecursionError: a
    # self-recursive macro. Both are the request's template at fault.
    except (ValueError, TypeError, OverflowError, RecursionError, jinja2.TemplateError) as e:
        raise InvalidRequestError("messages", f"the chat template failed: {e}") from e
    if not isinstance(text, str):
        raise InvalidRequestError("messages", "the chat template did not render to text")
    return text

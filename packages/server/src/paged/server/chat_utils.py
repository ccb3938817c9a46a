"""Chat messages -> prompt text through the tokenizer's chat template."""

from __future__ import annotations

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


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(
                    f"{where}.content[{j}]", f"content part type {kind!r} is not supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{where}.content[{j}].text", "must be a string")
            parts.append(text)
        return "\n".join(parts)
    if content is None:
        return ""
    raise InvalidRequestError(f"{where}.content", "must be a string or a list of text parts")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Validate messages and flatten text parts to plain strings."""
    if not messages:
        raise InvalidRequestError("messages", "messages must contain at least one message")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in VALID_ROLES:
            raise InvalidRequestError(
                f"{where}.role", f"role must be one of {', '.join(VALID_ROLES)}; got {role!r}"
            )
        out.append({"role": str(role), "content": _content_text(message.get("content"), where)})
    return out


def apply_chat_template(
    tokenizer: TokenizerLike,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render `messages` to the prompt text the model expects."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )
    conversation = normalize_messages(messages)
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
            **dict(chat_template_kwargs or {}),
        )
    # OverflowError: the sandbox refusing a huge range(); RecursionError: a
    # self-recursive macro. Both are the request's template at fault.
    except (ValueError, TypeError, OverflowError, RecursionError, jinja2.TemplateError) as e:
        raise InvalidRequestError("messages", f"the chat template failed: {e}") from e
    if not isinstance(text, str):
        raise InvalidRequestError("messages", "the chat template did not render to text")
    return text

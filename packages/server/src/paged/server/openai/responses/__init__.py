"""vLLM 0.33's Responses API (`/v1/responses`): request and item shapes, input
rendering, output items and stream events, the opt-in store, and the handler."""

from paged.server.openai.responses.serving import OpenAIServingResponses
from paged.server.openai.responses.store import ResponseStore, store_enabled_from_env

__all__ = ["OpenAIServingResponses", "ResponseStore", "store_enabled_from_env"]

"""Weight loading: local Hugging Face directories (safetensors) and GGUF files."""

from paged.runner.loader.loader import iterate_weights, load_model

__all__ = ["iterate_weights", "load_model"]

"""The served models: the base model under its name, and the LoRA adapters by theirs.

The one place the API resolves a request's `model` (vLLM 0.33's
OpenAIServingModels, vllm/entrypoints/openai/models/serving.py, and
OpenAIServing._check_model, vllm/entrypoints/serve/engine/serving.py:49-84):

- absent or the served name -> the base model; a loaded adapter's name -> that
  adapter; anything else -> 404 "The model `x` does not exist."
- /v1/models lists the base model, then each adapter with `root` (its path)
  and `parent` (its base_model_name, else the served name).
- /v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's checks and
  messages (models/serving.py:247-296). Unlike vLLM, an adapter that fails to
  load is a 400 naming the cause (vLLM answers 500 for anything but a missing
  path), and unloading also unloads the weights from the engine once the
  requests already running with the adapter finished (vLLM only forgets the
  name: the engine keeps the weights until its LRU cache evicts them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged.server.errors import InvalidRequestError
from paged.server.lora import LoRAModulePath, LoRARequest
from paged.server.openai.protocol import ModelCard, ModelList

if TYPE_CHECKING:
    from paged.server.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class ModelNotFoundError(InvalidRequestError):
    """404: `model` names neither the served model nor a loaded adapter."""

    def __init__(self, model: str, served: str | None = None) -> None:
        message = f"The model `{model}` does not exist."
        if served is not None:
            message += f" Valid aliases: {served}."
        super().__init__("model", message, code="model_not_found")


class LoRANotFoundError(InvalidRequestError):
    """404 on unload: no adapter of that name is loaded (vLLM's NotFoundError)."""

    def __init__(self, name: str) -> None:
        super().__init__("lora_name", f"The lora adapter '{name}' cannot be found.")


class ServedModels:
    """What `model` may name on this server; adapters live in `llm.loras`."""

    def __init__(self, llm: AsyncLLM, model_name: str, model_root: str | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.model_root = model_root

    def is_base_model(self, name: str) -> bool:
        return name == self.model_name

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); ModelNotFoundError otherwise."""
        if not model or self.is_base_model(model):
            return None
        lora = self.llm.loras.get(model)
        if lora is None:
            raise ModelNotFoundError(model, self.model_name)
        return lora

    def response_name(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name, else the served name."""
        return model if model else self.model_name

    def model_list(self) -> ModelList:
        cards = [
            ModelCard(
                id=self.model_name, root=self.model_root, max_model_len=self.llm.max_model_len
            )
        ]
        for lora in self.llm.loras.requests():
            cards.append(
                ModelCard(
                    id=lora.lora_name,
                    root=lora.lora_path,
                    parent=lora.base_model_name or self.model_name,
                )
            )
        return ModelList(data=cards)

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, base_model_name: str | None = None
    ) -> str:
        """Load an adapter; InvalidRequestError (400) with vLLM's messages, or the cause."""
        if not lora_name or not lora_path:
            raise InvalidRequestError(None, "Both 'lora_name' and 'lora_path' must be provided.")
        if self.is_base_model(lora_name):
            raise InvalidRequestError(
                "lora_name",
                f"The lora adapter '{lora_name}' conflicts with a served base model.",
            )
        # vLLM's message, less its hint at load_inplace (refused here, see lora_routes).
        already = InvalidRequestError(
            "lora_name", f"The lora adapter '{lora_name}' has already been loaded."
        )
        if lora_name in self.llm.loras:
            raise already
        base = base_model_name if base_model_name and self.is_base_model(base_model_name) else None
        lora = LoRARequest(lora_name, self.llm.loras.next_int_id(), lora_path, base)
        try:
            loaded_now = await self.llm.add_lora(lora)
        except InvalidRequestError:
            raise  # loaded meanwhile from another path (a concurrent load)
        except ValueError as exc:
            raise InvalidRequestError("lora_path", str(exc)) from exc
        if not loaded_now:  # a concurrent load of the same name and path won
            raise already
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", lora_name, lora_path)
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: str) -> str:
        if not lora_name:
            raise InvalidRequestError(
                "lora_name", "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        if lora_name not in self.llm.loras:
            raise LoRANotFoundError(lora_name)
        await self.llm.remove_lora(lora_name)
        logger.info("Removed LoRA adapter: name '%s'", lora_name)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    async def load_static(self, modules: Sequence[LoRAModulePath]) -> None:
        """`--lora-modules`, at start-up: ValueError (the server does not start) on failure."""
        for module in modules:
            try:
                await self.load_lora_adapter(module.name, module.path, module.base_model_name)
            except InvalidRequestError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from exc

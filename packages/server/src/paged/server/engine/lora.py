"""The engine core's LoRA utilities: add, remove and list adapters on every worker.

vLLM 0.33's `EngineCore.add_lora / remove_lora / list_loras` (vllm/v1/engine/core.py)
forward to the executor, which runs them on every worker (collective_rpc). paged
does the same through `LoRAExecutor`, with two additions:

- `add_lora` of a name already loaded is refused (ValueError "already loaded"):
  names identify adapters in block hashes and events, so one name must keep its
  weights for as long as the engine runs.
- `remove_lora` of an adapter that unfinished requests still use is deferred:
  the name is gone from `list_loras` at once, the weights stay until the last
  of those requests finished (`after_step` removes them). vLLM's executor
  removes at once and leaves running requests to reload the adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig

logger = logging.getLogger(__name__)


@runtime_checkable
class LoRAExecutor(Protocol):
    """The executor's LoRA methods (paged.runner's executors; run on every worker).

    `add_lora` loads and validates the adapter, raising ValueError with the
    cause (missing file, rank above max_lora_rank, a module the model lacks,
    shapes that do not match); `remove_lora` answers whether it was loaded.
    """

    def add_lora(self, spec: LoRAAdapterSpec) -> None: ...

    def remove_lora(self, name: str) -> bool: ...

    def list_loras(self) -> list[str]: ...


class EngineLoRAs:
    """Adapters known to one engine core.

    `executor` is None when the executor has no LoRA methods; `in_use` returns
    the adapter names of the scheduler's unfinished requests.
    """

    def __init__(
        self,
        lora_config: LoRAConfig | None,
        executor: object,
        in_use: Callable[[], set[str]],
    ) -> None:
        self.lora_config = lora_config
        self._executor = executor if isinstance(executor, LoRAExecutor) else None
        self._in_use = in_use
        self._loaded: dict[str, LoRAAdapterSpec] = {}
        # Removed by the frontend, kept on the workers until no request uses them.
        self._removing: set[str] = set()
        self._removing_paths: dict[str, str] = {}

    def _require(self) -> LoRAExecutor:
        if self.lora_config is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")
        if self._executor is None:
            raise ValueError("this engine's executor does not serve LoRA adapters")
        return self._executor

    def check_request(self, request_id: str, name: str | None, path: str | None) -> None:
        """A request naming an adapter: ValueError unless LoRA is on and the adapter known."""
        if name is None:
            return
        if self.lora_config is None:
            raise ValueError(
                f"request {request_id!r} names LoRA adapter {name!r} but LoRA is not "
                "enabled (--enable-lora)"
            )
        if path is None:
            raise ValueError(f"request {request_id!r} names LoRA adapter {name!r} without a path")

    def add_lora(self, name: str, path: str, int_id: int = 0) -> None:
        executor = self._require()
        if not name:
            raise ValueError("lora_name: must be a non-empty string")
        if not path:
            raise ValueError("lora_path: must be a non-empty string")
        if name in self._loaded:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        spec = LoRAAdapterSpec(name=name, path=path, int_id=int_id)
        if name in self._removing:
            # Removed but still on the workers for its running requests.
            if self._removing_paths.get(name) != path:
                raise ValueError(
                    f"LoRA adapter {name!r} was removed but requests still use its "
                    "previous weights; load it under another name or retry when they finish"
                )
            self._removing.discard(name)
            self._loaded[name] = spec
            return
        executor.add_lora(spec)
        self._loaded[name] = spec
        logger.info("Loaded LoRA adapter %r from %s", name, path)

    def remove_lora(self, name: str) -> bool:
        """Forget `name`; False if it was not loaded. Its weights go once unused."""
        executor = self._require()
        spec = self._loaded.pop(name, None)
        if spec is None:
            return False
        if name in self._in_use():
            self._removing.add(name)
            self._removing_paths[name] = spec.path
            logger.info("LoRA adapter %r removed; unloaded when its requests finish", name)
        else:
            executor.remove_lora(name)
        return True

    def list_loras(self) -> list[str]:
        self._require()
        return list(self._loaded)

    def lora_path(self, name: str) -> str | None:
        spec = self._loaded.get(name)
        return spec.path if spec is not None else None

    def after_step(self) -> None:
        """Unload the removed adapters no unfinished request uses any more."""
        if not self._removing or self._executor is None:
            return
        done = self._removing - self._in_use()
        for name in done:
            self._executor.remove_lora(name)
            logger.info("Unloaded LoRA adapter %r", name)
        self._removing -= done
        for name in done:
            self._removing_paths.pop(name, None)

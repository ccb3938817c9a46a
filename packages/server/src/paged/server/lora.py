"""The frontend's LoRA adapters: `LoRARequest` (vLLM's), the served-adapter registry, flags.

- `LoRARequest(lora_name, lora_int_id, lora_path)` is vLLM 0.33's offline/engine
  type (vllm/lora/request.py) with its field names; `generate(...,
  lora_request=...)` loads the adapter on the engine the first time a name is
  seen, then tags the request with the name (and path, for the runner's reloads).
- `LoRAModulePath(name, path, base_model_name)` and `parse_lora_modules` are
  `--lora-modules` (vllm/entrypoints/common/cli_args.py:38-69): `name=path`, or a
  JSON object `{"name", "path", "base_model_name"}`.
- `LoRARegistry` is what the frontend knows is loaded (names -> requests); a
  per-name lock makes two concurrent first uses load once.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from paged.server.errors import InvalidRequestError

# vLLM's envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING (vllm/envs.py:1204-1207).
RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """vLLM's parsing: "1" or "true" (any case, spaces stripped) enables it."""
    env = os.environ if environ is None else environ
    return env.get(RUNTIME_LORA_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's `LoRARequest`; equal by name, as there).

    `lora_int_id` must be >= 1 (vLLM's check); `lora_path` is a PEFT directory
    (adapter_config.json + adapter_model.safetensors) or a llama.cpp GGUF LoRA.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name: must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path: must not be empty")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's `LoRAModulePath`)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: Iterable[str]) -> list[LoRAModulePath]:
    """`--lora-modules` values -> entries; ValueError naming the bad item.

    As vLLM: an item with "=" and no "," is `name=path`; anything else is JSON
    `{"name": ..., "path": ..., "base_model_name": ...}`; empty items are skipped.
    """
    modules: list[LoRAModulePath] = []
    for item in items:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(_module(item, name, path, None))
            continue
        try:
            data = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        if not isinstance(data, dict) or set(data) - {"name", "path", "base_model_name"}:
            raise ValueError(
                f"Invalid fields for --lora-modules: {item} - expected an object with "
                "'name', 'path' and optionally 'base_model_name'"
            )
        name_v, path_v, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not isinstance(name_v, str) or not isinstance(path_v, str):
            raise ValueError(
                f"Invalid fields for --lora-modules: {item} - 'name' and 'path' "
                "are required strings"
            )
        if base is not None and not isinstance(base, str):
            raise ValueError(
                f"Invalid fields for --lora-modules: {item} - 'base_model_name' must be a string"
            )
        modules.append(_module(item, name_v, path_v, base))
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules: adapter name(s) given twice: {', '.join(duplicates)}")
    return modules


def _module(item: str, name: str, path: str, base: str | None) -> LoRAModulePath:
    if not name or not path:
        raise ValueError(f"Invalid --lora-modules item {item!r}: name and path must not be empty")
    return LoRAModulePath(name=name, path=path, base_model_name=base)


class LoRARegistry:
    """The adapters this frontend loaded on the engine, by name.

    `ensure_loaded` is the only way in: it calls `add_lora` (the engine's
    utility, raising ValueError with the cause) at most once per name, under a
    per-name lock. A name already loaded from another path is refused: names
    key the prefix cache, one name must mean one set of weights.
    """

    def __init__(self) -> None:
        self._loaded: dict[str, LoRARequest] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._next_id = 1

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def get(self, name: str) -> LoRARequest | None:
        return self._loaded.get(name)

    def requests(self) -> list[LoRARequest]:
        """Loaded adapters, in load order."""
        return list(self._loaded.values())

    def next_int_id(self) -> int:
        """A fresh `lora_int_id` (vLLM's counter in OpenAIServingModels)."""
        value = self._next_id
        self._next_id += 1
        return value

    def check_same(self, request: LoRARequest) -> bool:
        """True if `request`'s name is loaded (from its path); InvalidRequestError if
        the name is loaded from another path."""
        known = self._loaded.get(request.lora_name)
        if known is None:
            return False
        if known.lora_path != request.lora_path:
            raise InvalidRequestError(
                "lora_request",
                f"LoRA adapter {request.lora_name!r} is already loaded from "
                f"{known.lora_path!r}, not {request.lora_path!r}",
            )
        return True

    async def ensure_loaded(
        self, request: LoRARequest, add_lora: Callable[[LoRARequest], Awaitable[None]]
    ) -> bool:
        """True if this call loaded it, False if it was loaded (also by a concurrent call)."""
        if self.check_same(request):
            return False
        lock = self._locks.setdefault(request.lora_name, asyncio.Lock())
        async with lock:
            if self.check_same(request):
                return False
            await add_lora(request)
            self._loaded[request.lora_name] = request
            self._next_id = max(self._next_id, request.lora_int_id + 1)
            return True

    def record_loaded(self, request: LoRARequest) -> None:
        """For a synchronous caller (the offline `LLM`) that called add_lora itself."""
        self._loaded[request.lora_name] = request
        self._next_id = max(self._next_id, request.lora_int_id + 1)

    def forget(self, name: str) -> LoRARequest | None:
        self._locks.pop(name, None)
        return self._loaded.pop(name, None)

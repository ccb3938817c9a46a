"""`LoRAManager`: the runner's adapters, host cache, device slots and per-step rows.

    add_lora(spec) -> load + validate against the model -> host cache (LRU, max_cpu_loras)
    begin_step(rows) -> each distinct adapter of the step gets a device slot
                        (kept across steps; a new one takes a free slot, else the
                        least recently used slot no row of this step needs), its
                        A/B written zero-padded into every target's stacks;
                        token_slots [T] (-1: base row) goes to the LoRA layers
                        through the `LoRABatch` this manager owns
    end_step()       -> the layers see no LoRA rows again (graphs, profile runs)

An adapter evicted from the host cache is reloaded from its path on the next
step that needs it (the path comes from `add_lora` or from the request's
`NewRequestData.lora_path`), so a request whose adapter was unloaded while it
ran still finishes with it. The scheduler keeps at most max_loras distinct
adapters in a step; a step with more fails with a RuntimeError saying so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from paged.kernels.lora import group_lora_rows
from paged.runner.cpu_step.fused import FusedLayers
from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig
from paged.runner.lora.layer import LoRABatch, LoRASlice
from paged.runner.lora.targets import attach_lora_layers
from paged.runner.lora.weights import LoRAAdapterWeights
from paged.scheduler.boundary import NewRequestData

__all__ = ["LoRAManager", "check_adapter_fits"]

# path -> weights (lora/loading.py's load_adapter with the config and model facts bound).
AdapterLoader = Callable[[str], LoRAAdapterWeights]


class LoRAManager:
    """See the module docstring; one per ModelRunner (per rank), built after the model loads."""

    def __init__(
        self,
        config: LoRAConfig,
        model: nn.Module,
        model_dtype: torch.dtype,
        device: torch.device,
        loader: AdapterLoader,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = (
            model_dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        )
        self.batch = LoRABatch(
            scaling=torch.zeros(config.max_loras, dtype=torch.float32, device=device),
            ranks=torch.zeros(config.max_loras, dtype=torch.int64, device=device),
        )
        self.targets: dict[str, LoRASlice] = attach_lora_layers(
            model, self.batch, config.max_loras, config.max_lora_rank, self.dtype, device
        )
        for module in model.modules():
            fused = getattr(module, "cpu_fused", None)
            if isinstance(fused, FusedLayers):
                # Steps with LoRA rows run fused when the stack carries every layer's C
                # plan, else (float16 stacks, no compiler) per op.
                fused.watch_lora(lambda: self.batch.active)
        self._loader = loader
        self._host: OrderedDict[str, LoRAAdapterWeights] = OrderedDict()  # LRU order
        self._paths: dict[str, str] = {}
        self._slot_names: list[str | None] = [None] * config.max_loras
        self._slot_used: list[int] = [0] * config.max_loras  # step count of the last use
        self._step = 0

    # ------------------------------------------------------------ adapters

    def add_lora(self, spec: LoRAAdapterSpec) -> None:
        """Load and validate `spec`; ValueError with the cause (or "already loaded")."""
        if spec.name in self._host:
            raise ValueError(f"LoRA adapter {spec.name!r} is already loaded")
        weights = self._load(spec.name, spec.path)
        self._paths[spec.name] = spec.path
        self._free_slot_of(spec.name)  # a slot may still hold an older copy of this name
        self._keep(spec.name, weights)

    def remove_lora(self, name: str) -> bool:
        """Forget `name`'s weights (host and device); False if it was not loaded.

        Its path is remembered: a running request that uses it reloads it.
        """
        self._free_slot_of(name)
        return self._host.pop(name, None) is not None

    def list_loras(self) -> list[str]:
        """The adapters loaded in host memory, least recently used first."""
        return list(self._host)

    def note_requests(self, new_reqs: Iterable[NewRequestData]) -> None:
        """Remember where each new request's adapter lives (reload after an eviction)."""
        for req in new_reqs:
            if req.lora_request is not None and req.lora_path is not None:
                self._paths[req.lora_request] = req.lora_path

    # ---------------------------------------------------------------- step

    def begin_step(
        self, row_adapters: list[str | None], num_scheduled: npt.NDArray[np.int32]
    ) -> None:
        """Give this step's adapters device slots and publish the tokens' slots."""
        self._step += 1
        wanted = list(dict.fromkeys(n for n in row_adapters if n is not None))
        if not wanted:
            self.end_step()
            return
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"this step has {len(wanted)} distinct LoRA adapters {wanted}, more than "
                f"max_loras={self.config.max_loras} (the scheduler must keep to it)"
            )
        slot_of = {name: self._slot_for(name, set(wanted)) for name in wanted}
        row_slots = np.array([slot_of[n] if n is not None else -1 for n in row_adapters])
        token_slots = np.repeat(row_slots.astype(np.int64), num_scheduled[: len(row_adapters)])
        host = torch.from_numpy(token_slots)
        self.batch.groups = group_lora_rows(host, self.device)
        self.batch.token_slots = host.to(self.device)

    def end_step(self) -> None:
        self.batch.token_slots = None
        self.batch.groups = None

    # ------------------------------------------------------------ internals

    def _slot_for(self, name: str, needed: set[str]) -> int:
        if name in self._slot_names:
            slot = self._slot_names.index(name)
        else:
            weights = self._host_weights(name)
            free = [s for s, n in enumerate(self._slot_names) if n is None or n not in needed]
            slot = min(free, key=lambda s: (self._slot_names[s] is not None, self._slot_used[s]))
            for module, target in self.targets.items():
                pair = weights.modules.get(module)
                target.write(
                    slot,
                    None if pair is None else pair.lora_a,
                    None if pair is None else pair.lora_b,
                )
            self.batch.scaling[slot] = weights.scaling
            self.batch.ranks[slot] = weights.rank
            self._slot_names[slot] = name
        self._slot_used[slot] = self._step
        return slot

    def _host_weights(self, name: str) -> LoRAAdapterWeights:
        weights = self._host.get(name)
        if weights is not None:
            self._host.move_to_end(name)
            return weights
        path = self._paths.get(name)
        if path is None:
            raise ValueError(
                f"LoRA adapter {name!r} is not loaded and no lora_path is known for it"
            )
        weights = self._load(name, path)
        self._keep(name, weights)
        return weights

    def _load(self, name: str, path: str) -> LoRAAdapterWeights:
        weights = self._loader(path)
        check_adapter_fits(name, weights, self.config, self.targets)
        return weights

    def _keep(self, name: str, weights: LoRAAdapterWeights) -> None:
        self._host[name] = weights
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)  # a device slot keeps its copy until reused

    def _free_slot_of(self, name: str) -> None:
        if name in self._slot_names:
            slot = self._slot_names.index(name)
            self._slot_names[slot] = None
            self._slot_used[slot] = 0


def check_adapter_fits(
    name: str, weights: LoRAAdapterWeights, config: LoRAConfig, targets: dict[str, LoRASlice]
) -> None:
    """ValueError naming the module and shapes unless `weights` fits this model and the limits."""
    if weights.rank > config.max_lora_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: rank {weights.rank} is greater than max_lora_rank "
            f"{config.max_lora_rank}"
        )
    for module, pair in weights.modules.items():
        target = targets.get(module)
        if target is None:
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} does not exist in this model "
                f"(or cannot carry LoRA; e.g. {next(iter(targets))!r})"
            )
        a, b = tuple(pair.lora_a.shape), tuple(pair.lora_b.shape)
        rank = a[0] if len(a) == 2 else -1
        if (
            a != (rank, target.full_in)
            or b != (target.full_out, rank)
            or rank > config.max_lora_rank
        ):
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} has lora_A {a} and lora_B {b}; the "
                f"base layer needs lora_A [r, {target.full_in}] and lora_B [{target.full_out}, r] "
                f"with r <= {config.max_lora_rank}"
            )

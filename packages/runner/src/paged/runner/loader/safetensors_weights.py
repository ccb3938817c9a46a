"""Weights from a local Hugging Face directory: single or sharded safetensors.

Sharded checkpoints list their files in `model.safetensors.index.json`; every
listed file must exist and every tensor must sit in the file the index says.
Any unreadable file (truncated download, not safetensors) raises one
ValueError naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of `model_dir`, from the index when there is one."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"model: {str(index)!r} is not a valid safetensors index ({exc})"
            ) from exc
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ValueError(
                f"model: {str(index)!r} lists weight files that are missing: {', '.join(missing)}; "
                "the download is incomplete"
            )
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: directory {str(model_dir)!r} has no *.safetensors weights")
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, CPU tensor) for every tensor of the checkpoint."""
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types on bad headers
            raise ValueError(
                f"model: cannot read {str(path)!r} as safetensors ({exc}); the file is "
                "truncated or corrupt: re-download it"
            ) from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:
                    raise ValueError(
                        f"model: tensor {name!r} in {str(path)!r} cannot be read ({exc}); "
                        "the file is truncated or corrupt: re-download it"
                    ) from exc
                yield name, tensor

"""LoRA flags, vLLM 0.33's names and defaults (vllm/engine/arg_utils.py:694-706, 1603-1630;
--lora-modules: vllm/entrypoints/common/cli_args.py:38-85).

`--enable-lora`, `--max-loras` (adapters in one step, default 1), `--max-lora-rank`
(one of vLLM's ranks, default 16), `--max-cpu-loras` (adapters kept in host memory,
default: max_loras), `--lora-dtype` (auto, float16, bfloat16; float32 is paged's
addition) on every engine command; `--lora-modules` on `serve` only. A bad value
exits with status 2 before anything loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from paged.runner.lora.config import LORA_DTYPES, MAX_LORA_RANKS
from paged.server.lora import parse_lora_modules


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters (vLLM's LoRAConfig flags)")
    g.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters on the base model (PEFT directories or llama.cpp GGUF LoRAs)",
    )
    g.add_argument(
        "--max-loras",
        type=_positive_int,
        default=1,
        help="most distinct adapters in one batch (default 1)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=_int,
        choices=MAX_LORA_RANKS,
        default=16,
        help="largest adapter rank accepted (default 16)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=_int,
        default=None,
        help="adapters kept loaded in host memory, LRU beyond (default: --max-loras)",
    )
    g.add_argument(
        "--lora-dtype",
        choices=LORA_DTYPES,
        default="auto",
        help="dtype of the adapters' deltas (auto: the model's dtype)",
    )


class _LoRAModulesAction(argparse.Action):
    """vLLM's LoRAParserAction: every value parsed; a bad one is a usage error (exit 2)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = [values] if isinstance(values, str) else list(values or [])
        try:
            modules = parse_lora_modules(str(v) for v in items)
        except ValueError as exc:
            parser.error(str(exc))
        setattr(namespace, self.dest, modules)


def add_lora_modules_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action=_LoRAModulesAction,
        default=[],
        metavar="NAME=PATH|JSON",
        help='LoRA adapters served at start-up, as name=path or JSON {"name": ..., "path": '
        '..., "base_model_name": ...}; clients pick one with `model` (needs --enable-lora)',
    )


def lora_engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The `EngineArgs` fields of these flags."""
    return {
        "enable_lora": ns.enable_lora,
        "max_loras": ns.max_loras,
        "max_lora_rank": ns.max_lora_rank,
        "max_cpu_loras": ns.max_cpu_loras,
        "lora_dtype": ns.lora_dtype,
    }

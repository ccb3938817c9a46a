"""The `paged` commands that run a model in this process: generate, chat, tokenizer.

`cli.py` parses the flags and dispatches here; these build an offline `LLM`
(or only the tokenizer) from the parsed `EngineArgs`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from paged.server.engine_args import EngineArgs


def _sampling(ns: argparse.Namespace) -> Any:
    from paged.scheduler import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
    )


def generate_command(args: EngineArgs, ns: argparse.Namespace) -> int:
    """`paged generate`: one completion (or chat turn with --chat), printed."""
    from paged.server.llm import LLM

    llm = LLM(**vars(args))
    try:
        if ns.chat:
            outs = llm.chat([{"role": "user", "content": ns.prompt}], _sampling(ns), use_tqdm=False)
        else:
            outs = llm.generate(ns.prompt, _sampling(ns), use_tqdm=False)
        print(outs[0].outputs[0].text)
    finally:
        llm.shutdown()
    return 0


def chat_command(args: EngineArgs, ns: argparse.Namespace) -> int:
    """`paged chat`: an interactive chat on the terminal."""
    from paged.server.chat_cli import run_chat
    from paged.server.llm import LLM

    llm = LLM(**vars(args))
    try:
        return run_chat(llm, _sampling(ns), ns.system)
    finally:
        llm.shutdown()


def add_tokenizer_parser(sub: Any) -> None:
    """Register `paged tokenizer` on the subcommand parsers."""
    tok = sub.add_parser(
        "tokenizer",
        help="print the Hugging Face tokenizer directory of MODEL (for load tools)",
        description="Print the directory holding MODEL's tokenizer in Hugging Face form, "
        "which load generators (aiperf, guidellm, vllm bench) take as --tokenizer. For a "
        "GGUF file (the default model included) it is where paged saved the tokenizer it "
        "rebuilt from the file, built now if needed.",
    )
    tok.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct)",
    )
    tok.add_argument("--tokenizer", help="a tokenizer source that overrides MODEL's")


def tokenizer_command(ns: argparse.Namespace) -> int:
    """`paged tokenizer`: print the tokenizer directory of MODEL."""
    from paged.server.tokenizer import tokenizer_directory

    try:
        print(tokenizer_directory(ns.model, tokenizer=ns.tokenizer))
    except ValueError as e:
        print(f"paged tokenizer: error: {e}", file=sys.stderr)
        return 2
    return 0

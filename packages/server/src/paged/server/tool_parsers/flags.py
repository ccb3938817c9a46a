"""vLLM's tool-calling flags for `paged serve` (argparse only: no server imports)."""

from __future__ import annotations

import argparse

from paged.server.tool_parsers.registry import AUTO, TOOL_CALL_PARSERS


def add_tool_calling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool calling")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the model decides; needs --tool-call-parser). '
        "Not needed where the generic format is used (a chat template that ignores tools, "
        "or --tool-call-parser generic)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=[*TOOL_CALL_PARSERS, AUTO],
        default=None,
        help="how tool calls are read from the model's text; 'auto' (paged's own) picks "
        "hermes when the chat template writes <tool_call>, mistral for [TOOL_CALLS], "
        "llama3_json for Llama 3 templates, generic when it ignores tools; 'generic' "
        "(paged's own) describes the tools in the system turn and constrains the reply to "
        'JSON ({"tool_calls": [...]} or {"response": ...}) for any model. Default: generic '
        "where the chat template ignores tools, else vLLM's rule (auto tool choice refused)",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='do not show the tools to the chat template when tool_choice is "none"',
    )


def check_tool_calling_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """vLLM refuses --enable-auto-tool-choice without a parser at start-up."""
    if getattr(ns, "enable_auto_tool_choice", False) and ns.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")

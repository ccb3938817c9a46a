"""`paged run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [engine flags]` (vLLM's run-batch).

The flags: vLLM's -i/--input-file, -o/--output-file, --max-inflight, the
engine flags of `paged serve`, its --served-model-name, --chat-template and
tool-calling flags. Files and flags are checked before the model loads.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from paged.server.batch.files import BatchOutput, check_batch_files, read_batch_input
from paged.server.engine_args import EngineArgs

logger = logging.getLogger("paged.server.run_batch")


def add_run_batch_parser(
    sub: Any,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    positive_int: Callable[[str], int],
) -> None:
    """The subcommand with the engine flags (`add_engine_args`) and its own; `positive_int`:
    the CLI's integer-at-least-1 argparse type."""
    from paged.server.tool_parsers.flags import add_tool_calling_args

    rb = sub.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests and write their results",
        description="Run the requests of an OpenAI Batch file (JSON lines: custom_id, method, "
        "url, body; url /v1/chat/completions or /v1/completions) through the engine and "
        "write one result line per request, in input order. Local paths or http(s) URLs.",
        usage="paged run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [options]",
    )
    add_engine_args(rb)
    g = rb.add_argument_group("batch")
    g.add_argument(
        "-i", "--input-file", required=True, help="the batch file: a path or an http(s) URL (GET)"
    )
    g.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="the results: a path (written as requests finish) or an http(s) URL (PUT at the end)",
    )
    g.add_argument(
        "--max-inflight",
        type=positive_int,
        default=None,
        help="requests submitted at once (default: twice --max-num-seqs, at least 1024)",
    )
    g.add_argument("--served-model-name", help="the name the bodies' `model` must match")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template: a file, or the Jinja text itself",
    )
    add_tool_calling_args(rb)


def run_batch_command(args: EngineArgs, ns: argparse.Namespace) -> int:
    """Run the batch; the exit status (ValueError for bad files or flags, before loading)."""
    from tqdm import tqdm

    from paged.server.batch.endpoints import openai_endpoints, pooling_endpoints
    from paged.server.batch.engine import batch_serving, default_max_inflight
    from paged.server.batch.runner import run_batch_lines
    from paged.server.openai.tools import ToolCallingConfig

    check_batch_files(ns.input_file, ns.output_file)
    args.reasoning_parser_name()  # the engine options are checked by batch_serving
    lines = read_batch_input(ns.input_file)
    count = sum(1 for line in lines if line.strip())
    max_inflight = min(ns.max_inflight or default_max_inflight(args), max(count, 1))
    tools = ToolCallingConfig(
        ns.enable_auto_tool_choice, ns.tool_call_parser, ns.exclude_tools_when_tool_choice_none
    )
    with batch_serving(args, tool_config=tools, chat_template=ns.chat_template) as serving:
        output = BatchOutput(ns.output_file)
        try:
            with tqdm(
                total=count, unit="req", desc="Running batch", mininterval=5, file=sys.stderr
            ) as bar:
                written = asyncio.run(
                    run_batch_lines(
                        lines,
                        {
                            **openai_endpoints(serving.openai, serving.tasks),
                            **pooling_endpoints(serving.pooling),
                        },
                        output.write,
                        max_inflight=max_inflight,
                        on_done=lambda: bar.update(),
                    )
                )
        finally:
            output.close()
    logger.info("wrote %d results to %s", written, ns.output_file)
    return 0

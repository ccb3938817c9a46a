"""`paged proxy`: its flags and its command (the router itself is proxy.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_proxy_parser(sub: Any) -> None:
    """`paged proxy`: the P/D (and EPD) router's flags."""
    proxy = sub.add_parser(
        "proxy",
        help="route OpenAI requests to prefill and decode instances (P/D disaggregation)",
        description="Send each request to a prefill instance (max_tokens 1, "
        "kv_transfer_params do_remote_decode), then to a decode instance with the KV "
        "it returned; round robin over each list. The instances run `paged serve` with "
        "--kv-transfer-config naming PagedZmqConnector (or vLLM with NixlConnector).",
    )
    proxy.add_argument(
        "--encode",
        action="append",
        default=[],
        metavar="URL",
        help="an encoder-only instance (paged serve --ec-role producer); requests with "
        "images go there first",
    )
    proxy.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill instance (required unless --encode is given)",
    )
    proxy.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode instance"
    )
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument(
        "--port", type=int, default=8000, help="TCP port to listen on (default 8000)"
    )
    proxy.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for an instance's answer"
    )


def proxy_command(ns: argparse.Namespace) -> int:
    """Run `paged proxy`; 2 on a bad option, 130 on Ctrl-C."""
    from paged.server.proxy import run_proxy

    try:
        run_proxy(
            ns.prefill,
            ns.decode,
            host=ns.host,
            port=ns.port,
            log_level=ns.log_level,
            timeout_s=ns.timeout,
            encode=ns.encode,
        )
    except ValueError as e:
        print(f"paged proxy: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0

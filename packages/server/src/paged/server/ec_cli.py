"""`paged serve --ec-connector / --ec-role / --ec-connector-extra-config` (the seed's flags).

Shorthands for `--ec-transfer-config` (vLLM's JSON), as in the seed's EPD
example:

    paged serve MODEL --ec-connector ECZmqConnector --ec-role producer \
        --ec-connector-extra-config '{"listen_port": 5700}'

is `--ec-transfer-config '{"ec_connector": "ECZmqConnector", "ec_role": "ec_producer",
"ec_connector_extra_config": {"listen_port": 5700}}'`. Giving both forms is an
error; `--ec-role` alone means the ECZmqConnector.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_EC_CONNECTOR = "ECZmqConnector"


def add_ec_shorthand_args(group: Any) -> None:
    group.add_argument(
        "--ec-connector",
        default=None,
        metavar="NAME",
        help=f"encoder-cache connector (default with --ec-role: {DEFAULT_EC_CONNECTOR})",
    )
    group.add_argument(
        "--ec-role",
        default=None,
        choices=["producer", "consumer", "both", "ec_producer", "ec_consumer", "ec_both"],
        help="producer: an encode-only EPD instance (vision encoder only, no KV cache; its "
        "answers name where each image's embeddings are held: ec_transfer_params); "
        "consumer: loads embeddings from the producer each request's ec_transfer_params "
        "name (as `paged proxy --encode` forwards them), else encodes them itself",
    )
    group.add_argument(
        "--ec-connector-extra-config",
        default=None,
        metavar="JSON",
        help='connector keys, e.g. \'{"listen_port": 5700, "advertise_host": "enc-0"}\' '
        "(producer) or '{\"transfer_timeout\": 5}' (consumer; optional static "
        '"producer_endpoints" for requests that name none)',
    )


def ec_transfer_config_from(ns: argparse.Namespace) -> str | None:
    """The `--ec-transfer-config` JSON the flags mean; exits 2 (as argparse) if they clash."""
    try:
        return ec_transfer_config_json(ns)
    except ValueError as exc:
        print(f"paged {getattr(ns, 'command', 'serve')}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def ec_transfer_config_json(ns: argparse.Namespace) -> str | None:
    """The `--ec-transfer-config` JSON the flags mean; `ValueError` for a bad combination."""
    full = getattr(ns, "ec_transfer_config", None)
    connector = getattr(ns, "ec_connector", None)
    role = getattr(ns, "ec_role", None)
    extra_text = getattr(ns, "ec_connector_extra_config", None)
    if connector is None and role is None and extra_text is None:
        return str(full) if full is not None else None
    if full is not None:
        raise ValueError(
            "--ec-transfer-config and --ec-connector/--ec-role/--ec-connector-extra-config "
            "are exclusive; put everything in --ec-transfer-config"
        )
    if role is None:
        raise ValueError("--ec-role is required with --ec-connector / --ec-connector-extra-config")
    extra: Any = {}
    if extra_text is not None:
        try:
            extra = json.loads(extra_text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--ec-connector-extra-config is not valid JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("--ec-connector-extra-config must be a JSON object")
    return json.dumps(
        {
            "ec_connector": connector or DEFAULT_EC_CONNECTOR,
            "ec_role": role,
            "ec_connector_extra_config": extra,
        }
    )

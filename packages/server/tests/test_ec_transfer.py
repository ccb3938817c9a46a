"""EC transfer wiring in the server: --ec-transfer-config validation, the builder, its roles."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from paged.connectors.ec import ECConnectorRole
from paged.connectors.ec.example import ECExampleConnector
from paged.runner.ec_connector import ECConnectorWorkerFactory
from paged.server.cli import build_parser, engine_args_from, main
from paged.server.ec_transfer import (
    ECConnectorBuilder,
    ec_connector_builder,
    ec_load_failure_policy,
)
from paged.server.engine_args import _check_ec_model

# mypy proves the builder satisfies the runner's factory Protocol.
_FACTORY_CHECK: type[ECConnectorWorkerFactory] = ECConnectorBuilder


def _example(path: Path, role: str = "ec_consumer", **extra: object) -> str:
    return json.dumps(
        {
            "ec_connector": "ECExampleConnector",
            "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(path)},
            **extra,
        }
    )


def test_builder_validates_and_pickles_to_both_roles(tmp_path: Path) -> None:
    assert ec_connector_builder(None) is None
    assert ec_connector_builder('{"ec_role": "ec_both"}') is None  # no connector named
    builder = ec_connector_builder(_example(tmp_path, "consumer"), model_name="/models/tiny/")
    assert builder is not None and builder.model_name == "tiny"
    clone = pickle.loads(pickle.dumps(builder))
    worker = clone.make_worker_ec_connector(1, 2)
    assert isinstance(worker, ECExampleConnector) and worker.role is ECConnectorRole.WORKER
    assert worker.context.rank == 1 and worker.is_consumer and not worker.is_producer
    sched = clone.make_scheduler_ec_connector(2)
    assert sched.role is ECConnectorRole.SCHEDULER
    assert sched.ec_transfer_config.ec_role == "ec_consumer"  # the alias, stored as vLLM's
    assert sched.ec_transfer_config.engine_id == builder.config().engine_id  # fixed once


def test_cli_flag_reaches_engine_args(tmp_path: Path) -> None:
    config = _example(tmp_path)
    ns = build_parser().parse_args(["serve", "m", "--ec-transfer-config", config])
    assert engine_args_from(ns).ec_transfer_config == config


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("{", "not valid JSON"),
        ('{"ec_connector": "Nope", "ec_role": "ec_both"}', "unknown EC connector 'Nope'"),
        ('{"ec_connector": "ECExampleConnector"}', "ec_role is required"),
        ('{"ec_connector": "ECExampleConnector", "ec_role": "encoder"}', "ec_role"),
        (
            '{"ec_connector": "X", "ec_role": "both", "ec_connector_module_path": "no_mod"}',
            "cannot import module 'no_mod'",
        ),
    ],
)
def test_cli_stops_with_one_message_on_a_bad_config(
    config: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model does not exist: the config is checked before anything loads.
    assert main(["serve", "/nonexistent-model", "--ec-transfer-config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paged serve: error: ") and fragment in err
    assert "Traceback" not in err


def test_load_failure_policy_is_read_off_the_config(tmp_path: Path) -> None:
    builder = ec_connector_builder(_example(tmp_path, ec_load_failure_policy="fail"))
    assert builder is not None and builder.config().ec_load_failure_policy == "fail"

    class _Config:
        ec_connector_factory = builder

    assert ec_load_failure_policy(cast(Any, _Config())) == "fail"


def test_a_text_only_model_is_refused() -> None:
    text_only = SimpleNamespace(hf_config=SimpleNamespace(), architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match="LlamaForCausalLM has no vision encoder"):
        _check_ec_model(cast(Any, text_only))
    with_vision = SimpleNamespace(
        hf_config=SimpleNamespace(vision_config={}, mm_tokens_per_image=4), architecture="G"
    )
    _check_ec_model(cast(Any, with_vision))

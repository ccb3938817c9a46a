"""vLLM's multi-node flags of the mp executor: --nnodes, --node-rank, --master-addr/-port."""

from __future__ import annotations

import pytest

from paged.server.cli import build_parser, engine_args_from, main
from paged.server.multi_node import check_node_role


def test_flags_reach_the_engine_args_with_vllms_defaults() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "m",
            "-tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "4000",
            "--headless",
        ]
    )
    args = engine_args_from(ns)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        2, 1, "10.0.0.1", 4000,
    )  # fmt: skip
    default = engine_args_from(build_parser().parse_args(["serve", "m"]))
    assert (default.nnodes, default.node_rank, default.master_addr, default.master_port) == (
        1, 0, None, 29501,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--master-port", "65535"], "must be in 1..65534"),
        (["--nnodes", "-1"], "must be >= 0"),
        (["--node-rank", "x"], "expected an integer"),
    ],
)
def test_the_parser_refuses_bad_values(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", *argv])
    assert message in capsys.readouterr().err


def test_node_roles() -> None:
    assert check_node_role(1, 0, False, 1) is False  # one node: nothing changes
    assert check_node_role(2, 0, False, 1) is False  # node 0: API server + engine
    assert check_node_role(2, 1, True, 1) is True  # a headless worker node
    assert check_node_role(1, 0, True, 2) is False  # a DP headless node is DP's business


@pytest.mark.parametrize(
    ("nnodes", "node_rank", "headless", "dp", "message"),
    [
        (2, 1, False, 1, "node 1 runs only its workers; add --headless"),
        (2, 0, True, 1, "node 0 .* drop --headless"),
        (2, 1, True, 2, "with --data-parallel-size > 1"),
        (1, 1, True, 1, "node_rank: 1 needs --nnodes > 1"),
    ],
)
def test_contradictory_roles_are_refused(
    nnodes: int, node_rank: int, headless: bool, dp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_node_role(nnodes, node_rank, headless, dp)


def test_the_cli_says_what_is_wrong_before_loading_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["serve", "/nonexistent", "-tp", "2", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "127.0.0.1"])  # fmt: skip
    assert code == 2
    assert "paged serve: error: headless: node 1 runs only its workers" in capsys.readouterr().err


def test_a_world_the_nodes_do_not_divide_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--device", "cpu", "-tp", "2", "--nnodes", "3", "--node-rank", "2",
                 "--master-addr", "127.0.0.1", "--headless"])  # fmt: skip
    assert code == 2
    assert "nnodes: 3 does not divide the world size 2" in capsys.readouterr().err

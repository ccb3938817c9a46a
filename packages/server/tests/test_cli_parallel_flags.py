"""vLLM's --distributed-executor-backend, paged's --ray-placement-strategy and --cpu-threads."""

from __future__ import annotations

import pytest

from paged.server.cli import build_parser, engine_args_from


def test_ray_backend_and_strategy_flags() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "m",
            "-tp",
            "2",
            "--distributed-executor-backend",
            "ray",
            "--ray-placement-strategy",
            "SPREAD",
        ]
    )
    args = engine_args_from(ns)
    assert args.tensor_parallel_size == 2
    assert args.distributed_executor_backend == "ray"
    assert args.ray_placement_strategy == "SPREAD"
    default = engine_args_from(build_parser().parse_args(["serve", "m"]))
    assert default.distributed_executor_backend is None
    assert default.ray_placement_strategy == "PACK"


def test_unknown_backend_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--distributed-executor-backend", "slurm"])
    assert "invalid choice: 'slurm'" in capsys.readouterr().err


def test_cpu_threads_flag_reaches_the_parallel_config(capsys: pytest.CaptureFixture[str]) -> None:
    from paged.runner.config import ParallelConfig

    args = engine_args_from(build_parser().parse_args(["serve", "m", "--cpu-threads", "3"]))
    assert args.cpu_threads == 3
    assert engine_args_from(build_parser().parse_args(["serve", "m"])).cpu_threads is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--cpu-threads", "0"])
    assert "--cpu-threads" in capsys.readouterr().err
    assert ParallelConfig(cpu_threads=3).cpu_threads == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        ParallelConfig(cpu_threads=0)

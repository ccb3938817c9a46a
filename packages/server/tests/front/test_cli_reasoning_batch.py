"""`--reasoning-parser` and `paged run-batch` flags: checked before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged.server.cli import build_parser, engine_args_from, main
from paged.server.engine_args import EngineArgs


@pytest.mark.parametrize("command", ["serve", "run-batch", "generate", "chat"])
def test_unknown_reasoning_parser_exits_2_at_once(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = {"run-batch": ["-i", "in.jsonl", "-o", "out.jsonl"], "generate": ["-p", "x"]}
    with pytest.raises(SystemExit) as exc:
        main([command, *extra.get(command, []), "--reasoning-parser", "deepseek-r1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown reasoning parser 'deepseek-r1'" in err and "deepseek_r1, qwen3, think" in err


def test_reasoning_parser_flag_maps_to_engine_args() -> None:
    ns = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert engine_args_from(ns).reasoning_parser_name() == "qwen3"
    ns = build_parser().parse_args(["serve", "--reasoning-parser", "None"])
    assert engine_args_from(ns).reasoning_parser is None  # vLLM: "none" means unset
    config = '{"reasoning_parser": "think"}'
    assert EngineArgs(structured_outputs_config=config).reasoning_parser_name() == "think"
    both = EngineArgs(reasoning_parser="qwen3", structured_outputs_config=config)
    assert both.reasoning_parser_name() == "qwen3"  # the flag wins


def test_run_batch_flags(tmp_path: Path) -> None:
    ns = build_parser().parse_args(
        [
            "run-batch",
            "-i",
            "a.jsonl",
            "-o",
            "b.jsonl",
            "--max-inflight",
            "4",
            "--max-num-seqs",
            "8",
        ]
    )
    assert (ns.input_file, ns.output_file, ns.max_inflight) == ("a.jsonl", "b.jsonl", 4)
    assert engine_args_from(ns).max_num_seqs == 8  # the engine flags of `serve`
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run-batch", "-i", "a.jsonl", "-o", "b", "--max-inflight", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run-batch", "-o", "b.jsonl"])  # -i is required


def test_run_batch_bad_files_fail_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.jsonl"
    # A model path that does not exist either: the file check must come first.
    argv = ["run-batch", "/nonexistent/model", "-i", str(missing), "-o", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--input-file" in capsys.readouterr().err

"""`paged serve`'s tool-calling flags (vLLM's names) reach the server as a ToolCallingConfig."""

from __future__ import annotations

from typing import Any

import pytest

from paged.server import serve
from paged.server.cli import main
from paged.server.openai.tools import ToolCallingConfig


def test_tool_flags_reach_run_server(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve, "run_server", lambda args, **kw: seen.update(kw))
    argv = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    assert main([*argv, "--exclude-tools-when-tool-choice-none"]) == 0
    assert seen["tool_config"] == ToolCallingConfig(True, "llama3_json", True)
    assert main(["serve"]) == 0
    assert seen["tool_config"] == ToolCallingConfig(False, None, False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--enable-auto-tool-choice"], "requires --tool-call-parser"),
        (["serve", "--tool-call-parser", "granite"], "invalid choice: 'granite'"),
    ],
)
def test_bad_tool_flags_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_generic_parser_flag_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve, "run_server", lambda args, **kw: seen.update(kw))
    assert main(["serve", "--tool-call-parser", "generic"]) == 0
    assert seen["tool_config"] == ToolCallingConfig(False, "generic", False)
    assert seen["tool_config"].resolve(None).generic

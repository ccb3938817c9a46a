"""`paged ... --help`: every flag explained, JSON examples copyable, own options first."""

from __future__ import annotations

import argparse
import re

import pytest

from paged.server.cli import build_parser
from paged.server.cli_help import CommandParser, wrap_help

JSON_EXAMPLE = re.compile(r"'[\[{].*?[\]}]'")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("paged has no subcommands")


def _full_help(parser: argparse.ArgumentParser) -> str:
    if isinstance(parser, CommandParser):
        brief, epilog = parser._brief, parser.epilog
        parser._brief = False
        try:
            return parser.format_help()
        finally:
            parser._brief, parser.epilog = brief, epilog
    return parser.format_help()


@pytest.fixture(autouse=True)
def _narrow_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse wraps to $COLUMNS; 80 is where the JSON examples used to break.
    monkeypatch.setenv("COLUMNS", "80")


def test_every_flag_of_every_command_has_help() -> None:
    parser = build_parser()
    commands = {"paged": parser, **_subparsers(parser)}
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, p in commands.items()
        for action in p._actions
        if not isinstance(action, argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
        and not (action.help or "").strip()
    ]
    assert missing == []


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_json_examples_in_help_are_never_broken(command: str) -> None:
    parser = _subparsers(build_parser())[command]
    text = _full_help(parser)
    lines = text.splitlines()
    examples = [
        m.group(0)
        for action in parser._actions
        for m in JSON_EXAMPLE.finditer(" ".join((action.help or "").split()))
    ]
    assert len(examples) >= 4  # --kv-transfer-config, --ec-transfer-config, --speculative-config...
    for example in examples:
        assert any(example in line for line in lines), example
    assert "SharedStorageConnector" in text


def test_wrap_help_keeps_long_words_and_hyphenated_flags_whole() -> None:
    text = "see --kv-transfer-config and " + "x" * 50 + ' then \'{"a": 1, "b": [2, 3]}\' ok'
    lines = wrap_help(text, 20)
    assert "x" * 50 in lines
    assert any("--kv-transfer-config" in line for line in lines)
    assert '\'{"a": 1, "b": [2, 3]}\'' in lines
    assert all(len(line) <= 20 for line in lines if "x" not in line and "{" not in line)


@pytest.mark.parametrize(
    ("command", "own"), [("chat", ["--system", "--max-tokens"]), ("generate", ["--prompt"])]
)
def test_chat_and_generate_help_show_their_own_options_not_the_engine_flags(
    command: str, own: list[str]
) -> None:
    parser = _subparsers(build_parser())[command]
    brief = parser.format_help()
    for flag in own:
        assert flag in brief
    assert "--kv-cache-memory" not in brief and "--tensor-parallel-size" not in brief
    assert f"paged {command} --help-all" in brief
    assert len(brief.splitlines()) < 60
    full = _full_help(parser)
    assert "--kv-cache-memory" in full
    # In the full listing the command's own options still come first.
    assert full.index(own[0]) < full.index("--kv-cache-memory")


def test_help_all_prints_everything_and_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["chat", "--help-all"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--system" in out and "--kv-cache-memory" in out and "--help-all lists" not in out


def test_serve_help_still_lists_the_engine_flags() -> None:
    text = _subparsers(build_parser())["serve"].format_help()
    assert "--kv-cache-memory" in text and "--port" in text and "--help-all" not in text

"""How `paged ... --help` is laid out: unbroken JSON examples, own options first.

Two problems of argparse's defaults for this CLI:

- its wrapper breaks any word longer than the column and splits at hyphens,
  so a JSON example such as `'{"kv_connector":"SharedStorageConnector"}'`
  came out as `"Sha` / `redStorageConnector"` and could not be copied back.
  `HelpFormatter` never breaks a word, and keeps each quoted JSON example
  (`'{...}'` or `'[...]'`) on one line whatever spaces it holds;
- `paged chat` and `paged generate` share ~200 lines of engine flags with
  `paged serve`. `CommandParser` prints the command's own groups under
  `--help` and everything under `--help-all` (vLLM 0.33 answers the same
  problem with `--help=all` / `--help=GROUP` in utils/argparse_utils.py:233).
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Sequence
from typing import Any

# A JSON example in a help text: a single-quoted object or array, as a shell takes it.
_JSON_EXAMPLE = re.compile(r"'[\[{].*?[\]}]'")
_GLUE = "\x00"  # stands for a space inside a JSON example while wrapping


def wrap_help(text: str, width: int) -> list[str]:
    """`text` wrapped at spaces only, each quoted JSON example kept whole on one line."""
    text = " ".join(text.split())
    glued = _JSON_EXAMPLE.sub(lambda m: m.group(0).replace(" ", _GLUE), text)
    lines = textwrap.wrap(glued, width, break_long_words=False, break_on_hyphens=False)
    return [line.replace(_GLUE, " ") for line in lines]


class HelpFormatter(argparse.HelpFormatter):
    """Wraps at spaces only; JSON examples stay whole; blank lines separate paragraphs."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return wrap_help(text, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        return "\n\n".join(
            "\n".join(indent + line for line in wrap_help(p, width)) for p in paragraphs
        )


class _HelpAllAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(parser, CommandParser)
        parser.print_help_all()
        parser.exit()


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose `--help` can leave the shared engine groups out.

    Call `brief_help(shared_groups, note)` once the groups exist: `--help`
    then lists every other group and ends with `note`; `--help-all` lists all.
    Parsing is unaffected.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._hidden_in_brief: list[argparse._ArgumentGroup] = []
        self._brief = False

    def brief_help(self, shared_groups: Sequence[argparse._ArgumentGroup], note: str) -> None:
        self._hidden_in_brief = list(shared_groups)
        self.add_argument(
            "--help-all",
            action=_HelpAllAction,
            help="show every option, the engine options shared with `paged serve` included",
        )
        self.epilog = note
        self._brief = True

    def format_help(self) -> str:
        if not self._brief:
            return super().format_help()
        all_groups = self._action_groups
        self._action_groups = [g for g in all_groups if g not in self._hidden_in_brief]
        try:
            return super().format_help()
        finally:
            self._action_groups = all_groups

    def print_help_all(self) -> None:
        brief, epilog = self._brief, self.epilog
        self._brief, self.epilog = False, None
        try:
            self.print_help()
        finally:
            self._brief, self.epilog = brief, epilog

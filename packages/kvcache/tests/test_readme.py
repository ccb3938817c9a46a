"""The README's toy engine loop runs and its assertions hold."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_toy_engine_loop_runs(tmp_path: Path) -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- tested: toy-engine -->\n```python\n(.*?)```", text, re.S)
    assert match is not None, "the tested code block is missing from README.md"
    script = tmp_path / "toy_engine.py"
    script.write_text(match.group(1), encoding="utf-8")
    # run_path registers a module while it runs, which dataclasses need.
    namespace = runpy.run_path(str(script), run_name="toy_engine")
    assert namespace["finished"] == ["req-0", "req-1", "req-2", "req-3"]

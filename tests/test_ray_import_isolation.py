"""Nothing imports ray unless the Ray executor is chosen (it is an optional extra)."""

from __future__ import annotations

import json
import subprocess
import sys

IMPORTS = """
import paged.runner
import paged.runner.executor
import paged.runner.worker
from paged.runner.executor import Executor, MultiprocExecutor, UniProcExecutor
import paged.server.cli
import paged.server.llm
import paged.server.engine.core
from paged.server.cli import build_parser
build_parser().parse_args(["serve", "--distributed-executor-backend", "ray"])
"""


def test_runner_and_server_import_without_ray() -> None:
    code = IMPORTS + "import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    ).stdout
    loaded = set(json.loads(out.strip().splitlines()[-1]))
    assert "paged.server.cli" in loaded
    assert not any(m == "ray" or m.startswith("ray.") for m in loaded)
    assert "paged.runner.executor.ray_distributed" not in loaded

"""scripts/gpu-check on a machine without CUDA: it fails fast and says why, in JSON."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def run_check(*python_flags: str) -> tuple[int, dict[str, Any], float]:
    # No visible CUDA device, even where the tests run on a GPU machine.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *python_flags, str(SCRIPT)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout), time.monotonic() - start


def test_without_cuda_it_fails_fast_with_a_json_reason() -> None:
    code, report, seconds = run_check()
    assert code == 2
    assert report["ok"] is False and report["device"] is None
    (pre,) = report["stages"]  # nothing past the preflight runs
    assert pre["status"] == "failed"
    assert "no CUDA device" in pre["reason"]
    assert pre["missing_runtime_modules"] == [] and pre["missing_test_modules"] == []
    assert seconds < 60


def test_a_bare_interpreter_gets_the_list_of_missing_modules() -> None:
    # -S: no site-packages, so every third-party module is missing.
    code, report, _ = run_check("-S")
    (pre,) = report["stages"]
    assert code == 2 and pre["status"] == "failed"
    assert {"torch", "triton", "msgspec", "transformers"} <= set(pre["missing_runtime_modules"])
    assert {"pytest", "hypothesis"} <= set(pre["missing_test_modules"])
    assert "torch is not importable" in pre["reason"]


def test_it_finds_the_gpu_marked_test_dirs() -> None:
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    dirs = {str(d.relative_to(ROOT)) for d in module.gpu_test_dirs()}
    assert {"kernels/tests", "packages/runner/tests"} <= dirs
    assert str(ROOT / "kernels/src") in module.source_path().split(os.pathsep)

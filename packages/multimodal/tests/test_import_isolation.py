"""Importing `paged.multimodal` in a fresh interpreter loads only what the package may depend on."""

import json
import subprocess
import sys

FORBIDDEN = [
    "torch",
    "paged.kvcache",
    "paged.scheduler",
    "paged.runner",
    "paged.kernels",
    "paged.connectors",
    "paged.server",
    "transformers",
]


def _modules_loaded_by(import_stmt: str) -> set[str]:
    code = f"{import_stmt}; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_import_loads_no_forbidden_module() -> None:
    loaded = _modules_loaded_by("import paged.multimodal")
    assert "paged.multimodal" in loaded
    offending = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert offending == [], f"paged.multimodal loaded {offending}"

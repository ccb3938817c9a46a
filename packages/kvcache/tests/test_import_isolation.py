"""Importing `paged.kvcache` in a fresh interpreter loads only what the package may depend on."""

import json
import subprocess
import sys

FORBIDDEN = [
    "torch",
    "numpy",
    "msgspec",
    "xxhash",
    "paged.scheduler",
    "paged.multimodal",
    "paged.runner",
    "paged.kernels",
    "paged.connectors",
    "paged.server",
]


def _modules_loaded_by(import_stmt: str) -> set[str]:
    code = f"{import_stmt}; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_import_loads_no_forbidden_module() -> None:
    loaded = _modules_loaded_by("import paged.kvcache")
    assert "paged.kvcache" in loaded
    offending = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert offending == [], f"paged.kvcache loaded {offending}"


def test_import_loads_only_the_standard_library() -> None:
    loaded = _modules_loaded_by("import paged.kvcache")
    third_party = sorted(
        m
        for m in loaded
        if m.split(".")[0] not in sys.stdlib_module_names
        and m.split(".")[0] not in {"paged", "__main__", "_distutils_hack"}
        and not m.startswith("_")
    )
    assert third_party == [], f"paged.kvcache loaded third-party modules {third_party}"

"""The workspace's declared dependencies follow the graph in ARCHITECTURE.md."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# member -> paged members it may depend on (ARCHITECTURE.md, "Dependency graph").
ALLOWED_PAGED_DEPS: dict[str, set[str]] = {
    "paged-kvcache": set(),
    "paged-multimodal": set(),
    "paged-scheduler": {"paged-kvcache", "paged-multimodal"},
    "paged-kernels": set(),
    "paged-runner": {"paged-scheduler", "paged-kernels", "paged-kvcache", "paged-multimodal"},
    "paged-connectors": {"paged-kvcache", "paged-scheduler", "paged-multimodal"},
    "paged-server": {
        "paged-kvcache",
        "paged-scheduler",
        "paged-multimodal",
        "paged-kernels",
        "paged-runner",
        "paged-connectors",
    },
}


def _members() -> dict[str, dict[str, object]]:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    members = {}
    for rel in root["tool"]["uv"]["workspace"]["members"]:
        project = tomllib.loads((ROOT / rel / "pyproject.toml").read_text())["project"]
        members[project["name"]] = project
    return members


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0] for req in requirements}


def test_every_member_is_known_and_versioned() -> None:
    members = _members()
    assert set(members) == set(ALLOWED_PAGED_DEPS)
    for name, project in members.items():
        assert project["version"] == "0.1.0", name
        assert project["requires-python"] == ">=3.11", name


def test_members_depend_only_upstream() -> None:
    for name, project in _members().items():
        deps = _names(list(project.get("dependencies", [])))  # type: ignore[call-overload]
        paged_deps = {d for d in deps if d.startswith("paged-")}
        assert paged_deps <= ALLOWED_PAGED_DEPS[name], f"{name} depends on {paged_deps}"


def test_kvcache_has_no_third_party_runtime_dependency() -> None:
    assert _members()["paged-kvcache"].get("dependencies", []) == []


def test_no_member_declares_a_paged_namespace_init() -> None:
    for init in ROOT.glob("**/src/paged/__init__.py"):
        raise AssertionError(f"{init} breaks the PEP 420 namespace `paged`")

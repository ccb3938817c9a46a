"""ECConnectorFactory: lazy registration, dynamic loading from ec_connector_module_path, errors."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from paged.connectors.ec import (
    ECConnectorContext,
    ECConnectorFactory,
    ECConnectorLoadError,
    ECConnectorRole,
    ECTransferConfig,
    ec_transfer_config_from_dict,
)
from paged.connectors.ec.example import ECExampleConnector

PLUGIN = textwrap.dedent(
    '''
    from paged.connectors.ec.example import ECExampleConnector

    class PluginECConnector(ECExampleConnector):
        """A third-party connector living outside paged."""

    NotAConnector = int
    '''
)


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module on sys.path, not imported yet; each test gets a fresh name."""
    name = f"ec_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def _config(tmp_path: Path, name: str, module: str | None = None) -> ECTransferConfig:
    data: dict[str, object] = {
        "ec_connector": name,
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"shared_storage_path": str(tmp_path / "ec")},
    }
    if module is not None:
        data["ec_connector_module_path"] = module
    return ec_transfer_config_from_dict(data)


def test_registration_imports_nothing_until_used(tmp_path: Path) -> None:
    factory = ECConnectorFactory()
    factory.register_connector("Lazy", "paged_module_that_does_not_exist", "Nope")
    assert factory.registered_names() == ["Lazy"]
    assert not factory.is_loaded("Lazy")
    with pytest.raises(ECConnectorLoadError, match="cannot import module"):
        factory.get_connector_class(_config(tmp_path, "Lazy"))
    with pytest.raises(ValueError, match="already registered"):
        factory.register_connector("Lazy", "x", "y")


def test_builtins_create_both_roles(tmp_path: Path) -> None:
    factory = ECConnectorFactory.with_builtins()
    assert {"ECExampleConnector", "MultiECConnector"} <= set(factory.registered_names())
    config = _config(tmp_path, "ECExampleConnector")
    for role in ECConnectorRole:
        conn = factory.create_connector(config, role, ECConnectorContext())
        assert isinstance(conn, ECExampleConnector) and conn.role is role
        assert conn.is_producer and conn.is_consumer
    assert factory.is_loaded("ECExampleConnector")


def test_dynamic_module_path_loads_a_plugin(tmp_path: Path, plugin_module: str) -> None:
    factory = ECConnectorFactory.with_builtins()
    config = _config(tmp_path, "PluginECConnector", plugin_module)
    cls = factory.get_connector_class(config)
    assert cls.__name__ == "PluginECConnector" and cls.__module__ == plugin_module
    conn = factory.create_connector(config, ECConnectorRole.WORKER, ECConnectorContext())
    assert isinstance(conn, ECExampleConnector)


@pytest.mark.parametrize(
    ("name", "module", "message"),
    [
        ("Unknown", None, "not registered"),
        ("Missing", "PLUGIN", "has no class 'Missing'"),
        ("NotAConnector", "PLUGIN", "is not an ECConnectorBase subclass"),
        ("X", "paged_no_such_module_xyz", "cannot import module"),
    ],
)
def test_load_errors_name_what_failed(
    tmp_path: Path, plugin_module: str, name: str, module: str | None, message: str
) -> None:
    module = plugin_module if module == "PLUGIN" else module
    factory = ECConnectorFactory.with_builtins()
    with pytest.raises(ECConnectorLoadError, match=message):
        factory.get_connector_class(_config(tmp_path, name, module))

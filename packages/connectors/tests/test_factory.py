"""KVConnectorFactory: lazy registration, dynamic module paths, errors naming what failed."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from paged.connectors.kv import (
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorLoadError,
    KVConnectorRole,
    KVTransferConfig,
)
from paged.connectors.kv.shared_storage import SharedStorageConnector

PLUGIN = textwrap.dedent(
    '''
    from paged.connectors.kv.shared_storage import SharedStorageConnector

    class PluginConnector(SharedStorageConnector):
        """A third-party connector living outside paged."""

    NotAConnector = int
    '''
)


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module on sys.path, not imported yet; each test gets a fresh name."""
    name = f"kv_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def _cfg(name: str, module_path: str | None = None, **extra: object) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        kv_connector_module_path=module_path,
        kv_connector_extra_config=dict(extra),
    )


def test_registration_imports_nothing_until_first_use(plugin_module: str, tmp_path: Path) -> None:
    factory = KVConnectorFactory()
    factory.register_connector("Plugin", plugin_module, "PluginConnector")
    assert plugin_module not in sys.modules
    assert not factory.is_loaded("Plugin")
    cls = factory.get_connector_class(_cfg("Plugin"))
    assert plugin_module in sys.modules
    assert cls.__name__ == "PluginConnector" and cls.__module__ == plugin_module
    assert factory.is_loaded("Plugin")
    conn = factory.create_connector(
        _cfg("Plugin", shared_storage_path=str(tmp_path)),
        KVConnectorRole.SCHEDULER,
        KVConnectorContext(block_size=16),
    )
    assert isinstance(conn, SharedStorageConnector)
    assert conn.role is KVConnectorRole.SCHEDULER


def test_registering_a_name_twice_is_an_error() -> None:
    factory = KVConnectorFactory()
    factory.register_connector("A", "m", "C")
    with pytest.raises(ValueError, match="'A' is already registered"):
        factory.register_connector("A", "m2", "C2")


def test_unregistered_class_loads_from_kv_connector_module_path(plugin_module: str) -> None:
    factory = KVConnectorFactory.with_builtins()
    cls = factory.get_connector_class(_cfg("PluginConnector", plugin_module))
    assert cls.__name__ == "PluginConnector"


def test_builtins_include_both_vllm_names_of_the_example_connector() -> None:
    factory = KVConnectorFactory.with_builtins()
    assert {"SharedStorageConnector", "ExampleConnector", "MultiConnector"} <= set(
        factory.registered_names()
    )
    assert factory.get_connector_class(_cfg("ExampleConnector")) is SharedStorageConnector
    assert factory.get_connector_class(_cfg("SharedStorageConnector")) is SharedStorageConnector


def test_unknown_connector_without_module_path_names_it() -> None:
    with pytest.raises(KVConnectorLoadError, match=r"unknown KV connector 'Nope'.*known: "):
        KVConnectorFactory.with_builtins().get_connector_class(_cfg("Nope"))


def test_missing_module_is_named() -> None:
    with pytest.raises(KVConnectorLoadError, match="cannot import module 'no_such_kv_module'"):
        KVConnectorFactory().get_connector_class(_cfg("X", "no_such_kv_module"))


def test_missing_class_is_named(plugin_module: str) -> None:
    with pytest.raises(KVConnectorLoadError, match=f"{plugin_module}' has no class 'Missing'"):
        KVConnectorFactory().get_connector_class(_cfg("Missing", plugin_module))


def test_a_class_that_is_not_a_connector_is_rejected(plugin_module: str) -> None:
    with pytest.raises(KVConnectorLoadError, match="not a KVConnectorBase subclass"):
        KVConnectorFactory().get_connector_class(_cfg("NotAConnector", plugin_module))


def test_registered_name_pointing_at_a_missing_module_fails_on_use_only() -> None:
    factory = KVConnectorFactory()
    factory.register_connector("Broken", "paged.connectors.kv.does_not_exist", "Broken")
    with pytest.raises(KVConnectorLoadError, match=r"'Broken'.*does_not_exist"):
        factory.get_connector_class(_cfg("Broken"))


def test_config_without_connector_is_rejected() -> None:
    with pytest.raises(KVConnectorLoadError, match="kv_connector is not set"):
        KVConnectorFactory().get_connector_class(KVTransferConfig())

"""`KVConnectorFactory`: name -> connector class, imported on first use (seed: KVConnectorFactory).

Registration records a module path and a class name only, so registering a
connector costs nothing and a connector's heavy imports (or a missing
optional dependency) only matter to engines that use it. A name that is not
registered is looked up in `kv_connector_module_path` (vLLM's dynamic
loading), so third-party connectors need no registration.

The factory is an object, not class-level state: the server builds one
(`KVConnectorFactory.with_builtins()`) and passes it where it is needed.
"""

from __future__ import annotations

from paged.connectors.kv.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from paged.connectors.kv.config import KVTransferConfig
from paged.connectors.lazy_class import ClassLocation, import_class


class KVConnectorLoadError(ValueError):
    """A connector class cannot be found or imported; the message names what failed."""


# vLLM's example connector was renamed ExampleConnector; both names select it.
_BUILTINS: dict[str, ClassLocation] = {
    "SharedStorageConnector": ClassLocation(
        "paged.connectors.kv.shared_storage", "SharedStorageConnector"
    ),
    "ExampleConnector": ClassLocation(
        "paged.connectors.kv.shared_storage", "SharedStorageConnector"
    ),
    "MultiConnector": ClassLocation("paged.connectors.kv.multi", "MultiConnector"),
    "OffloadingConnector": ClassLocation(
        "paged.connectors.kv.offloading.connector", "OffloadingConnector"
    ),
    "PagedZmqConnector": ClassLocation("paged.connectors.kv.p2p.connector", "PagedZmqConnector"),
}


class KVConnectorFactory:
    """Lazily registered connector classes; see the module docstring."""

    def __init__(self) -> None:
        self._registry: dict[str, ClassLocation] = {}
        self._loaded: dict[str, type[KVConnectorBase]] = {}

    @classmethod
    def with_builtins(cls) -> KVConnectorFactory:
        """A factory knowing the connectors shipped in paged-connectors."""
        factory = cls()
        for name, reg in _BUILTINS.items():
            factory.register_connector(name, reg.module_path, reg.class_name)
        return factory

    def register_connector(self, name: str, module_path: str, class_name: str) -> None:
        """Record where `name`'s class lives; nothing is imported. `ValueError` if taken."""
        if name in self._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        self._registry[name] = ClassLocation(module_path, class_name)

    def registered_names(self) -> list[str]:
        return sorted(self._registry)

    def is_loaded(self, name: str) -> bool:
        """Whether `name`'s class has been imported by this factory (for tests and logs)."""
        return name in self._loaded

    def get_connector_class(self, config: KVTransferConfig) -> type[KVConnectorBase]:
        """The class `config.kv_connector` names: the registry first, then the module path."""
        name = config.kv_connector
        if name is None:
            raise KVConnectorLoadError("kv_transfer_config: kv_connector is not set")
        if name in self._loaded:
            return self._loaded[name]
        reg = self._registry.get(name)
        if reg is None:
            if config.kv_connector_module_path is None:
                known = ", ".join(self.registered_names())
                raise KVConnectorLoadError(
                    f"unknown KV connector {name!r}: not registered (known: {known}) and "
                    "no kv_connector_module_path given"
                )
            reg = ClassLocation(config.kv_connector_module_path, name)
        cls: type[KVConnectorBase] = import_class(
            "KV connector", name, reg, KVConnectorBase, KVConnectorLoadError
        )
        self._loaded[name] = cls
        return cls

    def create_connector(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> KVConnectorBase:
        """Instantiate the configured connector for one role (one instance per process)."""
        cls = self.get_connector_class(config)
        return cls(config, role, context)

"""`ECConnectorFactory`: name -> encoder-cache connector class, imported on first use.

Static registration records a module path and a class name only (vLLM's lazy
`register_connector`), so registering costs nothing and a connector's heavy
imports only matter to engines that use it. A name that is not registered is
imported from `ec_connector_module_path` (vLLM's dynamic loading), so a
third-party connector needs no registration.

The factory is an object, not class-level state: the server builds one
(`ECConnectorFactory.with_builtins()`) and passes it where it is needed.
"""

from __future__ import annotations

from paged.connectors.ec.base import ECConnectorBase, ECConnectorContext, ECConnectorRole
from paged.connectors.ec.config import ECTransferConfig
from paged.connectors.lazy_class import ClassLocation, import_class


class ECConnectorLoadError(ValueError):
    """A connector class cannot be found or imported; the message names what failed."""


_BUILTINS: dict[str, ClassLocation] = {
    "ECExampleConnector": ClassLocation("paged.connectors.ec.example", "ECExampleConnector"),
    "MultiECConnector": ClassLocation("paged.connectors.ec.multi", "MultiECConnector"),
    "ECZmqConnector": ClassLocation("paged.connectors.ec.p2p.connector", "ECZmqConnector"),
}


class ECConnectorFactory:
    """Lazily registered encoder-cache connector classes; see the module docstring."""

    def __init__(self) -> None:
        self._registry: dict[str, ClassLocation] = {}
        self._loaded: dict[tuple[str, str | None], type[ECConnectorBase]] = {}

    @classmethod
    def with_builtins(cls) -> ECConnectorFactory:
        """A factory knowing the connectors shipped in paged-connectors."""
        factory = cls()
        for name, reg in _BUILTINS.items():
            factory.register_connector(name, reg.module_path, reg.class_name)
        return factory

    def register_connector(self, name: str, module_path: str, class_name: str) -> None:
        """Record where `name`'s class lives; nothing is imported. `ValueError` if taken."""
        if name in self._registry:
            raise ValueError(f"EC connector {name!r} is already registered")
        self._registry[name] = ClassLocation(module_path, class_name)

    def registered_names(self) -> list[str]:
        return sorted(self._registry)

    def is_loaded(self, name: str) -> bool:
        """Whether `name`'s class has been imported by this factory (for tests and logs)."""
        return any(key[0] == name for key in self._loaded)

    def get_connector_class(self, config: ECTransferConfig) -> type[ECConnectorBase]:
        """The class `config.ec_connector` names.

        With `ec_connector_module_path` set, the class is imported from that
        module (vLLM's order: the path wins over the registry); otherwise the
        registry is used.
        """
        name = config.ec_connector
        if name is None:
            raise ECConnectorLoadError("ec_transfer_config: ec_connector is not set")
        key = (name, config.ec_connector_module_path)
        if key in self._loaded:
            return self._loaded[key]
        if config.ec_connector_module_path is not None:
            reg = ClassLocation(config.ec_connector_module_path, name)
        else:
            found = self._registry.get(name)
            if found is None:
                known = ", ".join(self.registered_names())
                raise ECConnectorLoadError(
                    f"unknown EC connector {name!r}: not registered (known: {known}) and "
                    "no ec_connector_module_path given"
                )
            reg = found
        cls: type[ECConnectorBase] = import_class(
            "EC connector", name, reg, ECConnectorBase, ECConnectorLoadError
        )
        self._loaded[key] = cls
        return cls

    def create_connector(
        self, config: ECTransferConfig, role: ECConnectorRole, context: ECConnectorContext
    ) -> ECConnectorBase:
        """Instantiate the configured connector for one role (one instance per process)."""
        return self.get_connector_class(config)(config, role, context)

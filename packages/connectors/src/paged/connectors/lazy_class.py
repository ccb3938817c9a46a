"""Import a connector class named by a module path and a class name, on first use.

Both connector factories (KV and encoder cache) register connectors lazily, as
vLLM does: a registration is only where the class lives, so a connector's heavy
imports matter only to the engines that use it. This is the one place that turns
such a registration into a checked class, with an error naming what failed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClassLocation:
    """Where a registered connector class lives: nothing is imported until it is used."""

    module_path: str
    class_name: str


def import_class(
    kind: str,
    name: str,
    location: ClassLocation,
    base: type[Any],
    error: type[ValueError],
) -> type[Any]:
    """The class at `location`, checked to subclass `base`; `error` names what failed.

    `base` may be abstract (a connector base class), hence `type[Any]`: the
    caller annotates the result with its base type.

    `kind` ("KV connector", "EC connector") and `name` (the configured connector
    name) go into every message so the user sees which setting to fix.
    """
    try:
        module = importlib.import_module(location.module_path)
    except ImportError as exc:
        raise error(
            f"{kind} {name!r}: cannot import module {location.module_path!r}: {exc}"
        ) from exc
    cls = getattr(module, location.class_name, None)
    if cls is None:
        raise error(
            f"{kind} {name!r}: module {location.module_path!r} has no class {location.class_name!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, base)):
        article = "an" if base.__name__[0] in "AEIOU" else "a"
        raise error(
            f"{kind} {name!r}: {location.module_path}.{location.class_name} is not "
            f"{article} {base.__name__} subclass"
        )
    return cls

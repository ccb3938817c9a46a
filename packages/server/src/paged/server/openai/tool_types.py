"""The checked tool fields of a chat request (plain data shared by the tool modules)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from paged.server.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates see it (vLLM passes `tool.model_dump()`)."""
        fn = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        return {"type": "function", "function": fn}


ChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's checked tool fields. `named` is the function for mode "named".

    `parallel_tool_calls_asked`: the request sent `parallel_tool_calls: true` (not
    just left it out); the generic format allows several calls only then.
    """

    tools: list[FunctionTool]
    mode: ChoiceMode
    named: str | None = None
    parallel_tool_calls: bool = True
    parallel_tool_calls_asked: bool = False


def hoist_defs(tools: list[FunctionTool]) -> tuple[list[FunctionTool], dict[str, Any]]:
    """Move each tool's `$defs` to the array's root, where `#/$defs/...` refs resolve."""
    hoisted: list[FunctionTool] = []
    defs: dict[str, Any] = {}
    for tool in tools:
        params = copy.deepcopy(tool.parameters)
        for name, schema in (params.pop("$defs", None) or {}).items() if params else ():
            if name in defs and defs[name] != schema:
                raise InvalidRequestError(
                    "tools",
                    f"Tool definition '{name}' has multiple schemas, which is not supported.",
                )
            defs[name] = schema
        hoisted.append(FunctionTool(tool.name, tool.description, params, tool.strict))
    return hoisted, defs

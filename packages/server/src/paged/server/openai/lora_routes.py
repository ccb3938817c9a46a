"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes).

As vLLM 0.33 (vllm/entrypoints/serve/lora/api_router.py:22-110): the routes
exist only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is "1" or "true" (otherwise
they are absent: 404); success is a 200 with a plain-text body ("Success: LoRA
adapter 'x' added successfully."); errors carry the usual error body (400 for
bad input or an adapter that does not load, 404 to unload an unknown name).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from paged.server.errors import InvalidRequestError
from paged.server.openai.models import ServedModels
from paged.server.openai.protocol import ErrorResponse


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body (vllm/entrypoints/serve/lora/protocol.py)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


_ERRORS: dict[int | str, dict[str, object]] = {
    400: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
}


def add_lora_routes(app: FastAPI, models: ServedModels) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if body.load_inplace:
            # Names key the prefix cache: new weights under an old name would reuse
            # blocks computed with the old ones (vLLM only logs a warning).
            raise InvalidRequestError(
                "load_inplace",
                "load_inplace is not supported: unload the adapter, then load the new "
                "weights under a new name",
            )
        if body.is_3d_lora_weight:
            raise InvalidRequestError(
                "is_3d_lora_weight", "MoE LoRA weights are not supported (no MoE models)"
            )
        return PlainTextResponse(await models.load_lora_adapter(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.unload_lora_adapter(body.lora_name))

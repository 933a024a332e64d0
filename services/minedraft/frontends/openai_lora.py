"""vLLM's run-time LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless the engine config allows run-time updating (`allow_runtime_lora_updating`, `lora_root`): then 404,
as vLLM answers where the routes are not enabled. The engine client does the work: the scheduler's loads the
adapter on each of its workers, the gateway's on every engine group.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI
from fastapi.params import Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from minedraft.config import LoraModule
from minedraft.engine.loras import LoraRefused
from minedraft.frontends.generate import Generator

# LoraRefused.kind -> (HTTP status, the body field it concerns, OpenAI's error code)
_REFUSALS = {
    "off": (HTTPStatus.NOT_FOUND, None, None),
    "invalid": (HTTPStatus.BAD_REQUEST, "lora_path", None),
    "exists": (HTTPStatus.BAD_REQUEST, "lora_name", None),
    "not_found": (HTTPStatus.NOT_FOUND, "lora_name", "model_not_found"),
}


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1, description="The target's PEFT adapter folder, inside lora_root.")
    draft_path: str | None = Field(None, min_length=1, description="The draft model's adapter folder (optional).")
    load_inplace: bool = False  # vLLM's: replace an adapter of that name; refused (unload it first) when true


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: StrictInt | None = None  # vLLM's; adapters are known by name here


class LoraRoutes:
    """The two routes over `generator`'s engine; `model_name` (the base model's name) is no adapter's."""

    def __init__(self, generator: Generator, model_name: str, api_error: type[Exception]) -> None:
        self.generator, self.model_name, self.api_error = generator, model_name, api_error

    def add_to(self, app: FastAPI, auth: list[Depends]) -> None:
        app.add_api_route("/v1/load_lora_adapter", self.load, methods=["POST"], dependencies=auth)
        app.add_api_route("/v1/unload_lora_adapter", self.unload, methods=["POST"], dependencies=auth)

    async def load(self, body: LoadLoraBody) -> PlainTextResponse:
        if body.lora_name == self.model_name:
            raise self.api_error(HTTPStatus.BAD_REQUEST, f"lora_name {body.lora_name!r} is the base model's name",
                                 "lora_name")  # fmt: skip
        if body.load_inplace:
            raise self.api_error(HTTPStatus.BAD_REQUEST, "load_inplace is not supported: unload the adapter, then "
                                 "load it again", "load_inplace")  # fmt: skip
        module = LoraModule(name=body.lora_name, path=body.lora_path, draft_path=body.draft_path)
        await self._call(self.generator.check_ready().load_lora(module))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoraBody) -> PlainTextResponse:
        await self._call(self.generator.check_ready().unload_lora(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _call(self, call) -> None:
        try:
            await call
        except LoraRefused as exc:
            status, param, code = _REFUSALS[exc.kind]
            raise self.api_error(status, str(exc), param, code) from None

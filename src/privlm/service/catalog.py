"""The models a service offers, as OpenAI lists them: ``GET /v1/models`` and ``GET /v1/models/{id}``.

A request that names a model the service does not offer gets OpenAI's answer: 404 with code
``model_not_found``. Tools that speak OpenAI's API (the SDKs, LiteLLM) pick models from this list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from privlm.service.errors import ServiceError


class ModelEntry(BaseModel):
    """One model, in OpenAI's shape; extra fields (``dim``, say) are the service's own facts."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "privlm"
    dim: int | None = None  # the embedding width, for embedding models
    weights_fingerprint: str | None = None  # sha256 of the weights that answer


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]


def model_not_found() -> ServiceError:
    # OpenAI quotes the name; privlm never echoes what a caller sent (it may be text, or not valid Unicode).
    return ServiceError(404, "The model named in the request does not exist or you do not have access to it; "
                             "GET /v1/models lists the models offered.", param="model", code="model_not_found")


def check_model(name: str, offered: Sequence[ModelEntry]) -> ModelEntry:
    """The entry ``name`` names, or the 404 ``model_not_found`` OpenAI gives."""
    for entry in offered:
        if entry.id == name:
            return entry
    raise model_not_found()


def catalog_router(offered: Sequence[ModelEntry]) -> APIRouter:
    router = APIRouter(tags=["models"])
    listing = ModelList(data=list(offered))

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        return listing

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelEntry:
        return check_model(model_id, offered)

    return router

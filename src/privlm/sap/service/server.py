"""``privlm sap vendor``: the vendor's SAP fine-tuning server. It never receives text, token ids or, with
``head="customer"``, labels: only privatized representations and gradients.

GET    /v1/sap/bottoms/{blocks}                    the bottom bundle's manifest (sha256 per file)
GET    /v1/sap/bottoms/{blocks}/files/{name}       its files; the top never leaves
POST   /v1/sap/sessions                            open a fine-tuning session (JSON) -> 201 SessionInfo
GET    /v1/sap/sessions/{id}                       its state: steps done, last checkpoint, uploads
POST   /v1/sap/sessions/{id}/exchange              one SAP message (safetensors bytes) -> the vendor's answer
POST   /v1/sap/sessions/{id}/checkpoint            checkpoint now ({"keep": true}: also filed under its step)
POST   /v1/sap/sessions/{id}/select                serve the adapter kept at {"step": n} (the chosen epoch)
GET    /v1/sap/sessions/{id}/adapter               the trained adapter (safetensors), for the session's owner
DELETE /v1/sap/sessions/{id}                       delete the session and its stored state
GET    /health, /metrics

Every answer to ``exchange`` carries ``x-privlm-steps-done`` and ``x-privlm-checkpoint-step``. The JSON bodies are
the models of :mod:`privlm.sap.service.wire`, which the client reads with too. Sessions belong to
the API key that opened them: another key is answered 404, as for a session that does not exist.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Unpack

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import Gauge
from safetensors.torch import save as save_safetensors

from privlm.accounting.principals import legacy_principal_of_key
from privlm.models.device import resolve_device
from privlm.models.loading import load_pretrained
from privlm.models.partition import split_model
from privlm.models.pooling import choose_pooling
from privlm.sap.service.bundle import bottom_bundle
from privlm.sap.service.sessions import SessionLimits, VendorSessions
from privlm.sap.service.store import SessionNotFoundError, SessionStore
from privlm.sap.service.wire import (
    SAP_MESSAGE,
    SESSION_ID_PATTERN,
    SESSIONS_PATH,
    CheckpointRequest,
    SelectRequest,
    SessionInfo,
    SessionRequest,
    bundle_path,
)
from privlm.service import (
    BearerKeys,
    ErrorBody,
    ServiceError,
    ServiceOptions,
    create_service_app,
    public_model_name,
)

_SESSION_ID = Annotated[str, PathParam(pattern=SESSION_ID_PATTERN, description="The session's id.")]
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_EXCHANGE_OPENAPI: dict[str, object] = {
    "requestBody": {"required": True, "description": "One SAP customer message (Upload, Forward or "
                    "OutputGradient) as safetensors bytes with its fields in the JSON metadata "
                    "(privlm.sap.to_bytes).", "content": {SAP_MESSAGE: _BINARY, "application/octet-stream": _BINARY}},
    "responses": {"200": {"description": "The vendor's answer (Uploaded, TopOutput, CutGradient or StepDone), "
                                         "as safetensors bytes.", "content": {SAP_MESSAGE: _BINARY}}}}


_CONFLICT: dict[int | str, dict[str, Any]] = {409: {
    "model": ErrorBody, "description": "Out of step with the session (a step out of order, a gradient for no step "
                                       "in flight, another gradient for a step taken), or another bottom than the "
                                       "one exported"}}


def _not_found() -> ServiceError:
    return ServiceError(404, "no such session (or not yours)", type="not_found_error", param="session_id",
                        code="session_not_found")


def _owners_auth(api_keys: tuple[str, ...], store: SessionStore) -> BearerKeys:
    """Keys whose callers own sessions by an HMAC under the store's own secret, kept inside the store (so replicas
    of one store and a restarted vendor agree; :meth:`SessionStore.principals`); sessions owned by a key's old
    sha256 id are handed to its new id first."""
    if not api_keys:
        return BearerKeys()
    principals = store.principals()
    for key in api_keys:
        store.rename_owner(legacy_principal_of_key(key), principals.of_key(key))
    return BearerKeys(api_keys, principals=principals)


def create_vendor_app(model_name: str | Path = "minilm", *, store: str | Path, splits: tuple[int, ...] = (0,),
                      api_keys: tuple[str, ...] = (), checkpoint_every: int = 50,
                      limits: SessionLimits | None = None, device: str | torch.device = "auto",
                      shared_store: bool = False, on_session: Callable[[str], Awaitable[object]] | None = None,
                      **service: Unpack[ServiceOptions]) -> FastAPI:
    """The vendor's server for ``model_name``, exporting bottoms at the ``splits`` positions, with sessions kept
    in the folder ``store``. ``shared_store``: replicas serve the same sessions from it (every step checkpointed,
    a stale copy reloaded). ``on_session(id)`` is awaited before any request on a session (Ray Serve's
    multiplexing uses it to keep a session's requests on the replica that holds it)."""
    loaded = load_pretrained(model_name, device=resolve_device(device), causal_lm_head=False)
    pooling = choose_pooling(loaded.family, folder=loaded.sentence_transformer)
    if not splits:
        raise ValueError("splits must name at least one split position")
    bottoms = {blocks: split_model(loaded.model, blocks, pooling=pooling, name=str(model_name))[0] for blocks in splits}
    limits = limits or SessionLimits()
    session_store = SessionStore(store)
    sessions = VendorSessions(loaded.model, bottoms=bottoms, pooling=pooling, store=session_store,
                              checkpoint_every=checkpoint_every, limits=limits, shared=shared_store)
    auth = _owners_auth(api_keys, session_store)
    router = APIRouter(tags=["sap"])

    async def guarded(call: Callable[..., Any], session_id: str, *args: object) -> Any:
        if on_session is not None:
            await on_session(session_id)
        try:
            return await run_in_threadpool(call, session_id, *args)
        except SessionNotFoundError:
            raise _not_found() from None

    @router.post(SESSIONS_PATH, status_code=201, responses=_CONFLICT)
    async def create_session(request: SessionRequest, principal: str = Depends(auth.dependency)) -> SessionInfo:
        """Open a fine-tuning session for the caller's key."""
        return await run_in_threadpool(sessions.create, request, principal)

    @router.get(SESSIONS_PATH + "/{session_id}")
    async def session_info(session_id: _SESSION_ID, principal: str = Depends(auth.dependency)) -> SessionInfo:
        return await guarded(sessions.info, session_id, principal)

    @router.post(SESSIONS_PATH + "/{session_id}/exchange", openapi_extra=_EXCHANGE_OPENAPI, response_class=Response,
                 responses=_CONFLICT)
    async def exchange(session_id: _SESSION_ID, request: Request, principal: str = Depends(auth.dependency)
                       ) -> Response:
        """One SAP message in, the vendor's answer out."""
        body = await request.body()
        content, headers = await guarded(sessions.exchange, session_id, principal, body)
        return Response(content, media_type=SAP_MESSAGE, headers=headers)

    @router.post(SESSIONS_PATH + "/{session_id}/checkpoint")
    async def checkpoint(session_id: _SESSION_ID, request: CheckpointRequest | None = None,
                         principal: str = Depends(auth.dependency)) -> SessionInfo:
        """Checkpoint now; with ``keep`` also file it under its step, to select later."""
        keep = request.keep if request is not None else False
        return await guarded(sessions.checkpoint, session_id, principal, keep)

    @router.post(SESSIONS_PATH + "/{session_id}/select")
    async def select(session_id: _SESSION_ID, request: SelectRequest, principal: str = Depends(auth.dependency)
                     ) -> SessionInfo:
        """Serve the adapter kept at ``step`` (the epoch the customer chose on its validation data)."""
        return await guarded(sessions.select, session_id, principal, request.step)

    @router.get(SESSIONS_PATH + "/{session_id}/adapter", response_class=Response,
                responses={200: {"content": {"application/octet-stream": _BINARY}}})
    async def adapter(session_id: _SESSION_ID, principal: str = Depends(auth.dependency)) -> Response:
        """The trained adapter as safetensors; its settings in the metadata ``facts``."""
        state, facts = await guarded(sessions.adapter, session_id, principal)
        content = save_safetensors({k: v.contiguous() for k, v in state.items()}, metadata={"facts": json.dumps(facts)})
        return Response(content, media_type="application/octet-stream")

    @router.delete(SESSIONS_PATH + "/{session_id}", status_code=204, response_class=Response)
    async def delete_session(session_id: _SESSION_ID, principal: str = Depends(auth.dependency)) -> Response:
        await guarded(sessions.delete, session_id, principal)
        return Response(status_code=204)

    bundles = [bottom_bundle(bottom, loaded.tokenizer).router(bundle_path(blocks))
               for blocks, bottom in bottoms.items()]
    name = public_model_name(str(model_name))
    app = create_service_app(title="privlm SAP vendor", routers=[router, *bundles], auth=auth,
                             max_request_bytes=limits.max_message_bytes,
                             health=lambda: {"model": name, "splits": sorted(bottoms),
                                             "sessions": sessions.session_count}, **service)
    registry = app.state.metrics.registry
    gauge = Gauge("privlm_sap_sessions", "Sessions held in memory", registry=registry)
    gauge.set_function(lambda: sessions.session_count)
    taken = Gauge("privlm_sap_steps_taken", "Training steps taken since start", registry=registry)
    taken.set_function(lambda: sessions.steps_taken)
    app.state.sessions = sessions
    return app

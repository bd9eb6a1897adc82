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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Unpack

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import Gauge
from safetensors.torch import save as save_safetensors

from privlm.accounting.principals import legacy_principal_of_key
from privlm.sap.model import VendorModel
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

if TYPE_CHECKING:
    from privlm.settings.sap import SapVendorSettings

_SESSION_ID = Annotated[str, PathParam(pattern=SESSION_ID_PATTERN, description="The session's id.")]


def _caller(request: Request) -> str:
    """The caller's principal, as the router's own dependency found it (:meth:`VendorRoutes.router`)."""
    principal: str = request.state.principal
    return principal


_PRINCIPAL = Annotated[str, Depends(_caller)]
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


@dataclass(frozen=True)
class VendorOptions:
    """How the vendor keeps sessions. ``checkpoint_every``: steps between a session's checkpoints. ``limits``: what a
    session may hold and a message carry. ``shared_store``: replicas serve the same sessions from the store (every
    step checkpointed, a stale copy reloaded)."""

    checkpoint_every: int = 50
    limits: SessionLimits = field(default_factory=SessionLimits)
    shared_store: bool = False

    @classmethod
    def from_settings(cls, settings: SapVendorSettings, *, shared_store: bool = False) -> VendorOptions:
        """The options ``privlm sap vendor`` sets: its checkpoint interval and session limits."""
        limits = SessionLimits(max_sessions=settings.max_sessions, max_abs_value=settings.max_abs_value)
        return cls(checkpoint_every=settings.checkpoint_every, limits=limits, shared_store=shared_store)


class VendorRoutes:
    """The session routes over ``sessions``, one method per endpoint; every route names its caller through
    ``auth``. ``on_session(id)`` is awaited before any request on a session (Ray Serve's multiplexing uses it to keep
    a session's requests on the replica that holds it)."""

    def __init__(self, sessions: VendorSessions, auth: BearerKeys,
                 on_session: Callable[[str], Awaitable[object]] | None = None) -> None:
        self.sessions, self.auth, self.on_session = sessions, auth, on_session

    def router(self) -> APIRouter:
        """The routes, each behind the caller's key (:meth:`BearerKeys.dependency`)."""
        async def name_the_caller(request: Request, principal: str = Depends(self.auth.dependency)) -> None:
            request.state.principal = principal

        router = APIRouter(tags=["sap"], dependencies=[Depends(name_the_caller)])
        session = SESSIONS_PATH + "/{session_id}"
        router.add_api_route(SESSIONS_PATH, self.create_session, methods=["POST"], status_code=201,
                             responses=_CONFLICT)
        router.add_api_route(session, self.session_info, methods=["GET"])
        router.add_api_route(session + "/exchange", self.exchange, methods=["POST"], response_class=Response,
                             openapi_extra=_EXCHANGE_OPENAPI, responses=_CONFLICT)
        router.add_api_route(session + "/checkpoint", self.checkpoint, methods=["POST"])
        router.add_api_route(session + "/select", self.select, methods=["POST"])
        router.add_api_route(session + "/adapter", self.adapter, methods=["GET"], response_class=Response,
                             responses={200: {"content": {"application/octet-stream": _BINARY}}})
        router.add_api_route(session, self.delete_session, methods=["DELETE"], status_code=204,
                             response_class=Response)
        return router

    async def _on(self, call: Callable[..., Any], session_id: str, *args: object) -> Any:
        """``call(session_id, *args)`` off the event loop, once the session is held here; a session that does not
        exist, or is not the caller's, is a 404."""
        if self.on_session is not None:
            await self.on_session(session_id)
        try:
            return await run_in_threadpool(call, session_id, *args)
        except SessionNotFoundError:
            raise _not_found() from None

    async def create_session(self, request: SessionRequest, principal: _PRINCIPAL) -> SessionInfo:
        """Open a fine-tuning session for the caller's key."""
        return await run_in_threadpool(self.sessions.create, request, principal)

    async def session_info(self, session_id: _SESSION_ID, principal: _PRINCIPAL) -> SessionInfo:
        return await self._on(self.sessions.info, session_id, principal)

    async def exchange(self, session_id: _SESSION_ID, request: Request, principal: _PRINCIPAL) -> Response:
        """One SAP message in, the vendor's answer out."""
        body = await request.body()
        content, headers = await self._on(self.sessions.exchange, session_id, principal, body)
        return Response(content, media_type=SAP_MESSAGE, headers=headers)

    async def checkpoint(self, session_id: _SESSION_ID, principal: _PRINCIPAL,
                         request: CheckpointRequest | None = None) -> SessionInfo:
        """Checkpoint now; with ``keep`` also file it under its step, to select later."""
        keep = request.keep if request is not None else False
        return await self._on(self.sessions.checkpoint, session_id, principal, keep)

    async def select(self, session_id: _SESSION_ID, request: SelectRequest, principal: _PRINCIPAL) -> SessionInfo:
        """Serve the adapter kept at ``step`` (the epoch the customer chose on its validation data)."""
        return await self._on(self.sessions.select, session_id, principal, request.step)

    async def adapter(self, session_id: _SESSION_ID, principal: _PRINCIPAL) -> Response:
        """The trained adapter as safetensors; its settings in the metadata ``facts``."""
        state, facts = await self._on(self.sessions.adapter, session_id, principal)
        content = save_safetensors({k: v.contiguous() for k, v in state.items()}, metadata={"facts": json.dumps(facts)})
        return Response(content, media_type="application/octet-stream")

    async def delete_session(self, session_id: _SESSION_ID, principal: _PRINCIPAL) -> Response:
        await self._on(self.sessions.delete, session_id, principal)
        return Response(status_code=204)


def create_vendor_app(model: VendorModel, *, store: str | Path, api_keys: tuple[str, ...] = (),
                      options: VendorOptions | None = None,
                      on_session: Callable[[str], Awaitable[object]] | None = None,
                      **service: Unpack[ServiceOptions]) -> FastAPI:
    """The vendor's server for ``model`` (:meth:`VendorModel.load`), exporting its bottoms, with sessions kept in
    the folder ``store``; ``on_session``: see :class:`VendorRoutes`. ``service`` options (docs, allowed hosts,
    in-flight cap, body timeout) go to :func:`create_service_app`."""
    options = options or VendorOptions()
    session_store = SessionStore(store)
    sessions = VendorSessions(model.model, bottoms=model.bottoms, pooling=model.pooling, store=session_store,
                              checkpoint_every=options.checkpoint_every, limits=options.limits,
                              shared=options.shared_store)
    auth = _owners_auth(api_keys, session_store)
    bundles = [bottom_bundle(bottom, model.tokenizer).router(bundle_path(blocks))
               for blocks, bottom in model.bottoms.items()]
    name = public_model_name(model.name)
    app = create_service_app(title="privlm SAP vendor", routers=[VendorRoutes(sessions, auth, on_session).router(),
                                                                 *bundles],
                             auth=auth, max_request_bytes=options.limits.max_message_bytes,
                             health=lambda: {"model": name, "splits": sorted(model.bottoms),
                                             "sessions": sessions.session_count}, **service)
    _count_sessions(app, sessions)
    app.state.sessions = sessions
    return app


def vendor_app(model: VendorModel, settings: SapVendorSettings, api_keys: tuple[str, ...], *,
               shared_store: bool = False, on_session: Callable[[str], Awaitable[object]] | None = None) -> FastAPI:
    """The server as ``privlm sap vendor`` builds it from its settings, in this process or in each Ray replica
    (``shared_store``: replicas serve one store)."""
    return create_vendor_app(model, store=settings.store, api_keys=api_keys,
                             options=VendorOptions.from_settings(settings, shared_store=shared_store),
                             on_session=on_session, **settings.options())


def _count_sessions(app: FastAPI, sessions: VendorSessions) -> None:
    """Gauges of the sessions held in memory and the steps taken, read when scraped."""
    registry = app.state.metrics.registry
    held = Gauge("privlm_sap_sessions", "Sessions held in memory", registry=registry)
    held.set_function(lambda: sessions.session_count)
    taken = Gauge("privlm_sap_steps_taken", "Training steps taken since start", registry=registry)
    taken.set_function(lambda: sessions.steps_taken)

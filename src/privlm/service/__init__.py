"""HTTP scaffolding every privlm service is built on; it knows no system.

Server side: :func:`create_service_app` (Bearer keys, body limits, one error model, /health,
/metrics, the Host check of open services), :func:`run_service` (uvicorn with header timeouts and a cap
on connections), :class:`Batcher` (concurrent requests in shared batches, callers taking turns) and
SnD's :class:`MicroBatcher` on it, :class:`Bundle`. Client side: :class:`RetryPolicy` (one policy
for sync and async clients), :func:`download_bundle` and :func:`get_capped`.
"""

from privlm.service.app import ServiceOptions, create_service_app
from privlm.service.auth import ANONYMOUS, BearerKeys
from privlm.service.batching import Batcher, MicroBatcher
from privlm.service.bundle import Bundle, BundleFile, check_file_name, download_bundle, get_capped
from privlm.service.catalog import ModelEntry, ModelList, catalog_router, check_model, model_not_found
from privlm.service.disclosure import public_config, public_model_name
from privlm.service.errors import ErrorBody, ErrorDetail, ServiceError, error_response
from privlm.service.retry import RequestRefusedError, RetryPolicy, ServerError
from privlm.service.scheduling import FairScheduler
from privlm.service.serving import run_service

__all__ = [
    "ANONYMOUS",
    "Batcher",
    "BearerKeys",
    "Bundle",
    "BundleFile",
    "ErrorBody",
    "ErrorDetail",
    "FairScheduler",
    "MicroBatcher",
    "ModelEntry",
    "ModelList",
    "RequestRefusedError",
    "RetryPolicy",
    "ServerError",
    "ServiceError",
    "ServiceOptions",
    "catalog_router",
    "check_file_name",
    "check_model",
    "create_service_app",
    "download_bundle",
    "error_response",
    "get_capped",
    "model_not_found",
    "public_config",
    "public_model_name",
    "run_service",
]

"""HTTP scaffolding every privlm service is built on; it knows no system.

Server side: :func:`create_service_app` (Bearer keys, body limits, one error model, /health,
/metrics), :class:`MicroBatcher`, :class:`Bundle`. Client side: :class:`RetryPolicy` (one policy
for sync and async clients) and :func:`download_bundle`.
"""

from privlm.service.app import create_service_app
from privlm.service.auth import ANONYMOUS, BearerKeys
from privlm.service.batching import MicroBatcher
from privlm.service.bundle import Bundle, BundleFile, check_file_name, download_bundle
from privlm.service.errors import ErrorBody, ErrorDetail, ServiceError, error_response
from privlm.service.retry import RetryPolicy, ServerError

__all__ = [
    "ANONYMOUS",
    "BearerKeys",
    "Bundle",
    "BundleFile",
    "ErrorBody",
    "ErrorDetail",
    "MicroBatcher",
    "RetryPolicy",
    "ServerError",
    "ServiceError",
    "check_file_name",
    "create_service_app",
    "download_bundle",
    "error_response",
]

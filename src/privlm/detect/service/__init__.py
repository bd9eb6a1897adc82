"""The detector over HTTP: ``POST /v1/detect`` (:mod:`privlm.detect.service.routes`), which the gateway mounts.

The core of :mod:`privlm.detect` does no I/O; what speaks HTTP lives here, as each system's ``service`` package."""

from privlm.detect.service.routes import DETECT_MODEL, DETECT_PATH, DetectorSource, detect_router

__all__ = ["DETECT_MODEL", "DETECT_PATH", "DetectorSource", "detect_router"]

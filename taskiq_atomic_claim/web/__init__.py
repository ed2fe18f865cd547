"""The live page (``taskiq-atomic-claim serve``) as an ASGI app; needs the
``web`` extra (Starlette, uvicorn, prometheus-client). The runtime never
imports it."""

from taskiq_atomic_claim.web.app import create_app

__all__ = ["create_app"]

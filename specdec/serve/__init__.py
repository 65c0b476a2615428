"""An OpenAI-compatible HTTP server on the engine's step API (``specdec serve``).

``create_app(engine, ServeConfig(model_name=...))`` returns a FastAPI app; run it with uvicorn.
Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client).
"""

from __future__ import annotations

from specdec.serve.app import create_app
from specdec.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]

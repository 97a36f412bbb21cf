"""Ollama's API (``/api/...``), for the clients that speak only Ollama: ``generation.py``
(``/api/chat``, ``/api/generate``), ``models.py`` (tags, show, ps, version, embed), on the same
TokenizerManager as the other APIs. ``protocol.py`` maps the bodies and options,
``replies.py`` writes the replies and NDJSON streams, ``route.py`` gives errors Ollama's
``{"error": message}`` shape. docs/ollama.md describes the API as served."""

from fastapi import APIRouter

from radixserve.server.ollama.generation import router as generation_router
from radixserve.server.ollama.models import router as models_router

router = APIRouter()
router.include_router(generation_router)
router.include_router(models_router)

__all__ = ["router"]

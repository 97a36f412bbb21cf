"""The FastAPI application of one running server: its routers, error handlers and the
``RequestGuard`` in front of them (``request_guard.py`` says what a request passes first)."""

from __future__ import annotations

from fastapi import FastAPI

from radixserve.server.context import ServerContext, ServerState
from radixserve.server.control_api import router as control_router
from radixserve.server.dashboard import router as dashboard_router
from radixserve.server.errors import install_error_handlers
from radixserve.server.native_api import router as native_router
from radixserve.server.ollama import router as ollama_router
from radixserve.server.openai.batch_runner import BatchRunner
from radixserve.server.openai.batch_store import BatchStore
from radixserve.server.openai.responses_store import ResponseStore
from radixserve.server.openai.serving_batch import router as batch_router
from radixserve.server.openai.serving_chat import router as chat_router
from radixserve.server.openai.serving_classify import router as classify_router
from radixserve.server.openai.serving_completions import router as completions_router
from radixserve.server.openai.serving_embedding import router as embedding_router
from radixserve.server.openai.serving_models import router as models_router
from radixserve.server.openai.serving_rerank import router as rerank_router
from radixserve.server.openai.serving_responses import router as responses_router
from radixserve.server.openai.serving_score import router as score_router
from radixserve.server.request_guard import MAX_BODY_BYTES, RequestGuard
from radixserve.server.weight_sync_api import router as weight_sync_router
from radixserve.version import __version__


def create_app(ctx: ServerContext, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """Build the app for one running server (routes read ``app.state.ctx``)."""
    # /openapi.json describes every route and body (what API clients and the fuzz suite read);
    # the interactive docs pages are left out: they load their scripts from a CDN.
    app = FastAPI(title="radixserve", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.ctx = ctx
    app.state.response_store = ResponseStore(ctx.server_args.responses_store_size,
                                             ctx.server_args.responses_store_ttl)
    # The Batch API (docs/batch.md): started (resuming unfinished batches) once the server is
    # ready, stopped at shutdown, by http_server.py.
    app.state.batch_runner = BatchRunner(
        BatchStore(ctx.server_args.batch_dir), app, ctx.server_args,
        accepting=lambda: ctx.state is ServerState.READY,
    )
    install_error_handlers(app)
    app.include_router(native_router)
    app.include_router(control_router)
    app.include_router(weight_sync_router)
    app.include_router(dashboard_router)
    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(embedding_router)
    app.include_router(models_router)
    app.include_router(responses_router)
    app.include_router(score_router)
    app.include_router(rerank_router)
    app.include_router(classify_router)
    app.include_router(ollama_router)
    app.include_router(batch_router)
    app.add_middleware(RequestGuard, ctx=ctx, max_body_bytes=max_body_bytes)
    return app

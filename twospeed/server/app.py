"""The OpenAI-compatible HTTP server: the FastAPI app (routers, errors, the guard) and how it runs.

Inputs: an EngineConfig (the model and engine options) and a ServerConfig (where to listen, the API key,
the lanes' SLOs, the waiting-queue bound). The routes live in one router per concern (routes_openai.py,
routes_ops.py, routes_dashboard.py) and share a ServerState through one FastAPI dependency; adding a page
is a new router module (with a `router`) and one line in ROUTERS. Every route needs the API key, when one
is set, unless guard.OPEN_PATHS opens its prefix with a flag.

Every response carries the split clock and bill: a `twospeed` object in the body (and in the final
streamed chunk of each choice), a Server-Timing header on non-streaming responses, and in every streamed
chunk the number of tokens it holds and when the server emitted each. The engine runs in a process of its own
(serving/process_engine.py), or in AsyncEngine's thread when it was built here.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from functools import partial

import uvicorn
from fastapi import FastAPI

from twospeed.config import EngineConfig
from twospeed.server import openapi, routes_dashboard, routes_openai, routes_ops
from twospeed.server.config import ServerConfig
from twospeed.server.errors import install_error_handlers
from twospeed.server.guard import GuardMiddleware
from twospeed.server.state import ServerState

__all__ = ["ServerConfig", "build_app", "run_server"]

ROUTERS = [routes_openai, routes_ops, routes_dashboard]  # modules with a `router` (and BODY_MODELS if they parse bodies themselves)


def build_app(engine_config: EngineConfig, server_config: ServerConfig, engine=None, client=None,
              routers: tuple = ()) -> FastAPI:
    """The FastAPI app. The engine is loaded in the lifespan (so /health is 200 only once it is), unless given.
    engine: an LLMEngine built here, or an EngineSpawn (its process started already); client: serve through this
    EngineClient instead (serving/engine_client.py); routers: modules whose routes come before ROUTERS' and so
    answer their paths instead (the cluster's merged /metrics and /dashboard/data)."""
    server_config.lanes()  # fail at start on a bad --slo, not on the first request

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        source = engine
        if source is None and server_config.engine_process:  # the engine's own process (process_engine.py) ...
            source = engine_config
        elif source is None:  # ... or a thread that builds it (only this brings torch into the server's process)
            from twospeed.engine.engine import LLMEngine

            source = partial(LLMEngine, engine_config)
        state = ServerState(source, server_config, server_config.served_model_name or engine_config.model, client)
        await state.start()
        app.state.twospeed = state
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="twospeed", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server that reports prefill and decode apart.")
    app.add_middleware(GuardMiddleware, get_state=lambda: getattr(app.state, "twospeed", None),
                       config=server_config)
    install_error_handlers(app)
    modules = [*routers, *ROUTERS]
    for module in modules:
        app.include_router(module.router)
    openapi.install(app, [m for module in modules for m in getattr(module, "BODY_MODELS", ())])
    return app


# -- running it -----------------------------------------------------------------------------------
# uvicorn's own deadline, past ours: by then every response has ended (it would cancel them, with tracebacks).
_UVICORN_MARGIN = 2.0


def run_server(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info",
               engine=None) -> int:
    """Serve until SIGTERM/SIGINT: then stop admitting, let in-flight requests finish for up to
    shutdown_grace seconds, end the rest (an error event and [DONE] for a stream, 503 otherwise), and
    return 0. engine: as build_app takes it."""
    app = build_app(engine_config, server_config, engine)
    # asyncio and h11 whatever else is installed (ray[serve] brings uvloop and httptools): the same server either way.
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=log_level,
                            loop="asyncio", http="h11",
                            timeout_graceful_shutdown=server_config.shutdown_grace + _UVICORN_MARGIN, lifespan="on",
                            access_log=log_level == "debug")
    server = _Server(config, app)
    server.run()
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling: the first SIGTERM/SIGINT drains, a second one forces the exit.
    (uvicorn re-raises a caught signal after shutting down, which would make the exit status 143, not 0.)"""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        state = getattr(self._app.state, "twospeed", None)
        if state is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(state.begin_drain)  # the grace's clock starts now
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            state = self._app.state.twospeed
            print(f"twospeed: serving {state.model_name!r} at http://{host}:{port}/v1 "
                  f"({state.engine.num_blocks} KV blocks, max_model_len {state.engine.max_model_len})", flush=True)

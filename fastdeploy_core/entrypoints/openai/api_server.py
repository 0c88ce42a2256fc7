"""The OpenAI-compatible HTTP server: the FastAPI app factory and :func:`run_server`.

The API process holds the tokenizer (chat template, tokenize, detokenize, stop strings); the
engine core runs in its own process (:mod:`fastdeploy_core.engine.core_client`). Routes:
``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/v1/abort_requests``,
``/tokenize``, ``/detokenize`` and ``/config-info`` (ports, pids, every setting) need the API key
when one is set; ``/health``, ``/ping`` and ``/metrics`` stay open, as load balancers and
Prometheus expect, unless ``--protect-metrics`` puts ``/metrics`` behind the key too.

The one way in is ``fastdeploy serve`` (:mod:`fastdeploy_core.cli.serve`), which builds the
configuration and calls :func:`run_server`; this module knows nothing of the command line.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

from fastdeploy_core.config import EngineArgs, ServerConfig
from fastdeploy_core.entrypoints.openai.auth import APIKeyChecker
from fastdeploy_core.entrypoints.openai.errors import error_body, install_exception_handlers
from fastdeploy_core.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from fastdeploy_core.entrypoints.openai.protocol import (
    AbortRequest,
    AbortResponse,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from fastdeploy_core.entrypoints.openai.request_body import GuardedRoute
from fastdeploy_core.errors import FastDeployError

logger = logging.getLogger("fastdeploy.serve")


def _json(model: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def _scheduler_holds_waiting(engine_args: EngineArgs, server: ServerConfig) -> bool:
    """Whether the request scheduler queues what the engine cannot start yet (then the API hands
    every request over at once, and ``--max-waiting-time`` does not apply: its ttl does)."""
    from fastdeploy_core.scheduler import scheduler_class

    sched = engine_args.scheduler
    holds = scheduler_class(sched.scheduler_name).holds_waiting_requests
    if holds and server.max_waiting_time is not None and server.max_waiting_time >= 0:
        logger.warning("--max-waiting-time %g does not apply with --scheduler-name %s: requests wait in its queue, "
                       "bounded by --scheduler-ttl %d s", server.max_waiting_time, sched.scheduler_name,
                       sched.scheduler_ttl)
    return holds


def build_app(engine_args: EngineArgs, server: ServerConfig) -> FastAPI:
    """The app; its lifespan loads the tokenizer, starts the engine core and stops it again."""
    from fastdeploy_core.entrypoints.openai.serving_chat import create_chat_completion, render_chat_prompt
    from fastdeploy_core.entrypoints.openai.serving_completion import create_completion
    from fastdeploy_core.entrypoints.openai.serving_engine import Admission, ServingState
    from fastdeploy_core.loader.model_source import resolve_model_source
    from fastdeploy_core.tokenizer import load_tokenizer

    # Resolved before serving so a wrong --model fails at once with its own message.
    source = resolve_model_source(engine_args.model.model)
    tokenizer = load_tokenizer(source)
    from fastdeploy_core.entrypoints.openai.reasoning_parsers import reasoning_parser_class
    from fastdeploy_core.entrypoints.openai.tool_parsers import load_tool_parser_plugin, tool_parser_class
    from fastdeploy_core.guided.registry import guided_backend_class

    # Unknown names fail before the engine starts, listing the registered ones.
    guided_backend = guided_backend_class(engine_args.structured.guided_decoding_backend)
    load_tool_parser_plugin(engine_args.structured.tool_parser_plugin)
    tool_parser = tool_parser_class(engine_args.structured.tool_call_parser)
    reasoning_parser = reasoning_parser_class(engine_args.structured.reasoning_parser)
    holder: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        from fastdeploy_core.engine.core_client import AsyncEngineClient, EngineCoreClient
        from fastdeploy_core.engine.output_processor import OutputProcessor

        core = EngineCoreClient(engine_args.flat(), port=server.engine_worker_queue_port,
                                log_level=logging.getLogger().getEffectiveLevel(), bind_host=server.host)
        engine = AsyncEngineClient(core, OutputProcessor(tokenizer))
        try:
            await engine.start()
        except FastDeployError as exc:
            logger.error("the engine core could not start: %s", exc.message)
            raise
        served = engine_args.model.served_model_name or _default_served_name(engine_args.model.model, source.path)
        admission = Admission(server.max_concurrency, engine_args.scheduler.max_num_seqs, server.max_waiting_time)
        admission.gate_slots = not _scheduler_holds_waiting(engine_args, server)
        metrics = ServerMetrics(lambda: engine.stats, lambda: admission.num_waiting,
                                engine_alive=lambda: engine.dead_error is None)
        state = ServingState(
            engine=engine,
            tokenizer=tokenizer,
            served_model_name=served,
            model_source=source.path,
            metrics=metrics,
            admission=admission,
            chat_template=engine_args.model.chat_template,
            generation_config=source.generation_config,
            accepted_model_names={engine_args.model.model} if engine_args.model.model else set(),
            trust_request_chat_template=server.trust_request_chat_template,
            policy=engine_args.scheduler.policy,
            guided_backend=guided_backend,
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
            pairing_key=_pairing_key(engine_args),
        )
        holder["state"] = state
        metrics_server = None
        if server.metrics_port and server.metrics_port != server.port:
            metrics_server = _start_metrics_server(metrics, server.host, server.metrics_port,
                                                   auth if server.protect_metrics else None)
        logger.info(
            "serving %s (max_model_len %d) on http://%s:%d; engine core pid %d on 127.0.0.1:%d",
            served, engine.max_model_len, server.host, server.port, core.process.pid, core.port,
        )
        try:
            yield
        finally:
            logger.info("shutting down: stopping the engine core")
            for rid in engine.active_request_ids():
                engine.abort([rid])
            await engine.shutdown()
            if metrics_server is not None:
                metrics_server.shutdown()
                metrics_server.server_close()
            holder.pop("state", None)
            logger.info("engine core stopped")

    app = FastAPI(title="fastdeploy-core OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = GuardedRoute
    app.state.max_request_body_bytes = server.max_request_body_bytes
    install_exception_handlers(app)
    auth = APIKeyChecker(server.api_key)
    protected = APIRouter(dependencies=[Depends(auth)], route_class=GuardedRoute)
    metrics_router = protected if server.protect_metrics else app

    def state() -> ServingState:
        return holder["state"]

    def engine_down() -> JSONResponse | None:
        """503 with the reason while requests cannot be served: the engine core died, or the
        request scheduler lost its store (``global`` without its Redis; 200 again once back)."""
        engine = state().engine
        err = engine.dead_error or engine.scheduler_error
        if err is None:
            return None
        return JSONResponse(error_body(err.message, err.error_type, None, err.code), status_code=503)

    @app.get("/health")
    async def health() -> Response:
        return engine_down() or JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return engine_down() or JSONResponse({"status": "ok"})

    @metrics_router.get("/metrics")
    async def metrics() -> Response:
        return Response(state().metrics.render(), media_type=CONTENT_TYPE)

    @protected.get("/config-info")
    async def config_info() -> JSONResponse:
        s = state()
        return JSONResponse(
            {
                "served_model_name": s.served_model_name,
                "model": s.model_source,
                "max_model_len": s.max_model_len,
                "engine_args": jsonable_encoder(engine_args.flat()),  # secrets shown as ********
                "server": server.model_dump(exclude={"api_key"}),
                "engine": s.engine.config_info,
                "engine_core_pid": s.engine.core.process.pid if s.engine.core.process else None,
                "engine_worker_queue_port": s.engine.core.port,
            }
        )

    @protected.get("/v1/models")
    async def list_models() -> JSONResponse:
        s = state()
        card = ModelCard(id=s.served_model_name, root=s.model_source, max_model_len=s.max_model_len)
        return _json(ModelList(data=[card]))

    @protected.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        result = await create_chat_completion(state(), req, raw)
        return result if isinstance(result, Response) else _json(result)

    @protected.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        result = await create_completion(state(), req, raw)
        return result if isinstance(result, Response) else _json(result)

    @protected.post("/v1/abort_requests")
    async def abort_requests(req: AbortRequest) -> JSONResponse:
        engine = state().engine
        active = engine.active_request_ids()
        wanted = active if req.abort_all else req.req_ids
        aborted = [rid for rid in wanted if rid in active]
        # Closing the request's stream is what aborts it: fail its queue so the handler ends.
        for rid in aborted:
            engine.abort_with_error(rid, _aborted_error(rid))
        return _json(AbortResponse(aborted=aborted, not_found=[r for r in wanted if r not in active]))

    @protected.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        s = state()
        s.check_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest.model_construct(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                disable_chat_template=False,
            )
            _, ids = await s.off_loop(render_chat_prompt, s, chat)
        else:
            ids = await s.off_loop(s.encode_prompt, req.prompt, req.add_special_tokens)
        return _json(TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=ids))

    @protected.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        s = state()
        s.check_model(req.model)
        s.check_token_ids(req.tokens, "tokens")
        text = await s.off_loop(s.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return _json(DetokenizeResponse(prompt=text))

    app.include_router(protected)
    return app


def _pairing_key(engine_args: EngineArgs) -> bytes | None:
    """A decode instance's key for the router's pairing header (None on other roles: the header
    is then not read, and a request is served here whole)."""
    split = engine_args.splitwise
    if split.splitwise_role != "decode" or split.router_secret is None:
        return None
    from fastdeploy_core.disaggregation.pairing import router_key

    return router_key(split.router_secret.get_secret_value())


def _aborted_error(request_id: str):
    from fastdeploy_core.entrypoints.openai.errors import APIError

    return APIError(f"request {request_id} was aborted through /v1/abort_requests", status=499,
                    error_type="request_aborted", code="aborted")


def _default_served_name(model: str | None, path: str) -> str:
    from fastdeploy_core.default_model import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    return model


def _start_metrics_server(metrics: ServerMetrics, host: str, port: int, auth: APIKeyChecker | None):
    """Prometheus text on its own port (``--metrics-port``), in a thread; ``auth`` checks the key
    when ``--protect-metrics`` is on."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from fastdeploy_core.entrypoints.openai.errors import APIError

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            if auth is not None:
                try:
                    auth.check(self.headers.get("Authorization"))
                except APIError as exc:
                    self.send_error(401, exc.message)
                    return
            body = metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep the server log for requests that matter
            pass

    import threading

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics-server", daemon=True).start()
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return httpd


def run_server(engine_args: EngineArgs, server: ServerConfig, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; the engine core is stopped before this returns."""
    import uvicorn

    app = build_app(engine_args, server)
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the
    # handlers that were in place before it started; with the defaults that kills the process
    # (status -15) after a clean shutdown. A stop that was asked for is a clean exit: status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    uvicorn.Server(config).run()


def _exit_cleanly(signum: int, frame) -> None:
    raise SystemExit(0)

"""The gateway's FastAPI app: routes, error handlers and middleware around one ``Upstream``."""

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from services.common import service_identity
from services.common.tls import TlsFiles
from services.gateway import chat, completions, errors, responses, tokenize
from services.gateway.admission import AdmissionMiddleware
from services.gateway.drain import Drain
from services.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from services.gateway.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    DirectBodyMiddleware,
    ErrorBoundaryMiddleware,
    ErrorCountMiddleware,
    HttpMetricsMiddleware,
    RequestIdMiddleware,
    TracingMiddleware,
)
from services.gateway.reasoning import REASONING_PARSERS, ReasoningParser
from services.gateway.serving import GatewayState, gateway_state
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from services.gateway.upstream import MAX_MESSAGE_BYTES, Upstream
from services.gateway.validation import Limits, ModelFacts, check_model

# A body of B bytes can tokenize to B token ids (byte-level BPE), up to 4 bytes each on the wire,
# and that reply must fit the gRPC message limit: else the request would fail with a retryable
# status instead of its 400/413.
MAX_BODY_BYTES_LIMIT = MAX_MESSAGE_BYTES // 4


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser pages may call the API (CORS), with vLLM's defaults: any origin, method and header,
    no credentials. A browser client (the openai package in a web page, a chat UI calling the API from
    the page) sends a preflight OPTIONS first; it is answered before the API key is checked, as a
    browser sends none with it, and every answer, a 401 or a 503 included, carries the headers that
    let the page read it."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class GatewayConfig:
    tokenizer_addr: str
    engine_addr: str
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()  # more names clients may send (--served-model-name's others)
    api_key: str | None = None
    limits: Limits = Limits()
    rpc_timeout_s: float = 30.0
    request_timeout_s: float = 3600.0
    tool_call_parser: str | None = None  # with auto tool choice on (--enable-auto-tool-choice); else None
    reasoning_parser: str | None = None  # --reasoning-parser: the model's thinking is told apart (reasoning.py)
    max_concurrent_requests: int = 1024  # generation requests in progress at once; more get 503
    stream_headers_timeout_s: float = 0.5  # longest a stream's headers wait for its first token
    tls: TlsFiles | None = None  # to the tokenizer and the engine/router (services.common.tls)
    cors: CorsPolicy = CorsPolicy()

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        limits = self.limits
        for name in ("max_n", "max_stop_strings", "max_prompts", "max_body_bytes", "max_sequences_per_request"):
            if getattr(limits, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(limits, name)}")
        if limits.max_body_bytes > MAX_BODY_BYTES_LIMIT:
            raise ValueError(f"--max-body-bytes {limits.max_body_bytes} is over {MAX_BODY_BYTES_LIMIT}: a prompt "
                             f"that large may tokenize to more than the {MAX_MESSAGE_BYTES >> 20} MiB gRPC "
                             "message limit; lower it")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}")
        if self.request_timeout_s <= 0 or self.rpc_timeout_s <= 0 or self.stream_headers_timeout_s < 0:
            raise ValueError("timeouts must be > 0 seconds")


async def _fetch_facts_early(upstream: Upstream, reasoning: ReasoningParser | None,
                             metrics: GatewayMetrics) -> None:
    """The model's facts and the tokenizer's decoder (a parse of its tokenizer JSON), and the reasoning
    parser's tags in its vocabulary (an error logged at once), before the first request needs them;
    where an upstream is not up yet, that request fetches them instead. The served names' series are
    made once the names are known (the engine's model, where no --served-model-name names it)."""
    try:
        metrics.add_models((await upstream.facts()).names)
        if reasoning is not None:
            await reasoning.end_token_ids(upstream)
    except errors.OpenAIError:
        pass


def create_app(config: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()
    if config.served_model_name:  # the series of the names served, at 0 from the start
        metrics.add_models((config.served_model_name, *config.served_model_aliases))
    drain = Drain()  # begun by __main__'s server on SIGTERM (app.state.drain)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        upstream = Upstream(config.tokenizer_addr, config.engine_addr, config.served_model_name,
                            rpc_timeout_s=config.rpc_timeout_s,
                            generate_timeout_s=config.request_timeout_s, tls=config.tls,
                            served_model_aliases=config.served_model_aliases)
        reasoning = ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None
        app.state.gateway = GatewayState(upstream, metrics, config.limits, config.tool_call_parser,
                                         config.stream_headers_timeout_s, drain, reasoning)
        drain.loop = asyncio.get_running_loop()
        warm_up = asyncio.ensure_future(_fetch_facts_early(upstream, reasoning, metrics))
        try:
            yield
        finally:
            warm_up.cancel()
            await upstream.close()

    # FastAPI's own request spans are off: TracingMiddleware makes the one root span, which carries
    # the request's facts (model, usage) and lasts as long as a stream does.
    app = FastAPI(title="Strata gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  telemetry={"tracing": False})
    errors.install_handlers(app)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(tokenize.router)

    def model_card(facts: ModelFacts, name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "strata",
                "root": facts.name, "parent": None, "max_model_len": facts.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        facts = await gateway_state(request).upstream.facts()
        return JSONResponse({"object": "list", "data": [model_card(facts, name) for name in facts.names]})

    @app.get("/v1/models/{model:path}")  # the served name may hold slashes ("org/name")
    async def retrieve_model(model: str, request: Request) -> JSONResponse:
        facts = await gateway_state(request).upstream.facts()
        check_model(model, facts)
        return JSONResponse(model_card(facts, model))

    # GET and HEAD: load balancers and uptime checks probe with HEAD (uvicorn sends its status and
    # headers, no body), which FastAPI's app.get alone answers with 405; vLLM's mounted Prometheus app
    # answers HEAD /metrics, TGI's routes HEAD /health too.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> JSONResponse:
        upstreams = await gateway_state(request).upstream.health()
        if all(upstreams.values()):
            return JSONResponse({"status": "ok", **upstreams})
        down = ", ".join(name for name, ok in upstreams.items() if not ok)
        error = errors.OpenAIError(f"upstream not serving: {down}", 503)
        return JSONResponse({**error.body(), **upstreams}, status_code=503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": service_identity.version()})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # Outermost last: the request id covers every response, 401 and 413 included; errors are
    # counted and durations observed whoever answers, the boundary's 500 included; CORS preflights are
    # answered before authentication, and CORS headers go on every answer inside it; a request is
    # authenticated before it takes an admission slot, and refused for overload before its body is read.
    app.add_middleware(ErrorBoundaryMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.limits.max_body_bytes)
    app.add_middleware(AdmissionMiddleware, max_concurrent_requests=config.max_concurrent_requests,
                       gauge=metrics.num_requests_admitted, drain=drain)
    app.state.drain = drain
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    cors = config.cors
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins), allow_methods=list(cors.allowed_methods),
                       allow_headers=list(cors.allowed_headers), allow_credentials=cors.allow_credentials)
    app.add_middleware(ErrorCountMiddleware, counter=metrics.request_errors)
    paths = frozenset(route.path for route in [*chat.router.routes, *completions.router.routes,
                                               *tokenize.router.routes, *app.routes]
                      if isinstance(route, APIRoute))
    app.add_middleware(HttpMetricsMiddleware, histogram=metrics.http_request_duration, paths=paths)
    app.add_middleware(TracingMiddleware)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(ErrorBoundaryMiddleware)  # and once more outermost, for the middleware themselves
    app.add_middleware(DirectBodyMiddleware)  # a stream's chunks past all of the above
    return app

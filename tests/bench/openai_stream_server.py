"""A tiny OpenAI-compatible streaming server for the benchmark tests, run for real on loopback.

Deterministic: a request for max_tokens N streams exactly N tokens ("t0 t1 ..."), in chunks whose
sizes cycle through `chunk_sizes` (so some chunks carry several tokens), waiting `token_delay_s`
per token before each chunk. It reports usage as OpenAI/vLLM do (a final `choices: []` chunk with
`include_usage`, usage on every chunk with `continuous_usage_stats`). It has no `/metrics` unless
created with `metrics=True`: then `/metrics` serves the gauges in `ServerState.gauges` (series key ->
value, e.g. `strata:autoscaler_current_replicas`), which a test may change while a run goes.
Every `fail_every`-th request is refused with a 503 and an OpenAI error body.
"""

import asyncio
import json
import threading
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "tiny-test-model"


@dataclass
class ServerState:
    """What the server saw and sent, for the tests to check the client against."""

    num_requests: int = 0
    num_refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_chunks: int = 0
    bodies: list[dict] = field(default_factory=list)
    gauges: dict[str, float] = field(default_factory=dict)
    num_scrapes: int = 0

    def exposition(self) -> str:
        """`gauges` in the Prometheus text format, one `# TYPE` line per metric name."""
        lines, typed = [], set()
        for key, value in sorted(self.gauges.items()):
            name = key.partition("{")[0]
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE {name} gauge")
            lines.append(f"{key} {value}")
        return "\n".join(lines) + "\n"


def _prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def create_app(state: ServerState, chunk_sizes: tuple[int, ...] = (1, 2, 1, 3), token_delay_s: float = 0.001,
               fail_every: int = 0, metrics: bool = False) -> FastAPI:
    app = FastAPI()

    if metrics:
        @app.get("/metrics")
        async def prometheus() -> PlainTextResponse:
            state.num_scrapes += 1
            return PlainTextResponse(state.exposition())

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def stream(body: dict, chat: bool):
        num_prompt, max_tokens = _prompt_tokens(body), int(body["max_tokens"])
        options = body.get("stream_options") or {}
        base = {"id": "cmpl-test", "model": MODEL, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(text: str | None, finish: str | None, completion: int) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            data = dict(base, choices=[choice])
            if options.get("continuous_usage_stats"):
                data["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": completion,
                                 "total_tokens": num_prompt + completion}
            state.num_chunks += 1
            return f"data: {json.dumps(data)}\n\n"

        if chat:
            role = dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}])
            yield f"data: {json.dumps(role)}\n\n"
        sent, k = 0, 0
        while sent < max_tokens:
            size = min(chunk_sizes[k % len(chunk_sizes)], max_tokens - sent)
            await asyncio.sleep(token_delay_s * size)
            text = "".join(f"t{sent + i} " for i in range(size))
            sent, k = sent + size, k + 1
            yield chunk(text, None, sent)
        yield chunk(None if chat else "", "length", sent)
        state.prompt_tokens += num_prompt
        state.completion_tokens += sent
        if options.get("include_usage"):
            usage = {"prompt_tokens": num_prompt, "completion_tokens": sent, "total_tokens": num_prompt + sent}
            yield f"data: {json.dumps(dict(base, choices=[], usage=usage))}\n\n"
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state.num_requests += 1
        state.bodies.append(body)
        if fail_every and state.num_requests % fail_every == 0:
            state.num_refused += 1
            error = {"message": "server overloaded", "type": "ServiceUnavailable", "param": None, "code": 503}
            return JSONResponse({"error": error}, status_code=503)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class RunningServer:
    """uvicorn on 127.0.0.1 and a free port, in a thread; `stop()` shuts it down."""

    def __init__(self, app: FastAPI) -> None:
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                break
            self._thread.join(0.01)
        if not self._server.started:
            raise RuntimeError("the test server did not start")
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

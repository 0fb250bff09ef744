"""An HTTP server for a transformers model whose KV cache is offloaded with kvoffload.

Routes (Starlette, served by uvicorn):

* ``POST /v1/completions``: the OpenAI completions shape. ``prompt`` is a string (encoded
  by a byte-level toy tokenizer) or a list of token ids; ``max_tokens``; greedy only
  (``temperature`` absent or 0); ``stream`` for server-sent events. The answer carries the
  generated ``token_ids`` and, under ``kvoffload``, the request's timings and where its
  prompt's KV came from (GPU prefix cache, loaded from CPU, computed).
* ``GET /stats``: the offloader's, the engine's and the server's counters as JSON.
* ``GET /metrics``: Prometheus text: `kvoffload.metrics.OffloaderCollector` plus the
  server's own counters and a time-to-first-token histogram.

Requests are batched continuously by `kvoffload.integrations.transformers.PagedEngine`,
driven by `engine_loop.EngineLoop`. Shutting down (Ctrl-C) stops admissions, ends every
request, waits for the copies in flight, and checks that the offloader is whole:
invariants hold, no CPU block is referenced, no GPU block is pinned or held.

    python examples/server/app.py --port 8000
    python examples/server/client.py --url http://127.0.0.1:8000

Needs the ``examples`` extra (from a kvoffload clone, ``pip install '.[examples]'``); see
docs/server.md.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import anyio
import anyio.abc
import torch
import uvicorn
from anyio.streams.memory import MemoryObjectReceiveStream
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, ValidationError
from pydantic_core import PydanticCustomError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_loop import EngineLoop, Event, ServerClosed, ShutdownReport, prompt_sources

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import KvOffloadError
from kvoffload.integrations.transformers import GenerationResult, PagedEngine
from kvoffload.metrics import OffloaderCollector
from kvoffload.pool.hints import MAX_RETAIN_FOR_S
from kvoffload.storage import HostKVBuffer
from kvoffload.transfer import ThreadCopyEngine
from kvoffload.transfer.thread_engine import CopyHook

QUICK = os.environ.get("KVOFFLOAD_EXAMPLE_QUICK") == "1"  # CI and tests: a smaller model

log = logging.getLogger("uvicorn.error")  # the server's log: uvicorn configures and prints it

# -- the toy tokenizer ----------------------------------------------------------------------


class ByteTokenizer:
    """Text to token ids and back: token ``b`` (0-255) is the byte ``b`` of UTF-8.

    Ids of 256 and above (a model's vocabulary may be larger) decode to U+FFFD.
    """

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes as token ids."""
        return list(text.encode("utf-8"))

    def decoder(self) -> codecs.IncrementalDecoder:
        """A decoder for a stream of tokens (a character may span tokens)."""
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode_one(self, decoder: codecs.IncrementalDecoder, token_id: int) -> str:
        """Feed one token to ``decoder``; the text it completes."""
        if token_id >= 256:
            return decoder.decode(b"", final=True) + "\ufffd"
        return decoder.decode(bytes([token_id]))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Decode a whole sequence."""
        decoder = self.decoder()
        text = "".join(self.decode_one(decoder, t) for t in token_ids)
        return text + decoder.decode(b"", final=True)


# -- the request body ------------------------------------------------------------------------


def _only_one(n: int) -> int:
    if n != 1:
        raise PydanticCustomError("literal_error", "Input should be 1")
    return n


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (the OpenAI fields this server supports).

    Strict: a field of the wrong JSON type is refused, never converted (``"5"`` or
    ``true`` is not a ``max_tokens``, ``"yes"`` not a ``stream``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt: str | list[StrictInt] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=0.0)
    stream: bool = False
    n: Annotated[int, AfterValidator(_only_one)] = 1
    model: str | None = None
    user: str | None = None
    retain_for_s: float | None = Field(
        default=None, gt=0.0, le=MAX_RETAIN_FOR_S, allow_inf_nan=False
    )
    """A session hint (docs/hints.md): keep the request's blocks in the CPU pool this many
    seconds after it ends (an agent's tool call), for ``session``."""
    session: str | None = Field(default=None, min_length=1)
    """The hint's session (a later hint of the same session replaces it); default: the
    request's own."""


class PrefetchRequest(BaseModel):
    """The body of ``POST /v1/prefetch``: the prompt the next request will send."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt: str | list[StrictInt] = Field(min_length=1)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def _validation_error(exc: ValidationError) -> JSONResponse:
    """A 400 for a body that is not a JSON object; a 422 naming the first bad field."""
    first = exc.errors()[0]
    if not first["loc"]:
        return _error(400, f"the body is not a valid request: {first['msg']}")
    return _error(422, *_field_message(first))


def _field_message(first: Any) -> tuple[str, str]:
    """A field's error as a message naming the field and the value, and the field."""
    param = str(first["loc"][0])
    got = first.get("input")
    if param == "temperature":
        return f"temperature={got!r}: only greedy decoding (0 or absent) is supported", param
    if param == "prompt" and len(first["loc"]) > 1:  # neither of the union's types
        return f"prompt must be a string or a list of integer token ids, got {got!r}", param
    return f"{param}: {first['msg']} (got {got!r})", param


# -- the server's state and metrics -------------------------------------------------------------


@dataclass(slots=True)
class ServerState:
    """What the routes reach through ``app.state.server``."""

    engine: PagedEngine
    model_name: str
    tokenizer: ByteTokenizer
    registry: CollectorRegistry
    ttft: Histogram
    loop: EngineLoop | None = None
    offloader: KVOffloader | None = None
    report: ShutdownReport | None = None
    rejected: int = 0
    stop: Callable[[], None] | None = None
    """Asks the HTTP server to shut down (`bind_server` sets it)."""
    failure: BaseException | None = None
    """What ended the step loop, when it failed."""
    tier_kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    """The offloader's secondary tiers: name -> kind (``disk``, ``redis`` ...)."""


def _not_running(state: ServerState) -> str:
    if state.failure is not None:
        return f"the server is stopping: its step loop failed ({state.failure!r})"
    return "the server is not running"


def bind_server(app: Starlette, server: uvicorn.Server) -> None:
    """Let ``app`` stop ``server`` when its step loop fails."""
    state: ServerState = app.state.server
    state.stop = lambda: setattr(server, "should_exit", True)


class QuietServer(uvicorn.Server):
    """uvicorn's server, which ends the requests still open at shutdown itself.

    On Ctrl-C uvicorn stops accepting connections and waits for the open requests. When
    ``grace_s`` is over (at once on a second Ctrl-C), the server ends those left through
    `EngineLoop.close`: their handlers answer 503, or end their event stream with an error
    event, and return. Left to uvicorn, they would be cancelled and each logged with a
    traceback. uvicorn's own cancellation stays as a backstop, 5 s later, for a handler
    that cannot end (a client that stopped reading).

    Args:
        config: uvicorn's configuration of ``app``; its ``timeout_graceful_shutdown`` is
            replaced.
        app: the application `create_app` made.
        grace_s: how long open requests may run on after Ctrl-C.
    """

    def __init__(self, config: uvicorn.Config, app: Starlette, grace_s: float = 5.0) -> None:
        config.timeout_graceful_shutdown = math.ceil(grace_s) + 5
        super().__init__(config)
        self._state: ServerState = app.state.server
        self._grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, ending the open requests when the grace period is over."""
        async with anyio.create_task_group() as tg:

            async def end_after_grace() -> None:
                with anyio.move_on_after(self._grace_s):
                    while not self.force_exit:  # noqa: ASYNC110 (a flag uvicorn's signal handler sets)
                        await anyio.sleep(0.05)
                self._end_requests()

            tg.start_soon(end_after_grace)
            await super().shutdown(sockets)
            tg.cancel_scope.cancel()
        if self.force_exit:
            # A second Ctrl-C: uvicorn waited for nothing and skips the application's
            # shutdown. End what is open, let the handlers answer, and shut the
            # application down (offloader closed and checked) all the same.
            self._end_requests()
            with anyio.move_on_after(self._grace_s):
                while self.server_state.tasks:  # noqa: ASYNC110 (uvicorn's set of handler tasks)
                    await anyio.sleep(0.01)
            await self.lifespan.shutdown()

    def _end_requests(self) -> None:
        loop = self._state.loop
        if loop is None:
            return
        live = loop.statistics().live
        if live:
            why = (
                "a second Ctrl-C"
                if self.force_exit
                else f"the grace period of {self._grace_s:g} s is over"
            )
            log.info("shutting down: ending %d open request(s), %s", live, why)
        loop.close()


class _ServerCollector(Collector):
    """The engine's and the loop's counters as Prometheus metrics, read at each scrape."""

    def __init__(self, state: ServerState) -> None:
        self._state = state

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on nothing; do not collect at registration

    def collect(self) -> Iterator[Metric]:
        state = self._state
        es = state.engine.statistics()
        requests = CounterMetricFamily(
            "kvoffload_server_requests", "Requests by how they ended.", labels=["outcome"]
        )
        if state.loop is not None:
            ls = state.loop.statistics()
            for outcome, value in (
                ("completed", ls.completed),
                ("aborted", ls.aborted),
                ("failed", ls.failed),
            ):
                requests.add_metric([outcome], value)
        requests.add_metric(["rejected"], state.rejected)
        yield requests
        tokens = CounterMetricFamily(
            "kvoffload_server_prompt_tokens",
            "Prompt tokens of completed requests by where their KV came from (the "
            "sources of /stats' prompt_tokens).",
            labels=["source", "tier"],
        )
        if state.loop is not None:
            by_source = state.loop.statistics().prompt_tokens_by_source
            for source in ("gpu_cache", "cpu_pool"):
                tokens.add_metric([source, ""], by_source.get(source, 0))
            for name in state.tier_kinds:
                tokens.add_metric(["tier", name], by_source.get(f"tier:{name}", 0))
            tokens.add_metric(["computed", ""], by_source.get("computed", 0))
        yield tokens
        yield CounterMetricFamily(
            "kvoffload_server_computed_tokens",
            "Tokens the model computed (prompt and generated).",
            value=es.computed_tokens,
        )
        yield CounterMetricFamily("kvoffload_server_steps", "Engine steps run.", value=es.steps)
        yield CounterMetricFamily(
            "kvoffload_server_preemptions",
            "Running requests preempted for lack of GPU blocks.",
            value=es.preemptions,
        )
        queue = GaugeMetricFamily(
            "kvoffload_server_requests_in_engine", "Requests by state.", labels=["state"]
        )
        queue.add_metric(["waiting"], es.waiting)
        queue.add_metric(["running"], es.running)
        yield queue
        blocks = GaugeMetricFamily(
            "kvoffload_server_gpu_blocks", "GPU KV blocks by state.", labels=["state"]
        )
        a = es.allocator
        for name, value in (
            ("used", a.num_used),
            ("free", a.num_free),
            ("held", a.num_held),
            ("cached", a.num_cached),
        ):
            blocks.add_metric([name], value)
        yield blocks


# -- routes ----------------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


class _EngineStream(StreamingResponse):
    """A server-sent-event response that aborts its request however the response ends,
    even when the client left before the first event (the body was never iterated)."""

    def __init__(self, stack: AsyncExitStack, body: AsyncIterator[str]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._stack = stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._stack.aclose()


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    state = _state(request)
    try:
        raw = await request.body()
    except ClientDisconnect:
        log.info("a client left before sending the whole body of %s", request.url.path)
        return Response(status_code=400)  # nobody reads it
    try:
        body = CompletionRequest.model_validate_json(raw)
    except ValidationError as exc:
        state.rejected += 1
        return _validation_error(exc)
    prompt = state.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
    cid = f"cmpl-{uuid.uuid4().hex[:24]}"
    if state.loop is None:
        return _error(503, _not_running(state))
    stack = AsyncExitStack()
    try:
        events = await stack.enter_async_context(
            state.loop.submit(prompt, body.max_tokens, body.retain_for_s, body.session)
        )
    except ServerClosed as exc:
        return _error(503, str(exc))
    except ValueError as exc:  # the engine refused it; its message names the value
        state.rejected += 1
        message = str(exc).replace("max_new_tokens", "max_tokens")
        if "blocks" in message:  # too long for the GPU cache
            message += f" (a prompt of {len(prompt)} tokens plus max_tokens={body.max_tokens})"
            return _error(400, message, "max_tokens")
        return _error(400, message, "max_tokens" if "max_tokens" in message else "prompt")
    if body.stream:
        return _EngineStream(stack, _stream(state, cid, events))
    async with stack:
        return await _complete(request, state, cid, events)


async def _complete(
    request: Request, state: ServerState, cid: str, events: MemoryObjectReceiveStream[Event]
) -> Response:
    result: GenerationResult | None = None
    async with anyio.create_task_group() as tg:

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()  # the client left: leaving submit() aborts the request

        tg.start_soon(watch_disconnect)
        async for event in events:
            if isinstance(event, GenerationResult):
                result = event
        tg.cancel_scope.cancel()
    if result is None:
        return _error(503, "the server shut down before the request ended")
    if result.finish_reason == "error":
        return _error(500, f"the model failed on this request: {result.error}")
    if result.finish_reason == "aborted":
        if state.failure is not None:
            return _error(503, _not_running(state))
        return _error(503, "the request was aborted (the server is shutting down)")
    if result.ttft_s is not None:
        state.ttft.observe(result.ttft_s)
    return JSONResponse(_body(state, cid, result))


async def _stream(
    state: ServerState, cid: str, events: MemoryObjectReceiveStream[Event]
) -> AsyncIterator[str]:
    decoder = state.tokenizer.decoder()
    ended = False
    async for event in events:
        ended = not isinstance(event, int)
        if isinstance(event, int):
            text = state.tokenizer.decode_one(decoder, event)
            yield _sse(_chunk(state, cid, text, [event], None))
        elif event.finish_reason in ("error", "aborted"):
            message = event.error or "the request was aborted (the server is shutting down)"
            yield _sse({"error": {"message": message, "type": "server_error"}})
        else:
            if event.ttft_s is not None:
                state.ttft.observe(event.ttft_s)
            final = _chunk(state, cid, "", [], event.finish_reason)
            final["usage"] = _usage(state, event)
            final["kvoffload"] = _timings(state, event)
            yield _sse(final)
    if not ended:  # ended by the server during a step: the engine had no result yet
        message = "the server shut down before the request ended"
        yield _sse({"error": {"message": message, "type": "server_error"}})
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _chunk(
    state: ServerState, cid: str, text: str, ids: list[int], finish: str | None
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [
            {"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish}
        ],
    }


def _usage(state: ServerState, r: GenerationResult) -> dict[str, Any]:
    """OpenAI's usage, with ``prompt_tokens_details.cached_tokens`` (the prompt tokens a
    cache served: the GPU prefix cache and kvoffload) and kvoffload's breakdown."""
    n = len(r.output_token_ids)
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": r.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": r.gpu_cached_tokens + r.loaded_tokens},
        "kvoffload": _sources(state, r),
    }


def _sources(state: ServerState, r: GenerationResult) -> dict[str, Any]:
    """The prompt's tokens by source (`prompt_sources`, each tier with its kind) and the
    `MissReason` value of the lookup that admitted it."""
    sources = prompt_sources(r)
    tiers = {
        name: {"kind": state.tier_kinds.get(name, "unknown"), "tokens": n}
        for name, n in sorted(r.tier_tokens.items())
    }
    return {
        "gpu_cache": sources["gpu_cache"],
        "cpu_pool": sources["cpu_pool"],
        "tiers": tiers,
        "computed": sources["computed"],
        "miss_reason": r.miss_reason,
    }


def _timings(state: ServerState, r: GenerationResult) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "ttft_s": r.ttft_s,
        "total_s": r.total_s,
        "load_wait_s": r.load_wait_s,
        "forward_s": r.forward_s,
        "gpu_cached_tokens": r.gpu_cached_tokens,
        "loaded_tokens": r.loaded_tokens,
        "computed_tokens": r.computed_tokens,
        "preemptions": r.preemptions,
        "cached_tokens_by_source": _sources(state, r),
        "miss_reason": r.miss_reason,
    }


def _body(state: ServerState, cid: str, r: GenerationResult) -> dict[str, Any]:
    text = state.tokenizer.decode(r.output_token_ids)
    body = _chunk(state, cid, text, list(r.output_token_ids), r.finish_reason)
    body["usage"] = _usage(state, r)
    body["kvoffload"] = _timings(state, r)
    return body


async def prefetch(request: Request) -> Response:
    """``POST /v1/prefetch``: promote a prompt's blocks from the offloader's tiers into its
    CPU pool ahead of the request that sends it; answer the blocks and tokens of the
    prompt now in the CPU pool (without tiers: what is there already)."""
    state = _state(request)
    try:
        raw = await request.body()
    except ClientDisconnect:
        return Response(status_code=400)  # nobody reads it
    try:
        body = PrefetchRequest.model_validate_json(raw)
    except ValidationError as exc:
        state.rejected += 1
        return _validation_error(exc)
    if state.loop is None:
        return _error(503, _not_running(state))
    off = state.offloader
    if off is None:
        return _error(400, "this server does not offload (started with --no-offload)")
    prompt = state.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
    try:
        blocks = await off.hints.prefetch(prompt)
    except KvOffloadError as exc:
        state.rejected += 1
        return _error(400, str(exc), "prompt")
    tokens = blocks * off.layout.block_size
    return JSONResponse({"object": "prefetch", "cpu_blocks": blocks, "cpu_tokens": tokens})


async def stats(request: Request) -> Response:
    """``GET /stats``: the offloader's, the engine's and the server's counters as JSON."""
    state = _state(request)
    if state.loop is None:
        return _error(503, _not_running(state))
    off = state.offloader
    stats = off.statistics() if off is not None else None
    loop = state.loop.statistics()
    by_source = loop.prompt_tokens_by_source
    misses: dict[str, Any] | None = None
    if stats is not None:
        misses = {"by_reason": {r.value: n for r, n in stats.scheduler.lookup_misses.items()}}
        if stats.groups is not None:
            misses["by_group"] = {
                g: {r.value: n for r, n in gs.lookup_misses.items()}
                for g, gs in stats.groups.items()
            }
    return JSONResponse(
        {
            "offloader": dataclasses.asdict(stats) if stats is not None else None,
            "engine": dataclasses.asdict(state.engine.statistics()),
            "server": {**dataclasses.asdict(loop), "rejected": state.rejected},
            "prompt_tokens": {
                "gpu_cache": by_source.get("gpu_cache", 0),
                "cpu_pool": by_source.get("cpu_pool", 0),
                "tiers": {
                    name: {"kind": kind, "tokens": by_source.get(f"tier:{name}", 0)}
                    for name, kind in state.tier_kinds.items()
                },
                "computed": by_source.get("computed", 0),
            },
            "requests_by_miss_reason": dict(loop.miss_reasons),
            "lookup_misses": misses,
        }
    )


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text format (collected on the event loop)."""
    return Response(generate_latest(_state(request).registry), media_type=CONTENT_TYPE_LATEST)


# -- the application ----------------------------------------------------------------------------


def create_app(
    engine: PagedEngine,
    config: OffloadConfig | None,
    *,
    model_name: str = "tiny-llama",
    copy_hook: CopyHook | None = None,
) -> Starlette:
    """The Starlette app; the offloader and the step loop live in its lifespan.

    After shutdown, ``app.state.server.report`` holds the `ShutdownReport`. When the
    step loop fails, the error is logged with its cause, every request still open is
    ended (503), and the server is stopped: through the hook `bind_server` installs, or
    else by a SIGINT to this process, as Ctrl-C would. ``app.state.server.failure``
    then holds the error.

    Args:
        engine: the engine, with no offloader attached and no request in progress.
        config: the offloader's settings (``block_size`` must be the engine's); ``None``
            serves without offloading, to measure what offloading changes.
        model_name: reported in answers.
        copy_hook: run before each copy in the copy worker (tests slow copies with it).
    """
    registry = CollectorRegistry()
    ttft = Histogram(
        "kvoffload_server_ttft_seconds",
        "Time from a request's arrival to its first generated token.",
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf),
        registry=registry,
    )
    state = ServerState(engine, model_name, ByteTokenizer(), registry, ttft)
    registry.register(_ServerCollector(state))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        off: KVOffloader | None = None
        loop = EngineLoop(engine)
        in_flight = 0
        async with AsyncExitStack() as stack:
            if config is not None:
                off = await stack.enter_async_context(_offloader(engine, config, copy_hook))
                engine.attach(off)
                stack.callback(engine.attach, None)
                registry.register(OffloaderCollector(off))
            state.offloader, state.loop = off, loop
            tiers = off.statistics().tiers if off is not None else None
            state.tier_kinds = {t.name: t.kind for t in tiers.tiers} if tiers else {}

            async def run_loop(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                try:
                    await loop.run(task_status=task_status)
                except Exception as exc:  # a dead loop must not leave a server answering 503
                    state.failure = exc
                    state.loop = None
                    log.exception("the step loop failed; stopping the server")
                    if state.stop is not None:
                        state.stop()
                    else:
                        signal.raise_signal(signal.SIGINT)

            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(run_loop)
                    yield
                    in_flight = off.statistics().scheduler.in_flight_transfers if off else 0
                    tg.cancel_scope.cancel()
            finally:
                state.loop = None
        # The offloader is closed: it waited for every copy in flight.
        state.report = ShutdownReport.check(off, loop, in_flight)

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/prefetch", prefetch, methods=["POST"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.server = state
    return app


@asynccontextmanager
async def _offloader(
    engine: PagedEngine, config: OffloadConfig, copy_hook: CopyHook | None
) -> AsyncIterator[KVOffloader]:
    """One `KVOffloader` for the process, over the engine's KV cache."""
    host: HostKVBuffer | None = None
    copy_engine: ThreadCopyEngine | None = None
    if copy_hook is not None:
        host = HostKVBuffer(
            engine.layout, config.resolve_num_cpu_blocks(engine.layout), pin_memory="never"
        )
        copy_engine = ThreadCopyEngine(engine.layout, engine.kv, host, copy_hook=copy_hook)
    try:
        off = KVOffloader(
            config, engine.kv, layout=engine.layout, pinner=engine.pinner, copy_engine=copy_engine
        )
        async with off:
            yield off
    finally:
        if host is not None:
            host.close()


# -- the command line -------------------------------------------------------------------------


def build_model(path: str | None, *, device: str = "cpu", seed: int = 0) -> Any:
    """A causal LM on ``device``: the checkpoint at ``path``, or a small Llama with random
    weights (smaller still with ``KVOFFLOAD_EXAMPLE_QUICK=1``)."""
    torch.manual_seed(seed)
    if path is not None:
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.to(device)
    hidden = 64 if QUICK else 256
    config = LlamaConfig(
        vocab_size=256,  # the byte tokenizer's
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2 if QUICK else 4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(config)
    return model.to(device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", help="a checkpoint directory (default: random weights)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=256, help="the engine's KV cache")
    parser.add_argument("--cpu-blocks", type=int, default=4096, help="kvoffload's CPU pool")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument(
        "--no-offload", action="store_true", help="serve without kvoffload (for comparison)"
    )
    parser.add_argument(
        "--load-deadline-s",
        type=float,
        help="abandon a request's load from the CPU pool after this many seconds and "
        "recompute those tokens (default: wait for every load)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=5.0,
        help="at shutdown (Ctrl-C), how long open requests may run on before the server "
        "ends them (default 5)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch's intra-op threads (default: torch's choice, one per core); 1 on a CPU "
        "that other work shares",
    )
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.load_deadline_s is not None and not args.load_deadline_s >= 0:
        parser.error(f"--load-deadline-s must be >= 0, got {args.load_deadline_s}")
    if not args.grace_s >= 0:
        parser.error(f"--grace-s must be >= 0, got {args.grace_s}")
    try:
        return _serve(args)
    except KeyboardInterrupt:  # Ctrl-C while the model loads, before uvicorn handles it
        print("interrupted before the server started", file=sys.stderr)
        return 130


def _serve(args: argparse.Namespace) -> int:
    """Build the model, the engine and the app; serve until Ctrl-C; report the shutdown."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = build_model(args.model, device=args.device)
    engine = PagedEngine(
        model,
        num_gpu_blocks=args.gpu_blocks,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        load_deadline_s=args.load_deadline_s,
    )
    config = None
    if not args.no_offload:
        config = OffloadConfig(
            block_size=args.block_size,
            num_cpu_blocks=args.cpu_blocks,
            model_id=args.model or "random-llama",
        )
    app = create_app(engine, config, model_name=args.model or "random-llama")
    server = QuietServer(uvicorn.Config(app, host=args.host, port=args.port), app, args.grace_s)
    bind_server(app, server)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C after shutdown
        server.run()
    report = app.state.server.report
    if report is None:
        print("the server did not start", file=sys.stderr)
        return 1
    print(f"shutdown: {report.describe()}", flush=True)
    failure = app.state.server.failure
    if failure is not None:
        print(f"the step loop failed: {failure!r}", file=sys.stderr)
        return 1
    return 0 if report.whole else 1


if __name__ == "__main__":
    sys.exit(main())

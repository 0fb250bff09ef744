"""The example server, examples/server/: HTTP on 127.0.0.1, continuous batching, and an
offloader left whole by disconnects, model errors and shutdown."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the 'transformers' extra")
pytest.importorskip("starlette", reason="needs the 'examples' extra")
pytest.importorskip("uvicorn", reason="needs the 'examples' extra")
pytest.importorskip("httpx", reason="needs the 'examples' extra")
pytest.importorskip("prometheus_client", reason="needs the 'prometheus' extra")

import anyio
import httpx
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.integrations.transformers import PagedEngine
from kvoffload.testing import CopyFaults

SERVER = Path(__file__).resolve().parents[1] / "examples" / "server"
BLOCK = 4
MARKER = 255  # a prompt holding this token fails inside the model (see fail_on_marker)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


def load(name: str) -> ModuleType:
    """Import ``examples/server/<name>.py`` (it finds its sibling modules itself)."""
    spec = importlib.util.spec_from_file_location(
        f"kvoffload_example_server_{name}", SERVER / f"{name}.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


app_module = load("app")
client_module = load("client")


def tiny_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config)


def tiny_engine(num_gpu_blocks: int = 48, seed: int = 0) -> PagedEngine:
    return PagedEngine(
        tiny_model(seed),
        num_gpu_blocks=num_gpu_blocks,
        block_size=BLOCK,
        max_batch_tokens=96,
        max_running=8,
    )


def offload_config() -> OffloadConfig:
    return OffloadConfig(block_size=BLOCK, num_cpu_blocks=512, model_id="tiny-test")


@asynccontextmanager
async def serving(
    app: Any, *, graceful_s: float = 2.0
) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Serve ``app`` on 127.0.0.1 on a free port; shut it down cleanly on exit (requests
    still open after ``graceful_s`` are cancelled)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s)
    server = uvicorn.Server(config)
    app_module.bind_server(app, server)  # a failed step loop stops this server
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


def assert_whole(app: Any) -> Any:
    report = app.state.server.report
    assert report is not None, "shutdown did not run"
    assert report.invariant_error is None
    assert report.requests.live == 0
    assert report.cpu_blocks_referenced == 0
    assert report.live_requests == 0
    assert report.in_flight_transfers == 0
    assert report.gpu_blocks_pinned == 0
    assert report.gpu_blocks_in_use == 0
    assert report.whole
    return report


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/stats")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def until(client: httpx.AsyncClient, check: Any) -> dict[str, Any]:
    """Poll ``/stats`` until ``check(stats)`` holds (a few seconds at most)."""
    for _ in range(300):
        body = await stats(client)
        if check(body):
            return body
        await asyncio.sleep(0.01)
    raise AssertionError(f"never reached: {json.dumps(body)}")


async def test_concurrent_conversations_match_the_engine_in_process() -> None:
    # 40 blocks of 4 tokens: too few to keep earlier turns while other conversations run.
    app = app_module.create_app(tiny_engine(num_gpu_blocks=40), offload_config())
    async with serving(app) as (url, _server):
        results = await client_module.replay(
            url, conversations=3, turns=3, user_tokens=24, max_tokens=6, vocab=MARKER
        )
        async with httpx.AsyncClient(base_url=url) as client:
            body = await stats(client)
            metrics = (await client.get("/metrics")).text
    assert len(results) == 9
    # Answers equal the engine's own, run in-process one request at a time, without
    # offload and without prefix caching (every prompt computed in full).
    reference = PagedEngine(
        tiny_model(), num_gpu_blocks=64, block_size=BLOCK, enable_prefix_caching=False
    )
    expected = []
    for r in sorted(results, key=lambda r: (r.conversation, r.turn)):
        reference.add_request("ref", r.prompt_ids, max_new_tokens=6)
        (ref,) = await reference.run_until_done()
        assert ref.computed_tokens == r.prompt_tokens
        expected.append((r.conversation, r.turn, ref.output_token_ids))
    got = [
        (r.conversation, r.turn, r.output_ids)
        for r in sorted(results, key=lambda r: (r.conversation, r.turn))
    ]
    assert got == expected
    # Later turns took their prefix from a cache, some of it loaded from the CPU pool.
    summary = client_module.summarize(results)
    assert summary.hit_rate > 0
    assert summary.loaded_tokens > 0
    assert body["offloader"]["scheduler"]["loaded_blocks"] * BLOCK == summary.loaded_tokens
    # The server's own timings come back with each turn: a loaded turn waited for its load.
    assert all(0 < r.server_forward_s <= r.server_ttft_s for r in results)
    assert all(r.server_load_wait_s > 0 for r in results if r.loaded_tokens)
    # Several requests per step: 9 requests x 6 tokens take fewer steps one by one would.
    generated = sum(len(r.output_ids) for r in results)
    assert body["engine"]["steps"] < generated
    assert body["server"] == {
        "submitted": 9,
        "completed": 9,
        "aborted": 0,
        "failed": 0,
        "live": 0,
        "rejected": 0,
        # the turns' prompts by source and their miss reasons, as the answers said
        "prompt_tokens_by_source": {
            "gpu_cache": summary.gpu_cached_tokens,
            "cpu_pool": summary.loaded_tokens,
            "computed": summary.prompt_tokens - summary.gpu_cached_tokens - summary.loaded_tokens,
        },
        "miss_reasons": summary.miss_reasons,
    }
    assert sum(summary.miss_reasons.values()) == 9
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    loaded = families["kvoffload_scheduler_loaded_blocks"].samples[0].value
    assert loaded * BLOCK == summary.loaded_tokens
    ttft = families["kvoffload_server_ttft_seconds"]
    assert [s.value for s in ttft.samples if s.name.endswith("_count")] == [9.0]
    assert_whole(app)


async def test_a_client_that_disconnects_mid_stream_is_aborted() -> None:
    app = app_module.create_app(tiny_engine(num_gpu_blocks=160), offload_config())
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        body = {"prompt": list(range(40)), "max_tokens": 600, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen += len(json.loads(line[6:])["choices"][0]["token_ids"])
                if seen >= 2:
                    break  # leave mid-stream: the connection closes
        after = await until(client, lambda s: s["server"]["aborted"] == 1)
        assert after["server"]["completed"] == 0
        await until(client, lambda s: s["engine"]["running"] + s["engine"]["waiting"] == 0)
        # The server goes on serving.
        ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200
        assert len(ok.json()["choices"][0]["token_ids"]) == 3
    assert_whole(app)


async def test_a_client_that_gives_up_waiting_is_aborted() -> None:
    app = app_module.create_app(tiny_engine(num_gpu_blocks=160), offload_config())
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        body = {"prompt": list(range(40)), "max_tokens": 600}  # one JSON answer at the end
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=body, timeout=0.5)
        after = await until(client, lambda s: s["server"]["aborted"] == 1)
        assert after["server"]["completed"] == 0
        await until(client, lambda s: s["engine"]["running"] + s["engine"]["waiting"] == 0)
        # The server goes on serving.
        ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200
        assert len(ok.json()["choices"][0]["token_ids"]) == 3
    assert_whole(app)


async def test_a_request_that_fails_in_the_model_is_ended_cleanly() -> None:
    engine = tiny_engine()
    embed = engine._model.model.embed_tokens  # the test's own model

    def fail_on_marker(module: Any, args: tuple[Any, ...]) -> None:
        if bool((args[0] == MARKER).any()):
            raise RuntimeError("injected model failure")

    hook = embed.register_forward_pre_hook(fail_on_marker)
    app = app_module.create_app(engine, offload_config())
    try:
        async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
            bad = await client.post(
                "/v1/completions", json={"prompt": [1, 2, 3, MARKER, 5] * 4, "max_tokens": 4}
            )
            assert bad.status_code == 500
            assert "injected model failure" in bad.json()["error"]["message"]
            body = await stats(client)
            assert body["server"]["failed"] == 1
            ok = await client.post("/v1/completions", json={"prompt": [7] * 20, "max_tokens": 4})
            assert ok.status_code == 200
    finally:
        hook.remove()
    assert_whole(app)


async def test_shutdown_with_transfers_in_flight_leaves_the_offloader_whole() -> None:
    slow = CopyFaults(delay_s=0.3)  # every copy waits 0.3 s in the copy worker
    app = app_module.create_app(tiny_engine(num_gpu_blocks=160), offload_config(), copy_hook=slow)
    async with (
        serving(app, graceful_s=0.2) as (url, _server),
        httpx.AsyncClient(base_url=url) as client,
    ):
        done = await client.post(
            "/v1/completions", json={"prompt": list(range(60)), "max_tokens": 2}
        )
        assert done.status_code == 200
        # A streaming request still running when shutdown begins.
        body = {"prompt": list(range(100, 140)), "max_tokens": 500, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break
            assert (await stats(client))["offloader"]["scheduler"]["in_flight_transfers"] > 0
            # leaving `serving` shuts down with the stream open and copies in flight
    report = assert_whole(app)
    assert report.in_flight_at_shutdown > 0
    assert slow.calls > 0
    assert report.requests.completed == 1
    assert report.requests.aborted == 1  # the stream still open at shutdown


BAD_REQUESTS: list[tuple[Any, int, str, str | None]] = [
    ({"prompt": [1, 2], "temperature": 0.7}, 422, "temperature=0.7: only greedy", "temperature"),
    ({"prompt": [1, 2], "max_tokens": 0}, 422, "max_tokens", "max_tokens"),
    ({"prompt": [1, 999]}, 400, "token id 999 is outside the vocabulary [0, 256)", "prompt"),
    ({"prompt": []}, 422, "prompt", "prompt"),
    ({"prompt": [1, 2], "top_k": 3}, 422, "top_k: Extra inputs are not permitted", "top_k"),
    ({"prompt": [1, 2], "n": 2}, 422, "n: Input should be 1 (got 2)", "n"),
    ({"prompt": [[1, 2]]}, 422, "list of integer token ids, got [[1, 2]]", "prompt"),
    ({"prompt": [1, True]}, 422, "list of integer token ids", "prompt"),
    # session hints: a number of seconds in (0, one year], a non-empty session string
    (
        {"prompt": [1, 2], "retain_for_s": 0},
        422,
        "retain_for_s: Input should be greater",
        "retain_for_s",
    ),
    ({"prompt": [1, 2], "retain_for_s": -3.5}, 422, "(got -3.5)", "retain_for_s"),
    (
        {"prompt": [1, 2], "retain_for_s": 1e12},
        422,
        "retain_for_s: Input should be less",
        "retain_for_s",
    ),
    (
        {"prompt": [1, 2], "retain_for_s": "30"},
        422,
        "retain_for_s: Input should be a valid number",
        "retain_for_s",
    ),
    ({"prompt": [1, 2], "retain_for_s": True}, 422, "(got True)", "retain_for_s"),
    (
        {"prompt": [1, 2], "retain_for_s": 5, "session": [1]},
        422,
        "session: Input should be a valid string",
        "session",
    ),
    (
        {"prompt": [1, 2], "session": ""},
        422,
        "session: String should have at least 1 character",
        "session",
    ),
    # strict types: nothing is converted
    (
        {"prompt": [1, 2], "max_tokens": "5"},
        422,
        "max_tokens: Input should be a valid integer (got '5')",
        "max_tokens",
    ),
    (
        {"prompt": [1, 2], "max_tokens": True},
        422,
        "max_tokens: Input should be a valid integer (got True)",
        "max_tokens",
    ),
    (
        {"prompt": [1, 2], "max_tokens": 5.0},
        422,
        "max_tokens: Input should be a valid integer",
        "max_tokens",
    ),
    (
        {"prompt": [1, 2], "stream": "yes"},
        422,
        "stream: Input should be a valid boolean (got 'yes')",
        "stream",
    ),
    (
        {"prompt": [1, 2], "stream": 1},
        422,
        "stream: Input should be a valid boolean (got 1)",
        "stream",
    ),
    ({"prompt": [1, 2], "n": True}, 422, "n: Input should be a valid integer (got True)", "n"),
    ({"prompt": [1, 2], "model": 7}, 422, "model: Input should be a valid string (got 7)", "model"),
    (
        {"prompt": [1, 2], "max_tokens": 10_000},
        400,
        "needs 2501 blocks; the cache has 48 (a prompt of 2 tokens plus max_tokens=10000)",
        "max_tokens",
    ),
    ({}, 422, "prompt: Field required", "prompt"),
    ("not json", 400, "not a valid request", None),
    ("[1, 2]", 400, "not a valid request", None),
]


async def test_bad_requests_get_a_4xx_naming_the_field_and_value() -> None:
    app = app_module.create_app(tiny_engine(), offload_config())
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        for body, status, words, param in BAD_REQUESTS:
            content = body if isinstance(body, str) else json.dumps(body)
            response = await client.post("/v1/completions", content=content)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert words in error["message"], (body, error)
            assert error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error"
        body = await stats(client)
        assert body["server"]["rejected"] == len(BAD_REQUESTS)
        assert body["server"]["submitted"] == 0
    assert_whole(app)


async def test_a_completion_with_retain_for_s_retains_its_blocks_for_its_session() -> None:
    app = app_module.create_app(tiny_engine(), offload_config())
    now = [0.0]
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        off: KVOffloader = app.state.server.offloader
        off.hints.clock = lambda: now[0]
        prompt = list(range(1, 4 * BLOCK + 2))
        body = {"prompt": prompt, "max_tokens": 2, "retain_for_s": 30, "session": "agent-1"}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        await off.drain()
        off.store()  # blocks stored after the finish are retained at the next store()
        assert off.hints.sessions == ("agent-1",)
        assert off.hints.deadline("agent-1") == 30.0
        assert off.hints.release("agent-1") == 4  # the prompt's four full blocks
        plain = {"prompt": prompt, "max_tokens": 2}
        assert (await client.post("/v1/completions", json=plain)).status_code == 200
        await off.drain()
        off.store()
        assert off.hints.sessions == ()  # no hint, nothing retained
    assert_whole(app)


async def test_prefetch_brings_a_prompt_back_from_the_tier(tmp_path: Path) -> None:
    tier = {"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": "4MiB"}
    config = OffloadConfig(block_size=BLOCK, num_cpu_blocks=64, model_id="tiny-test", tiers=[tier])
    app = app_module.create_app(tiny_engine(), config)
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        off: KVOffloader = app.state.server.offloader
        prompt = list(range(1, 5 * BLOCK + 2))
        missing = await client.post("/v1/prefetch", json={"prompt": prompt})
        assert missing.json() == {"object": "prefetch", "cpu_blocks": 0, "cpu_tokens": 0}
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200, response.text
        await off.drain()
        assert off.tiers is not None
        for _ in range(500):  # the write-down to the tier
            stats = off.tiers.statistics()
            if stats.refs_held == 0 and stats.tiers[0].blocks_written >= 5:
                break
            await asyncio.sleep(0.01)
        assert await off.reset()  # the CPU pool forgets it; the tier keeps it
        hashes = off.hash_prompt(prompt)
        assert not off.pool.is_cached(hashes[0])
        answer = await client.post("/v1/prefetch", json={"prompt": prompt})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"object": "prefetch", "cpu_blocks": 5, "cpu_tokens": 5 * BLOCK}
        assert all(off.pool.is_cached(h) for h in hashes)
        bad = await client.post("/v1/prefetch", json={"prompt": [1], "max_tokens": 2})
        assert bad.status_code == 422
        assert bad.json()["error"]["param"] == "max_tokens"
    assert_whole(app)


async def test_text_prompts_go_through_the_byte_tokenizer() -> None:
    tokenizer = app_module.ByteTokenizer()
    assert tokenizer.encode("hé") == [104, 195, 169]
    assert tokenizer.decode([104, 195, 169, 300]) == "hé\ufffd"
    app = app_module.create_app(tiny_engine(), offload_config())
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        by_text = (
            await client.post("/v1/completions", json={"prompt": "hé!", "max_tokens": 4})
        ).json()
        by_ids = (
            await client.post(
                "/v1/completions", json={"prompt": [104, 195, 169, 33], "max_tokens": 4}
            )
        ).json()
    assert by_text["choices"][0]["token_ids"] == by_ids["choices"][0]["token_ids"]
    assert by_text["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
        # 4 tokens: one block, which holds the last token (never loaded)
        "kvoffload": {
            "gpu_cache": 0,
            "cpu_pool": 0,
            "tiers": {},
            "computed": 4,
            "miss_reason": "last_token",
        },
    }
    assert by_text["object"] == "text_completion"
    timings = by_text["kvoffload"]
    assert set(timings) >= {"ttft_s", "load_wait_s", "forward_s", "loaded_tokens"}
    assert 0 < timings["forward_s"] <= timings["ttft_s"] <= timings["total_s"]
    prompt_sources = ("gpu_cached_tokens", "loaded_tokens", "computed_tokens")
    assert sum(timings[k] for k in prompt_sources) == 4
    assert_whole(app)


@pytest.mark.slow
def test_the_command_line_serves_replays_and_shuts_down(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python examples/server/app.py`` in a subprocess, ``client.py`` against it, then
    Ctrl-C: the server exits 0 after reporting the offloader whole."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, str(SERVER / "app.py"), "--port", str(port)]
    argv += ["--block-size", "4", "--gpu-blocks", "48", "--cpu-blocks", "256"]
    env = {**os.environ, "KVOFFLOAD_EXAMPLE_QUICK": "1"}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # Wait until it answers or exits; a server that hangs is the per-test timeout's.
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"{url}/stats", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        argv = ["--url", url, "--conversations", "2", "--turns", "2", "--user-tokens", "20"]
        assert client_module.main([*argv, "--max-tokens", "3"]) == 0
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    printed = capsys.readouterr().out
    assert "requests: 4" in printed
    assert re.search(r"^hit rate: 0\.\d{3} \(from CPU: 0\.\d{3}\)$", printed, re.M), printed
    assert re.search(r"^TTFT p50 [\d.]+ ms, p90 [\d.]+ ms, p99 [\d.]+ ms$", printed, re.M)
    assert proc.returncode == 0, out
    assert "shutdown: engine and offloader whole" in out
    assert "requests: 4 completed, 0 aborted, 0 failed" in out


def _start_server(*extra: str) -> tuple[subprocess.Popen[str], str]:
    """``python examples/server/app.py`` on a free port, once it answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, str(SERVER / "app.py"), "--port", str(port), *extra]
    env = {**os.environ, "KVOFFLOAD_EXAMPLE_QUICK": "1"}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    while True:  # a server that hangs is the per-test timeout's
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(f"{url}/stats", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
def test_ctrl_c_with_requests_open_shuts_down_quietly(signals: int) -> None:
    """Ctrl-C while requests run past the grace period (or a second Ctrl-C, at once):
    the server ends them itself (a 503, a stream's error event), logs one line, prints no
    traceback and exits 0 with a whole offloader. uvicorn cancelled them and logged each
    with a traceback."""
    # 8,000 tokens to generate: no CPU computes them within the 5 s grace period.
    proc, url = _start_server("--block-size", "4", "--gpu-blocks", "2048", "--cpu-blocks", "64")
    body = {"prompt": "hello", "max_tokens": 8000}
    answers: dict[str, Any] = {}

    def plain() -> None:
        answers["plain"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    waiter = threading.Thread(target=plain)
    sent = 0
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            assert '"token_ids"' in first  # running: its first token came
            waiter.start()
            while "plain" not in answers and _live(url) < 2:
                time.sleep(0.05)
            for _ in range(signals):
                proc.send_signal(signal.SIGINT)
                sent += 1
                time.sleep(0.3)
            rest = [line for line in lines if line]
    finally:
        if not sent:
            proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
        if waiter.is_alive():
            waiter.join(timeout=60)
    assert "Traceback" not in out, out
    assert "Exception in ASGI application" not in out, out
    assert proc.returncode == 0, out
    assert "Shutting down" in out
    assert re.search(r"shutting down: ending 2 open request\(s\), ", out), out
    assert "shutdown: engine and offloader whole" in out
    assert "requests: 0 completed, 2 aborted, 0 failed" in out
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["message"]
    assert answers["plain"].status_code == 503
    assert answers["plain"].json()["error"]["type"] == "server_error"


def _live(url: str) -> int:
    """Requests the server is working on."""
    return int(httpx.get(f"{url}/stats", timeout=5).json()["server"]["live"])


async def test_without_offload_the_same_answers_come_back() -> None:
    """``create_app(engine, None)`` serves without kvoffload (``--no-offload``)."""
    prompt = {"prompt": list(range(30)), "max_tokens": 5}
    answers = []
    for config in (offload_config(), None):
        app = app_module.create_app(tiny_engine(), config)
        async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
            answers.append((await client.post("/v1/completions", json=prompt)).json())
            body = await stats(client)
            assert (body["offloader"] is None) == (config is None)
            metrics = (await client.get("/metrics")).text
            assert ("kvoffload_scheduler_lookups_total" in metrics) == (config is not None)
        assert_whole(app)
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"]


async def test_cancelling_the_step_loop_aborts_every_request_it_holds() -> None:
    """The loop's own shutdown path, for requests whose handlers are still waiting."""
    engine = tiny_engine(num_gpu_blocks=160)
    async with KVOffloader(
        offload_config(), engine.kv, layout=engine.layout, pinner=engine.pinner
    ) as off:
        engine.attach(off)
        loop = app_module.EngineLoop(engine)
        ends: list[Any] = []

        async def client(prompt: list[int]) -> None:
            async with loop.submit(prompt, 500) as events:
                ends.extend([e async for e in events if not isinstance(e, int)])

        async with anyio.create_task_group() as clients, anyio.create_task_group() as tg:
            await tg.start(loop.run)
            clients.start_soon(client, list(range(40)))
            clients.start_soon(client, list(range(50, 90)))
            while engine.statistics().steps < 3:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # as the lifespan does at shutdown
        in_flight = off.statistics().scheduler.in_flight_transfers
    engine.attach(None)
    report = app_module.ShutdownReport.check(off, loop, in_flight)
    assert report.whole, report.describe()
    assert report.requests.aborted == 2
    assert report.requests.completed == 0
    assert all(r.finish_reason == "aborted" for r in ends)
    with pytest.raises(app_module.ServerClosed):
        async with loop.submit([1, 2, 3], 2):
            pass


async def test_a_client_that_leaves_while_its_prefix_loads_is_aborted() -> None:
    """Abort with a CPU-to-GPU load in flight: the blocks stay pinned until the copy ends,
    then everything comes back."""
    slow = CopyFaults(delay_s=0.4)
    engine = PagedEngine(
        tiny_model(), num_gpu_blocks=160, block_size=BLOCK, enable_prefix_caching=False
    )
    app = app_module.create_app(engine, offload_config(), copy_hook=slow)
    prompt = list(range(40))
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        first = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert first.status_code == 200
        await until(client, lambda s: s["offloader"]["scheduler"]["in_flight_transfers"] == 0)
        body = {"prompt": [*prompt, 7, 7, 7, 7], "max_tokens": 50}
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=body, timeout=0.2)
        after = await until(client, lambda s: s["server"]["aborted"] == 1)
        assert after["offloader"]["scheduler"]["load_plans"] == 1  # it was loading
        await until(client, lambda s: s["offloader"]["scheduler"]["in_flight_transfers"] == 0)
        assert (await stats(client))["offloader"]["scheduler"]["loaded_blocks"] == 10
    assert_whole(app)


class Records(logging.Handler):
    """Collects what a logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@asynccontextmanager
async def server_log() -> AsyncIterator[Records]:
    """What the server logs (uvicorn's error log, where the example writes); enter it
    after `serving`, whose logging configuration replaces the handlers."""
    logger = logging.getLogger("uvicorn.error")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_a_client_that_leaves_mid_body_is_logged_in_one_line() -> None:
    app = app_module.create_app(tiny_engine(), offload_config())
    async with serving(app) as (url, _server), server_log() as log:
        logging.getLogger("uvicorn.error").setLevel(logging.INFO)  # serving() set WARNING
        host, port = url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n"
        )
        writer.write(head.encode() + b'{"prompt": [1, 2,')
        await writer.drain()
        writer.close()  # gone, 983 bytes short
        await writer.wait_closed()
        for _ in range(300):
            if any("left before sending" in r.getMessage() for r in log.records):
                break
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=url) as client:  # still serving
            ok = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert ok.status_code == 200
            assert (await stats(client))["server"]["submitted"] == 1
    left = [r for r in log.records if "left before sending" in r.getMessage()]
    assert len(left) == 1
    assert "\n" not in left[0].getMessage()
    assert left[0].levelno == logging.INFO
    assert not [r for r in log.records if r.exc_info or r.levelno >= logging.ERROR]
    assert_whole(app)


async def test_a_step_loop_that_fails_stops_the_server_and_says_why() -> None:
    engine = tiny_engine(num_gpu_blocks=160)
    app = app_module.create_app(engine, offload_config())
    real_step = engine.step

    async def step() -> Any:
        if engine.statistics().steps >= 3:
            try:
                raise KeyError("the cause")
            except KeyError as cause:
                raise RuntimeError("step exploded") from cause
        return await real_step()

    engine.step = step  # type: ignore[method-assign]
    async with serving(app) as (url, server), server_log() as log:
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"prompt": list(range(30)), "max_tokens": 100}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 503
            message = response.json()["error"]["message"]
            assert "step loop failed (RuntimeError('step exploded'))" in message
        for _ in range(300):  # the server stops by itself: no zombie answering 503
            if server.should_exit:
                break
            await asyncio.sleep(0.01)
        assert server.should_exit
    state = app.state.server
    assert isinstance(state.failure, RuntimeError)
    assert state.report is not None  # the lifespan's shutdown ran
    assert state.report.requests.aborted == 1
    (failed,) = [r for r in log.records if r.levelno >= logging.ERROR]
    assert "the step loop failed" in failed.getMessage()
    assert failed.exc_info is not None
    error = failed.exc_info[1]
    assert isinstance(error, RuntimeError)
    assert isinstance(error.__cause__, KeyError)  # the traceback shows the cause


def test_the_command_line_refuses_a_thread_count_below_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        app_module.main(["--threads", "0"])
    assert exit_info.value.code == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


async def test_a_load_past_its_deadline_is_recomputed_with_the_same_answer() -> None:
    """``--load-deadline-s 0`` with copies held back: the second request's load is
    abandoned, its tokens recomputed, and the answer is the first one's."""
    gate = threading.Event()
    hook = CopyFaults(gate=gate)
    gate.set()
    engine = PagedEngine(
        tiny_model(),
        num_gpu_blocks=160,
        block_size=BLOCK,
        enable_prefix_caching=False,
        load_deadline_s=0,
    )
    app = app_module.create_app(engine, offload_config(), copy_hook=hook)
    prompt = {"prompt": list(range(40)), "max_tokens": 5}
    try:
        async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
            first = (await client.post("/v1/completions", json=prompt)).json()
            await until(client, lambda s: s["offloader"]["scheduler"]["in_flight_transfers"] == 0)
            gate.clear()  # every copy from now on waits: the load misses its deadline
            again = (await client.post("/v1/completions", json=prompt)).json()
            body = await stats(client)
            assert body["engine"]["abandoned_loads"] == 1
            assert body["offloader"]["scheduler"]["abandoned_loads"] == 1
            assert body["engine"]["loaded_tokens"] == 0
            gate.set()
            await until(client, lambda s: s["offloader"]["scheduler"]["in_flight_transfers"] == 0)
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    finally:
        gate.set()
    assert_whole(app)


def test_the_command_line_refuses_a_negative_load_deadline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        app_module.main(["--load-deadline-s", "-1"])
    assert exit_info.value.code == 2
    assert "--load-deadline-s must be >= 0, got -1.0" in capsys.readouterr().err


async def test_usage_and_stats_say_where_each_prompt_token_came_from(tmp_path: Path) -> None:
    """Each completion's usage names its cached tokens by source and its miss reason,
    and /stats adds them up: checked against what this test expects of each request."""
    tier = {"kind": "disk", "name": "d", "path": str(tmp_path / "kv.bin"), "capacity_bytes": "4MiB"}
    config = OffloadConfig(block_size=BLOCK, num_cpu_blocks=64, model_id="tiny-test", tiers=[tier])
    # 12 GPU blocks: a 45-token prompt takes them all, evicting every other prompt's.
    app = app_module.create_app(tiny_engine(num_gpu_blocks=12), config)
    prompt = list(range(1, 5 * BLOCK + 2))  # 21 tokens: 5 full blocks and one token
    fillers = [list(range(100 + 50 * i, 145 + 50 * i)) for i in range(2)]
    expected_total = {"gpu_cache": 0, "cpu_pool": 0, "d": 0, "computed": 0}
    reasons: dict[str, int] = {}
    async with serving(app) as (url, _server), httpx.AsyncClient(base_url=url) as client:
        off: KVOffloader = app.state.server.offloader

        async def complete(tokens: list[int], want: dict[str, Any]) -> None:
            response = await client.post(
                "/v1/completions", json={"prompt": tokens, "max_tokens": 2}
            )
            assert response.status_code == 200, response.text
            body = response.json()
            usage = body["usage"]
            cached = want["gpu_cache"] + want["cpu_pool"] + want["d"]
            assert usage["prompt_tokens"] == len(tokens)
            assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
            tiers = {"d": {"kind": "disk", "tokens": want["d"]}} if want["d"] else {}
            breakdown = {
                "gpu_cache": want["gpu_cache"],
                "cpu_pool": want["cpu_pool"],
                "tiers": tiers,
                "computed": len(tokens) - cached,
                "miss_reason": want["reason"],
            }
            assert usage["kvoffload"] == breakdown
            assert body["kvoffload"]["cached_tokens_by_source"] == breakdown
            assert body["kvoffload"]["miss_reason"] == want["reason"]
            for source in ("gpu_cache", "cpu_pool", "d"):
                expected_total[source] += want[source]
            expected_total["computed"] += len(tokens) - cached
            reasons[want["reason"]] = reasons.get(want["reason"], 0) + 1

        async def written_down() -> None:
            await off.drain()
            assert off.tiers is not None
            for _ in range(500):
                tier_stats = off.tiers.statistics()
                if tier_stats.refs_held == 0 and not tier_stats.tiers[0].writes_held:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the write-down did not end")

        nothing = {"gpu_cache": 0, "cpu_pool": 0, "d": 0}
        await complete(prompt, {**nothing, "reason": "never_stored"})
        await complete(fillers[0], {**nothing, "reason": "never_stored"})
        # The GPU cache lost the prompt; the CPU pool has its 5 blocks (the last token
        # is computed: the hit stops at the whole blocks, a boundary).
        await complete(prompt, {**nothing, "cpu_pool": 20, "reason": "boundary"})
        await complete(prompt, {**nothing, "gpu_cache": 20, "reason": "boundary"})
        await complete(fillers[1], {**nothing, "reason": "never_stored"})
        await written_down()
        assert await off.reset()  # the CPU pool forgets it; the disk tier keeps it
        await complete(prompt, {**nothing, "d": 20, "reason": "boundary"})

        body = await stats(client)
        assert body["prompt_tokens"] == {
            "gpu_cache": expected_total["gpu_cache"],
            "cpu_pool": expected_total["cpu_pool"],
            "tiers": {"d": {"kind": "disk", "tokens": expected_total["d"]}},
            "computed": expected_total["computed"],
        }
        # /metrics splits the prompt tokens into the same sources, a series per tier.
        metrics = (await client.get("/metrics")).text
        (family,) = (
            f
            for f in text_string_to_metric_families(metrics)
            if f.name == "kvoffload_server_prompt_tokens"
        )
        assert {
            (x.labels["source"], x.labels["tier"]): x.value
            for x in family.samples
            if x.name.endswith("_total")
        } == {
            ("gpu_cache", ""): expected_total["gpu_cache"],
            ("cpu_pool", ""): expected_total["cpu_pool"],
            ("tier", "d"): expected_total["d"],
            ("computed", ""): expected_total["computed"],
        }
        assert body["requests_by_miss_reason"] == reasons
        engine = body["engine"]
        assert engine["tier_loaded_tokens"] == {"d": 20}
        assert engine["loaded_tokens"] == 40
        # The offloader counts every lookup (a request asked again while its tier
        # promotion ran counts again): each reason seen here is among them.
        by_reason = body["lookup_misses"]["by_reason"]
        assert set(reasons) - {"none"} <= set(by_reason)
        assert "by_group" not in body["lookup_misses"]
    assert_whole(app)

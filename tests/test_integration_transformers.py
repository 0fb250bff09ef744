"""kvoffload.integrations.transformers: the paged engine over a random Llama, with offload."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

from kvoffload import BlockStateError, ConfigError, HostKVBuffer, KVOffloader, OffloadConfig
from kvoffload.testing import ControllableCopyEngine

transformers = pytest.importorskip("transformers")

from kvoffload.integrations.transformers import (  # noqa: E402
    GenerationResult,
    GpuBlockAllocator,
    PagedEngine,
)

pytestmark = pytest.mark.anyio

BS = 8
VOCAB = 300


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def llama(seed: int = 0) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=2048,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> Any:
    return llama()


@pytest.fixture(scope="module")
def reference_model() -> Any:
    return llama()  # the same weights, the stock attention


def reference(model: Any, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy tokens from the stock model, recomputing everything each step."""
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length + 3 * i,), generator=gen).tolist() for i in range(n)]


def config(num_cpu_blocks: int = 256) -> OffloadConfig:
    return OffloadConfig(block_size=BS, num_cpu_blocks=num_cpu_blocks, model_id="test-llama")


async def test_batched_requests_match_the_stock_model(model: Any, reference_model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=64, block_size=BS, max_batch_tokens=24)
    ps = prompts(3, 20)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, max_new_tokens=4)
    batch_sizes: list[int] = []
    results: dict[str, GenerationResult] = {}
    while engine.has_work:
        outs = await engine.step()
        batch_sizes.append(sum(o.token_id is not None for o in outs))
        results.update({o.request_id: o.result for o in outs if o.result is not None})
    assert max(batch_sizes) == 3  # several requests decoded in one step
    for i, p in enumerate(ps):
        assert results[f"r{i}"].output_token_ids == reference(reference_model, p, 4)
        assert results[f"r{i}"].finish_reason == "length"
    stats = engine.statistics()
    assert stats.running == stats.waiting == 0
    assert stats.allocator.num_used == 0
    engine.allocator.check_invariants()


async def test_offload_loads_evicted_turns_and_tokens_equal_a_recompute(
    model: Any, reference_model: Any
) -> None:
    # A GPU cache that holds one request: every other conversation is evicted from it.
    engine = PagedEngine(model, num_gpu_blocks=16, block_size=BS, max_batch_tokens=64)
    convs = prompts(3, 40, seed=2)
    async with KVOffloader(config(), engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        loaded = 0
        for turn in range(3):
            for c in range(len(convs)):
                conv = convs[c]
                conv += [(7 * turn + c + k) % VOCAB for k in range(5)]
                engine.add_request(f"c{c}t{turn}", conv, max_new_tokens=6)
                (res,) = await engine.run_until_done()
                assert res.output_token_ids == reference(reference_model, conv, 6), (c, turn)
                assert res.computed_tokens + res.gpu_cached_tokens + res.loaded_tokens == len(conv)
                loaded += res.loaded_tokens
                assert res.forward_s > 0
                assert res.ttft_s is not None
                assert res.ttft_s >= res.forward_s + res.load_wait_s
                if res.loaded_tokens:
                    assert res.load_wait_s > 0
                if turn:
                    # the previous turn and its answer come from a cache, not recompute
                    assert res.computed_tokens <= 5 + 6 + BS
                conv += res.output_token_ids
        await off.drain()
        assert loaded > 0
        assert off.statistics().scheduler.loaded_blocks * BS == loaded
        assert off.statistics().scheduler.live_requests == 0
        off.scheduler.check_invariants()
        assert engine.pinner.num_pinned == 0
    engine.allocator.check_invariants()
    assert engine.allocator.statistics().num_held == 0


async def test_preemption_keeps_tokens_right(model: Any, reference_model: Any) -> None:
    # Room for the prompts but not for every answer at once: someone gets preempted.
    engine = PagedEngine(model, num_gpu_blocks=10, block_size=BS, max_batch_tokens=64)
    ps = prompts(3, 12, seed=3)
    async with KVOffloader(config(), engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, max_new_tokens=14)
        results = {r.request_id: r for r in await engine.run_until_done()}
        await off.drain()
        off.scheduler.check_invariants()
    assert engine.statistics().preemptions > 0
    for i, p in enumerate(ps):
        assert results[f"r{i}"].output_token_ids == reference(reference_model, p, 14)
    engine.allocator.check_invariants()
    assert engine.allocator.statistics().num_used == 0


async def test_abort_and_a_failing_step_leave_nothing_behind(model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=32, block_size=BS)
    async with KVOffloader(config(), engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        engine.add_request("a", prompts(1, 30)[0], max_new_tokens=50)
        engine.add_request("b", prompts(1, 20, seed=9)[0], max_new_tokens=50)
        await engine.step()
        res = engine.abort("a")
        assert res is not None
        assert res.finish_reason == "aborted"
        assert engine.abort("nobody") is None

        def boom(*args: object, **kwargs: object) -> None:
            raise RuntimeError("model exploded")

        real = engine._pass.run
        engine._pass.run = boom  # type: ignore[method-assign,assignment]
        outs = await engine.step()
        engine._pass.run = real  # type: ignore[method-assign]
        (failed,) = [o.result for o in outs if o.result is not None]
        assert failed.request_id == "b"
        assert failed.finish_reason == "error"
        assert "model exploded" in (failed.error or "")
        assert not engine.has_work
        # The engine keeps serving after a failed step.
        engine.add_request("c", prompts(1, 20, seed=9)[0], max_new_tokens=2)
        (ok,) = await engine.run_until_done()
        assert ok.finish_reason == "length"
        await off.drain()
        assert off.statistics().scheduler.live_requests == 0
        assert off.pool.statistics().num_free == off.pool.num_blocks
        off.scheduler.check_invariants()
    engine.allocator.check_invariants()
    assert engine.allocator.statistics().num_used == 0


async def test_an_id_whose_copies_are_in_flight_is_refused(model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=32, block_size=BS)
    copies = ControllableCopyEngine()  # stores end only when the test says so
    async with KVOffloader(
        config(), engine.kv, layout=engine.layout, pinner=engine.pinner, copy_engine=copies
    ) as off:
        engine.attach(off)
        engine.add_request("a", prompts(1, 30)[0], max_new_tokens=1)
        await engine.run_until_done()
        assert copies.pending  # a's stores are still in flight
        assert engine.pinner.num_pinned > 0
        with pytest.raises(ValueError, match="still copies blocks"):
            engine.add_request("a", [1, 2, 3], max_new_tokens=1)
        copies.complete_all()
        await off.drain()
        assert engine.pinner.num_pinned == 0
        engine.add_request("b", [1, 2, 3], max_new_tokens=1)
        (res,) = await engine.run_until_done()
        assert res.finish_reason == "length"
        copies.complete_all()


async def test_cancelling_a_step_ends_its_requests(model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=32, block_size=BS)
    async with KVOffloader(config(), engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        engine.add_request("a", prompts(1, 30)[0], max_new_tokens=50)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await engine.step()
        assert not engine.has_work
        await off.drain()
        assert off.statistics().scheduler.live_requests == 0
    engine.allocator.check_invariants()
    assert engine.allocator.statistics().num_used == 0


def test_bad_requests_are_refused(model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match=r"token id 300 is outside the vocabulary \[0, 300\)"):
        engine.add_request("a", [1, 300], max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("a", [], max_new_tokens=1)
    with pytest.raises(ValueError, match="needs 5 blocks; the cache has 4"):
        engine.add_request("a", [1] * 30, max_new_tokens=10)
    with pytest.raises(ValueError, match=r"request 'a': retain_for_s must be .*, got 0"):
        engine.add_request("a", [1, 2], max_new_tokens=1, retain_for_s=0)
    with pytest.raises(TypeError, match=r"session=\[1\] must be hashable"):
        engine.add_request("a", [1, 2], max_new_tokens=1, retain_for_s=5.0, session=[1])
    engine.add_request("a", [1, 2], max_new_tokens=1)
    with pytest.raises(ValueError, match="'a' is in use"):
        engine.add_request("a", [1, 2], max_new_tokens=1)


def test_unsupported_architectures_are_refused() -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        PagedEngine(model, num_gpu_blocks=4)


async def test_an_offloader_with_another_layout_is_refused(model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=8, block_size=BS)
    other = PagedEngine(model, num_gpu_blocks=8, block_size=2 * BS)
    cfg = OffloadConfig(block_size=2 * BS, num_cpu_blocks=8)
    async with KVOffloader(cfg, other.kv, layout=other.layout) as off:
        with pytest.raises(ConfigError, match="layout"):
            engine.attach(off)


def test_allocator_prefix_cache_lru_and_pins() -> None:
    alloc = GpuBlockAllocator(4)
    h = [bytes([i]) * 32 for i in range(4)]
    a = alloc.allocate(2)
    assert a is not None
    for hh, b in zip(h, a, strict=False):
        alloc.cache(hh, b)  # type: ignore[arg-type]
    alloc.pinner.pin([a[1]])  # a store still reads it
    alloc.free(a)
    assert alloc.statistics().num_held == 1
    assert alloc.match(h, 4) == a  # a prefix hit takes both back, pinned or not
    alloc.free(a)
    b = alloc.allocate(3)  # the held block is not handed out
    assert b is not None
    assert a[1] not in b
    assert alloc.allocate(1) is None
    alloc.pinner.unpin([a[1]])  # the hook makes it free
    c = alloc.allocate(1)
    assert c == [a[1]]
    assert alloc.match(h, 4) == []  # both cached blocks were handed out: evicted
    assert alloc.statistics().evicted_blocks == 2
    alloc.check_invariants()


def test_import_without_the_extra_names_it() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvoffload\n"
        "try:\n"
        "    import kvoffload.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "from a kvoffload clone, pip install '.[transformers]'" in out


def test_the_core_never_imports_integrations() -> None:
    code = (
        "import kvoffload, sys\n"
        "print(any(m.startswith('kvoffload.integrations') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("stage", ["queued", "loading", "prefilling", "decoding"])
async def test_abort_at_every_stage_releases_everything(model: Any, stage: str) -> None:
    # Room for one request on the GPU: the second prompt evicts the first from it.
    engine = PagedEngine(model, num_gpu_blocks=12, block_size=BS, max_batch_tokens=16)
    base = prompts(1, 40, seed=5)[0]
    async with KVOffloader(config(), engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        engine.add_request("warm", base, max_new_tokens=2)
        await engine.run_until_done()
        engine.add_request("other", prompts(1, 80, seed=6)[0], max_new_tokens=2)
        await engine.run_until_done()
        await off.drain()
        stored = off.statistics().scheduler.stored_blocks
        engine.add_request("x", [*base, *range(1, 31)], max_new_tokens=8)
        ended: list[GenerationResult | None] = []
        if stage == "queued":
            ended.append(engine.abort("x"))
        elif stage == "loading":
            real = engine._batch.await_loads

            async def abort_while_loading() -> None:
                assert any(r.load_task is not None for r in engine._batch.running)
                ended.append(engine.abort("x"))  # a client leaving mid-load
                await real()

            engine._batch.await_loads = abort_while_loading  # type: ignore[method-assign]
            outs = await engine.step()
            ended.extend(o.result for o in outs if o.result is not None)
        else:
            while True:
                await engine.step()
                (r,) = engine._batch.running
                if stage == "prefilling" or r.result.output_token_ids:
                    break
            assert (r.num_computed < len(r.tokens) - 1) == (stage == "prefilling")
            ended.append(engine.abort("x"))
        results = [r for r in ended if r is not None]
        assert [r.finish_reason for r in results] == ["aborted"]
        assert not engine.has_work
        await off.drain()
        stats = off.statistics()
        assert stats.scheduler.live_requests == 0
        assert stats.pool.num_free == stats.pool.num_blocks
        if stage == "queued":
            assert stats.scheduler.stored_blocks == stored  # it never ran: nothing stored
        off.scheduler.check_invariants()
        assert engine.pinner.num_pinned == 0
    engine.allocator.check_invariants()
    assert engine.allocator.statistics().num_used == 0


def crowded_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (150,), generator=gen).tolist() for _ in range(8)]


async def run_crowd(engine: PagedEngine, *, check_every_step: bool) -> dict[str, list[int]]:
    for i, p in enumerate(crowded_prompts()):
        engine.add_request(f"r{i}", p, max_new_tokens=60)
    results: dict[str, list[int]] = {}
    streamed: dict[str, list[int]] = {}
    while engine.has_work:
        for out in await engine.step():
            if out.token_id is not None:
                streamed.setdefault(out.request_id, []).append(out.token_id)
            if out.result is not None:
                assert out.result.finish_reason == "length", out.result
                results[out.request_id] = out.result.output_token_ids
        if check_every_step:
            engine.check_invariants()  # every GPU block counted once, waiting ones hold none
    assert streamed == results  # every step delivered its outputs
    return results


@pytest.fixture(scope="module")
def crowd_reference(model: Any) -> dict[str, list[int]]:
    async def ample() -> dict[str, list[int]]:
        # Room for every request at once: nobody is preempted.
        engine = PagedEngine(model, num_gpu_blocks=256, block_size=16, max_batch_tokens=64)
        out = await run_crowd(engine, check_every_step=False)
        assert engine.statistics().preemptions == 0
        return out

    return anyio.run(ample)


@pytest.mark.parametrize("offload", [False, True])
async def test_a_request_preempted_while_scheduling_is_not_scheduled(
    model: Any, crowd_reference: dict[str, list[int]], offload: bool
) -> None:
    # Eight 150-token prompts answering 60 tokens on 64 blocks of 16, 64 tokens a step: a
    # request that grows preempts one that the same scheduling loop would reach later.
    engine = PagedEngine(model, num_gpu_blocks=64, block_size=16, max_batch_tokens=64)
    if offload:
        cfg = OffloadConfig(block_size=16, num_cpu_blocks=256, model_id="test-llama")
        async with KVOffloader(cfg, engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
            engine.attach(off)
            results = await run_crowd(engine, check_every_step=True)
            await off.drain()
            assert off.statistics().scheduler.live_requests == 0
            off.scheduler.check_invariants()
    else:
        results = await run_crowd(engine, check_every_step=True)
    assert engine.statistics().preemptions > 0
    assert results == crowd_reference
    engine.check_invariants()
    stats = engine.allocator.statistics()
    assert stats.num_used == stats.num_held == 0
    assert stats.num_free == stats.num_blocks


def test_engine_invariants_catch_a_waiting_request_that_holds_blocks(model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=8, block_size=BS)
    engine.add_request("a", [1, 2, 3], max_new_tokens=1)
    engine.check_invariants()
    (r,) = engine._batch.waiting
    r.table = engine.allocator.allocate(1) or []  # what the scheduling bug left behind
    with pytest.raises(BlockStateError, match=r"GPU block \d+: 1 references in the allocator"):
        engine.check_invariants()


class UnpinRaisesOnce:
    """The engine's pinner, whose ``unpin`` raises once (after unpinning) when armed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = False

    def pin(self, ids: Sequence[int]) -> None:
        self.inner.pin(ids)

    def unpin(self, ids: Sequence[int]) -> None:
        self.inner.unpin(ids)
        if self.armed:
            self.armed = False
            raise RuntimeError("unpin exploded")


@pytest.mark.parametrize("how", ["abort", "failed_step"])
async def test_a_finish_that_raises_leaves_the_engine_whole(model: Any, how: str) -> None:
    engine = PagedEngine(model, num_gpu_blocks=32, block_size=BS)
    pinner = UnpinRaisesOnce(engine.pinner)
    copies = ControllableCopyEngine()
    async with KVOffloader(
        config(), engine.kv, layout=engine.layout, pinner=pinner, copy_engine=copies
    ) as off:
        engine.attach(off)
        engine.add_request("a", prompts(1, 30)[0], max_new_tokens=1)
        await engine.run_until_done()
        engine.add_request("b", prompts(1, 20, seed=9)[0], max_new_tokens=50)
        await engine.step()  # b runs
        pinner.armed = True
        copies.complete_all()  # a completion's unpin raises: the next call on kvoffload says so
        await off.drain()
        assert not pinner.armed
        if how == "abort":
            res = engine.abort("b")  # ending b is the first call on kvoffload: finish raises
            assert res is not None
            assert res.finish_reason == "aborted"
        else:

            def boom(*args: object, **kwargs: object) -> None:
                raise RuntimeError("model exploded")

            real = engine._pass.run
            engine._pass.run = boom  # type: ignore[method-assign,assignment]
            outs = await engine.step()  # ends b after its failed pass: finish raises
            engine._pass.run = real  # type: ignore[method-assign]
            (res,) = [o.result for o in outs if o.result is not None]
            assert res.finish_reason == "error"
            assert "model exploded" in (res.error or "")
        assert res.request_id == "b"
        assert "kvoffload finish failed: PinnerError" in (res.error or "")
        assert "unpin exploded" in (res.error or "")
        assert engine.statistics().finish_errors == 1
        # The engine let go of b: its blocks, its place, its id.
        assert not engine.has_work
        assert "b" not in engine._batch.ids
        engine.check_invariants()
        # ... and keeps serving.
        engine.add_request("c", prompts(1, 20, seed=9)[0], max_new_tokens=2)
        (ok,) = await engine.run_until_done()
        assert ok.finish_reason == "length"
        assert ok.error is None
        copies.complete_all()
        await off.drain()
        copies.complete_all()
        off.scheduler.check_invariants()
    engine.check_invariants()
    assert engine.pinner.num_pinned == 0
    assert engine.allocator.statistics().num_used == 0


def surface_pinner_error_at(off: KVOffloader, call: str, nth: int, pinner: UnpinRaisesOnce) -> Any:
    """Make the ``nth`` call of ``off.<call>`` the one that surfaces a once-only PinnerError.

    Right before that call, the pinner's ``unpin`` raises the way it does inside a
    completion (`TransferLauncher` ends a completion in ``_unpin``), so the offloader's next
    step-loop call, this one, raises `PinnerError` once. Returns what records the calls.
    """
    real = getattr(off, call)
    seen = {"calls": 0, "fired": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen["calls"] += 1
        if seen["calls"] == nth:
            seen["fired"] += 1
            pinner.armed = True
            off._life.launcher._unpin(
                "g0", [], None
            )  # what a completion does when its unpin raises
            assert not pinner.armed
        return real(*args, **kwargs)

    setattr(off, call, wrapper)
    return seen


# The offloader's call, and the engine's name for it in a result's error.
SURFACES = {
    "request": "request",
    "lookup": "lookup",
    "load": "load",
    "release": "release",
    "preempt": "preempt",
    "update": "advance",
    "store": "store",
}


@pytest.mark.parametrize("call", sorted(SURFACES))
async def test_a_pinner_error_from_any_step_call_leaves_the_engine_whole(
    model: Any, crowd_reference: dict[str, list[int]], call: str
) -> None:
    # The crowd of the preemption test makes every call below during its steps.
    engine = PagedEngine(model, num_gpu_blocks=64, block_size=16, max_batch_tokens=64)
    pinner = UnpinRaisesOnce(engine.pinner)
    cfg = OffloadConfig(block_size=16, num_cpu_blocks=256, model_id="test-llama")
    async with KVOffloader(cfg, engine.kv, layout=engine.layout, pinner=pinner) as off:
        engine.attach(off)
        seen = surface_pinner_error_at(off, call, 2, pinner)
        # every step's outputs arrive, every request ends right, every step leaves the
        # engine whole (run_crowd checks the invariants after each)
        results = await run_crowd(engine, check_every_step=True)
        assert seen["fired"] == 1
        assert results == crowd_reference
        stats = engine.statistics()
        assert stats.pinner_errors == 1
        assert stats.failed_loads == 0  # the load was made again, and it loaded
        await off.drain()
        assert off.statistics().scheduler.live_requests == 0
        off.scheduler.check_invariants()
    engine.check_invariants()
    assert engine.pinner.num_pinned == 0
    assert engine.allocator.statistics().num_used == 0


@pytest.mark.parametrize("call", sorted(SURFACES))
async def test_the_request_whose_call_surfaced_a_pinner_error_names_it(
    model: Any, call: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = PagedEngine(model, num_gpu_blocks=64, block_size=16, max_batch_tokens=64)
    pinner = UnpinRaisesOnce(engine.pinner)
    cfg = OffloadConfig(block_size=16, num_cpu_blocks=256, model_id="test-llama")
    async with KVOffloader(cfg, engine.kv, layout=engine.layout, pinner=pinner) as off:
        engine.attach(off)
        surface_pinner_error_at(off, call, 2, pinner)
        for i, p in enumerate(crowded_prompts()):
            engine.add_request(f"r{i}", p, max_new_tokens=60)
        with caplog.at_level("WARNING", logger="kvoffload"):
            results = await engine.run_until_done()
        errors = [r.error for r in results if r.error is not None]
        if call == "store":  # no request's call: the step's results are what it owes
            assert errors == []
        else:
            (error,) = errors
            assert f"kvoffload {SURFACES[call]} raised PinnerError" in error
            assert "unpin exploded" in error
        assert all(r.finish_reason == "length" for r in results)
        assert len(results) == 8
        (logged,) = [r for r in caplog.records if "offload_call_failed" in r.getMessage()]
        assert f"call={SURFACES[call]}" in logged.getMessage()
        assert "unpin exploded" in logged.getMessage()  # the cause
        await off.drain()
        off.scheduler.check_invariants()
    engine.check_invariants()


class PinRaises:
    """The engine's pinner, whose ``pin`` raises ``failures`` more times."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failures = 0

    def pin(self, ids: Sequence[int]) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("pin exploded")
        self.inner.pin(ids)

    def unpin(self, ids: Sequence[int]) -> None:
        self.inner.unpin(ids)


@pytest.mark.parametrize("call", ["load", "store"])
async def test_a_pin_that_keeps_raising_gives_up_the_transfer_not_the_step(
    model: Any, crowd_reference: dict[str, list[int]], call: str
) -> None:
    engine = PagedEngine(model, num_gpu_blocks=64, block_size=16, max_batch_tokens=64)
    pinner = PinRaises(engine.pinner)
    cfg = OffloadConfig(block_size=16, num_cpu_blocks=256, model_id="test-llama")
    async with KVOffloader(cfg, engine.kv, layout=engine.layout, pinner=pinner) as off:
        engine.attach(off)
        real = getattr(off, call)
        fired = []

        def fail_twice(*args: Any, **kwargs: Any) -> Any:
            if not fired:
                fired.append(call)
                pinner.failures = 2  # this call and its retry
            return real(*args, **kwargs)

        setattr(off, call, fail_twice)
        results = await run_crowd(engine, check_every_step=True)
        assert fired == [call]
        assert results == crowd_reference  # a load given up is recomputed
        stats = engine.statistics()
        assert stats.pinner_errors == 2
        assert stats.failed_loads == (1 if call == "load" else 0)
        await off.drain()
        assert off.statistics().scheduler.live_requests == 0
        off.scheduler.check_invariants()
    engine.check_invariants()
    assert engine.pinner.num_pinned == 0
    assert engine.allocator.statistics().num_used == 0


async def test_a_pinner_error_from_the_drain_of_a_step_that_waits_for_blocks(model: Any) -> None:
    engine = PagedEngine(model, num_gpu_blocks=8, block_size=BS)
    pinner = UnpinRaisesOnce(engine.pinner)
    copies = ControllableCopyEngine()
    async with KVOffloader(
        config(), engine.kv, layout=engine.layout, pinner=pinner, copy_engine=copies
    ) as off:
        engine.attach(off)
        engine.add_request("a", prompts(1, 40)[0], max_new_tokens=1)
        await engine.run_until_done()
        assert engine.allocator.statistics().num_held > 0  # a's stores pin its blocks
        real = off.drain
        fired = []

        def complete_then_drain() -> Any:
            if not fired:  # the first drain: a's stores end, and drain surfaces the error
                fired.append(True)
                copies.complete_all()
                pinner.armed = True
                off._life.launcher._unpin(
                    "g0", [], None
                )  # what a completion does when its unpin raises
            return real()

        off.drain = complete_then_drain  # type: ignore[method-assign]
        engine.add_request("b", prompts(1, 30, seed=9)[0], max_new_tokens=2)
        assert await engine.step() == []  # b does not fit until a's stores release blocks
        assert fired
        assert engine.statistics().pinner_errors == 1
        assert engine.allocator.statistics().num_held == 0
        engine.check_invariants()
        (ok,) = await engine.run_until_done()
        assert ok.finish_reason == "length"
        assert ok.error is None
        copies.complete_all()
        await real()
        off.scheduler.check_invariants()
    engine.check_invariants()
    assert engine.pinner.num_pinned == 0


async def test_a_completion_whose_unpin_raises_surfaces_at_the_next_advance(model: Any) -> None:
    # The real path, with no shortcut: a completion's unpin raises; b's next step calls
    # advance first, which raises the PinnerError; the step still delivers b's token.
    engine = PagedEngine(model, num_gpu_blocks=32, block_size=BS)
    pinner = UnpinRaisesOnce(engine.pinner)
    copies = ControllableCopyEngine()
    async with KVOffloader(
        config(), engine.kv, layout=engine.layout, pinner=pinner, copy_engine=copies
    ) as off:
        engine.attach(off)
        engine.add_request("a", prompts(1, 30)[0], max_new_tokens=1)
        await engine.run_until_done()
        engine.add_request("b", prompts(1, 20, seed=9)[0], max_new_tokens=3)
        await engine.step()  # b runs
        pinner.armed = True
        copies.complete_all()
        await off.drain()
        assert not pinner.armed
        (out,) = await engine.step()  # b decodes: its advance surfaces the error
        assert out.request_id == "b"
        assert out.token_id is not None
        assert engine.statistics().pinner_errors == 1
        engine.check_invariants()
        (res,) = await engine.run_until_done()
        assert res.finish_reason == "length"
        assert len(res.output_token_ids) == 3
        assert "kvoffload advance raised PinnerError" in (res.error or "")
        assert engine.statistics().finish_errors == 0
        copies.complete_all()
        await off.drain()
        off.scheduler.check_invariants()
    engine.check_invariants()
    assert engine.pinner.num_pinned == 0


async def test_a_prompt_only_a_tier_holds_is_loaded_not_computed(
    model: Any, reference_model: Any, tmp_path: Any
) -> None:
    # No GPU prefix cache, and the CPU pool emptied: the blocks are only in the disk tier.
    # The lookup that starts their promotion defers the request; a later step loads them.
    engine = PagedEngine(
        model, num_gpu_blocks=32, block_size=BS, max_batch_tokens=64, enable_prefix_caching=False
    )
    tier = {"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": 1 << 22}
    cfg = OffloadConfig(block_size=BS, num_cpu_blocks=64, model_id="test-llama", tiers=[tier])
    (prompt,) = prompts(1, 41, seed=5)
    async with KVOffloader(cfg, engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        engine.add_request("a", prompt, max_new_tokens=4)
        (first,) = await engine.run_until_done()
        assert first.loaded_tokens == 0
        await off.drain()
        tiers = off.tiers
        assert tiers is not None
        with anyio.fail_after(10):
            while tiers.statistics().refs_held or not tiers.statistics().tiers[0].blocks_written:
                await anyio.sleep(0.01)
        await off.reset()
        engine.add_request("b", prompt, max_new_tokens=4)
        (again,) = await engine.run_until_done()
        assert again.loaded_tokens == 5 * BS  # every full block before the last token
        assert again.computed_tokens == len(prompt) - 5 * BS
        assert again.output_token_ids == reference(reference_model, prompt, 4)
        assert tiers.statistics().tiers[0].blocks_promoted == 5
        await off.drain()
        off.scheduler.check_invariants()
        assert engine.pinner.num_pinned == 0


async def test_a_load_past_its_deadline_is_abandoned_and_recomputed(
    model: Any, reference_model: Any
) -> None:
    # load_deadline_s=0 and copies that end only when the test says: b's load is really
    # abandoned. b recomputes into fresh blocks and answers the tokens of no offload; the
    # late copy, landed while b and c still run, writes only blocks no request holds.
    engine = PagedEngine(
        model,
        num_gpu_blocks=32,
        block_size=BS,
        max_batch_tokens=16,
        enable_prefix_caching=False,  # the hit is the CPU pool's
        load_deadline_s=0,
    )
    host = HostKVBuffer(engine.layout, 256, pin_memory="never")
    copies = ControllableCopyEngine(layout=engine.layout, gpu_kv=engine.kv, host=host)
    prompt, other = prompts(2, 30, seed=4)
    try:
        async with KVOffloader(
            config(), engine.kv, layout=engine.layout, pinner=engine.pinner, copy_engine=copies
        ) as off:
            engine.attach(off)
            engine.add_request("a", prompt, max_new_tokens=4)
            (first,) = await engine.run_until_done()
            copies.complete_all()  # a's stores land: the CPU pool holds its prefix
            await off.drain()
            engine.add_request("b", prompt, max_new_tokens=4)
            engine.add_request("c", other, max_new_tokens=6)
            results: dict[str, GenerationResult] = {}
            late: set[int] = set()
            steps = 0
            while engine.has_work:
                outs = await engine.step()
                steps += 1
                results.update({o.request_id: o.result for o in outs if o.result is not None})
                loads = [t for t in copies.pending if t.kind == "load"]
                if steps == 1:
                    (load,) = loads  # b's, abandoned: still in flight
                    late = set(load.gpu_block_ids)
                    assert late
                    assert all(engine.pinner.is_pinned(b) for b in late)
                    assert engine.allocator.statistics().num_held >= len(late)
                if loads:
                    for r in engine._batch.running:
                        assert not late & set(r.table), "a request holds a late copy's block"
                if steps == 2:
                    copies.complete_all()  # the late copy lands mid-run
                engine.check_invariants()
            assert steps > 2
            b, c = results["b"], results["c"]
            assert (
                b.output_token_ids
                == first.output_token_ids
                == reference(reference_model, prompt, 4)
            )
            assert c.output_token_ids == reference(reference_model, other, 6)
            assert b.loaded_tokens == 0
            assert b.computed_tokens == len(prompt)
            stats = engine.statistics()
            assert stats.abandoned_loads == 1
            assert stats.failed_loads == 0
            copies.complete_all()
            await off.drain()
            sched = off.statistics().scheduler
            assert sched.abandoned_loads == 1
            assert sched.loaded_tokens == 0
            assert off.pool.num_free == off.pool.num_blocks
            off.scheduler.check_invariants()
        engine.check_invariants()
        assert engine.pinner.num_pinned == 0
        assert engine.allocator.statistics().num_held == 0
        assert engine.allocator.statistics().num_used == 0
    finally:
        host.close()


async def test_a_deadline_that_is_not_missed_loads(model: Any, reference_model: Any) -> None:
    engine = PagedEngine(
        model, num_gpu_blocks=32, block_size=BS, enable_prefix_caching=False, load_deadline_s=60
    )
    prompt = prompts(1, 30, seed=4)[0]
    async with KVOffloader(config(), engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        engine.add_request("a", prompt, max_new_tokens=3)
        await engine.run_until_done()
        await off.drain()
        engine.add_request("b", prompt, max_new_tokens=3)
        (b,) = await engine.run_until_done()
        assert b.loaded_tokens == 3 * BS
        assert b.output_token_ids == reference(reference_model, prompt, 3)
        assert engine.statistics().abandoned_loads == 0


def test_a_negative_load_deadline_is_refused(model: Any) -> None:
    with pytest.raises(ConfigError, match="load_deadline_s=-1"):
        PagedEngine(model, num_gpu_blocks=8, block_size=BS, load_deadline_s=-1)


async def test_an_abandoned_load_without_fresh_blocks_starts_over(
    model: Any, reference_model: Any
) -> None:
    # Five GPU blocks: b's table takes four, so no three fresh ones are free when its load
    # is abandoned. b is preempted and re-admitted once the late copy ended (the step
    # waits for it), computes everything, and answers the tokens of no offload.
    engine = PagedEngine(
        model,
        num_gpu_blocks=5,
        block_size=BS,
        enable_prefix_caching=False,
        load_deadline_s=0,
    )
    copies = ControllableCopyEngine()
    (prompt,) = prompts(1, 30, seed=6)
    async with KVOffloader(
        config(), engine.kv, layout=engine.layout, pinner=engine.pinner, copy_engine=copies
    ) as off:
        engine.attach(off)
        engine.add_request("a", prompt, max_new_tokens=4)
        await engine.run_until_done()
        copies.complete_all()
        await off.drain()
        engine.add_request("b", prompt, max_new_tokens=4)
        done: list[GenerationResult] = []

        async def run() -> None:
            done.extend(await engine.run_until_done())

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(30):
                while not engine.statistics().abandoned_loads:
                    await anyio.sleep(0.001)
                assert engine.statistics().preemptions == 1  # no fresh blocks: preempted
                while not done:  # land every copy, the abandoned one included
                    copies.complete_all()
                    await anyio.sleep(0.001)
        (b,) = done
        assert b.output_token_ids == reference(reference_model, prompt, 4)
        assert b.loaded_tokens == 0
        assert b.computed_tokens == len(prompt)
        copies.complete_all()
        await off.drain()
        assert off.statistics().scheduler.abandoned_loads == 1
        off.scheduler.check_invariants()
    engine.check_invariants()
    assert engine.pinner.num_pinned == 0
    assert engine.allocator.statistics().num_used == 0


def test_a_free_block_a_transfer_pins_is_not_handed_out() -> None:
    """A block freed before its store was planned (a finished request's, a sliding
    window's, a state snapshot in the prefix cache) is held while the copy reads it."""
    from kvoffload.hashing import BlockHash  # noqa: PLC0415

    alloc = GpuBlockAllocator(2)
    blocks = alloc.allocate(2)
    assert blocks is not None
    h = BlockHash(bytes(32))
    alloc.cache(h, blocks[0])
    alloc.free(blocks)
    alloc.pinner.pin([blocks[0]])  # a store of the cached, free block starts
    assert alloc.allocate(1) == [blocks[1]]
    assert alloc.allocate(1) is None  # not the pinned one
    alloc.check_invariants()
    alloc.pinner.unpin([blocks[0]])
    assert alloc.cached_block(h) == blocks[0]  # it kept its hash
    assert alloc.num_free == 1
    alloc.check_invariants()

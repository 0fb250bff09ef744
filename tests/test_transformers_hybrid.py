"""kvoffload.integrations.transformers: sliding-window (Gemma 3) and recurrent hybrid
(Qwen3-Next) models in the paged engine, against a full recompute."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

from kvoffload import ConfigError, KVOffloader, OffloadConfig, TransferStatus
from kvoffload.groups import page_layout
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import CopyFaults
from kvoffload.transfer import ThreadCopyEngine

transformers = pytest.importorskip("transformers")

from kvoffload.integrations.transformers import PagedEngine  # noqa: E402
from kvoffload.integrations.transformers.groups import (  # noqa: E402
    EngineGroup,
    hit_point,
    needed,
)

pytestmark = pytest.mark.anyio

BS = 4
VOCAB = 256
WINDOW = 6


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def gemma3() -> Any:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def qwen3_next() -> Any:
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[0, 1, 2],
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(cfg).eval()


FAMILIES = {"gemma3": gemma3, "qwen3_next": qwen3_next}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request: Any) -> tuple[Any, Any]:
    ref = FAMILIES[request.param]()
    return copy.deepcopy(ref), ref  # the engine's copy, the stock model


def reference(model: Any, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy tokens from the stock model, recomputing the whole sequence each step."""
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


async def run_checked(engine: PagedEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for o in await engine.step():
            engine.check_invariants()
            if o.result is not None:
                out[o.request_id] = o.result.output_token_ids
        engine.check_invariants()
        check_window(engine)
    return out


def check_window(engine: PagedEngine) -> None:
    """Every sliding-window group holds no block its window no longer needs."""
    for pos, g in enumerate(g for g in engine.groups if g.kind != "recurrent"):
        if g.window is None:
            continue
        for r in engine._batch.running:
            stale = max(0, (r.num_computed - g.window + 1) // BS)
            assert all(b is None for b in r.tables[pos][:stale]), (r.request_id, r.tables[pos])


async def test_multi_turn_with_prefix_hits_and_preemption_equals_a_recompute(
    models: tuple[Any, Any],
) -> None:
    model, ref = models
    engine = PagedEngine(model, num_gpu_blocks=14, block_size=BS, max_batch_tokens=12)
    gen = torch.Generator().manual_seed(3)
    convs = [torch.randint(0, VOCAB, (9 + 2 * i,), generator=gen).tolist() for i in range(3)]
    for _turn in range(2):
        for i, c in enumerate(convs):
            engine.add_request(f"c{i}-{_turn}", c, max_new_tokens=4)
        got = await run_checked(engine)
        for i, c in enumerate(convs):
            toks = got[f"c{i}-{_turn}"]
            assert toks == reference(ref, c, 4), (i, _turn)
            convs[i] = [*c, *toks, *torch.randint(0, VOCAB, (3,), generator=gen).tolist()]
    stats = engine.statistics()
    assert stats.gpu_cached_tokens > 0  # later turns hit the GPU prefix cache
    assert stats.preemptions > 0  # 14 blocks cannot hold three conversations at once


async def test_sliding_window_blocks_out_of_the_window_are_freed() -> None:
    engine = PagedEngine(gemma3(), num_gpu_blocks=16, block_size=BS)
    engine.add_request("a", list(range(1, 30)), max_new_tokens=2)
    engine._batch.admit()
    (r,) = engine._batch.running
    sliding = [g.name for g in engine.groups].index("sliding")
    while engine.has_work:
        await engine.step()
        engine.check_invariants()
        if r in engine._batch.running:
            held = [b for b in r.tables[sliding] if b is not None]
            assert len(held) <= -(-(WINDOW - 1) // BS) + 1 + -(-r.num_computed % BS // BS)
            assert r.tables[sliding][0] is None
            assert all(b is not None for b in r.tables[0])  # the full group keeps all


async def test_a_snapshot_at_the_prompts_end_rounds_down() -> None:
    model = qwen3_next()
    ref = copy.deepcopy(model)
    engine = PagedEngine(model, num_gpu_blocks=32, block_size=BS)
    prompt = list(range(10, 22))  # 12 tokens: three blocks, a snapshot at 4, 8 and 12
    engine.add_request("a", prompt, max_new_tokens=1)
    await run_checked(engine)
    rec = engine.allocators["recurrent"]
    assert rec.statistics().num_cached >= 3
    engine.add_request("b", prompt, max_new_tokens=3)  # the same prompt again
    engine._batch.admit()
    (r,) = engine._batch.running
    # the snapshot at 12 already includes the prompt's last token: the hit is at 8
    assert r.num_computed == 8
    got = await run_checked(engine)
    assert got["b"] == reference(ref, prompt, 3)


def test_needed_and_the_hit_point_per_group() -> None:
    full = EngineGroup("full", "full", (1,), 4)
    sw = EngineGroup("sliding", "sliding_window", (0,), 4, window=6)
    rec = EngineGroup("recurrent", "recurrent", (2,), 4)
    assert needed(full, 12) == range(3)
    assert needed(sw, 12) == range(1, 3)
    assert needed(rec, 12) == range(2, 3)
    assert needed(rec, 0) == range(0)
    have = {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 2)}
    groups = (full, sw, rec)
    # 13 tokens: 12 is the largest hit candidate; the snapshot at 8 (block 1) is missing,
    # which does not matter at 12 but does at 8
    assert hit_point(groups, 13, lambda g, i: (g, i) in have) == 12
    assert hit_point(groups, 12, lambda g, i: (g, i) in have) == 4  # never at the end: 8, then 4
    assert hit_point(groups, 4, lambda g, i: True) == 0


async def test_attaching_a_single_group_offloader_to_a_hybrid_is_refused_naming_the_groups() -> (
    None
):
    llama_cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    llama = PagedEngine(transformers.LlamaForCausalLM(llama_cfg), num_gpu_blocks=8, block_size=BS)
    engine = PagedEngine(qwen3_next(), num_gpu_blocks=8, block_size=BS)
    cfg = OffloadConfig(block_size=BS, num_cpu_blocks=8)
    async with KVOffloader(cfg, llama.kv, layout=llama.layout, pinner=llama.pinner) as off:
        with pytest.raises(ConfigError, match=r"'full' \(full.*'recurrent' \(recurrent"):
            engine.attach(off)
    # And the other way round: a hybrid's offloader on a Llama engine.
    async with offloader_for(engine) as off:
        with pytest.raises(ConfigError, match=r"groups=engine.kv_groups"):
            llama.attach(off)
    assert llama.kv_groups[0].kind == "full"
    assert [g.kind for g in engine.kv_groups] == ["full", "recurrent"]


async def test_a_load_past_its_deadline_is_abandoned_and_recomputed() -> None:
    """load_deadline_s=0 and every group's copies held by a gate: b's load is really
    abandoned, every group's part of it at once. b recomputes into fresh blocks of each
    group and answers the stock model's tokens; the late copies, landed while b and c
    still run, write only blocks no request holds. (Gemma 3: without the GPU prefix
    cache, which would serve b itself, Qwen3-Next keeps no state snapshot to offload.)"""
    ref = gemma3()
    model = copy.deepcopy(ref)
    engine = PagedEngine(
        model,
        num_gpu_blocks=32,
        block_size=BS,
        max_batch_tokens=16,
        enable_prefix_caching=False,  # the hit is the CPU pools'
        load_deadline_s=0,
    )
    gate = threading.Event()
    gate.set()
    engines, hosts = {}, {}
    for g in engine.kv_groups:
        lay, views = page_layout(g, engine.offload_kv[g.name])
        hosts[g.name] = HostKVBuffer(lay, 96, pin_memory="never")
        engines[g.name] = ThreadCopyEngine(
            lay, views, hosts[g.name], copy_hook=CopyFaults(gate=gate), copy_threads=1
        )
    gen = torch.Generator().manual_seed(4)
    prompt, other = (torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (30, 14))
    try:
        async with KVOffloader(
            offload_config(),
            engine.offload_kv,
            groups=engine.kv_groups,
            pinner=engine.pinners,
            copy_engine=engines,
        ) as off:
            engine.attach(off)  # a deadline with several groups is honoured
            engine.add_request("a", prompt, max_new_tokens=4)
            first = await run_checked(engine)
            await off.drain()  # a's stores land: the CPU pools hold its prefix
            gate.clear()
            engine.add_request("b", prompt, max_new_tokens=4)
            engine.add_request("c", other, max_new_tokens=6)
            assert off._life.front is not None
            got: dict[str, list[int]] = {}
            late: dict[str, set[int]] = {}
            steps = 0
            while engine.has_work:
                for o in await engine.step():
                    if o.result is not None:
                        got[o.request_id] = o.result.output_token_ids
                steps += 1
                if steps == 1:  # b's load, abandoned: every group's part still in flight
                    (task,) = [t for t in off._life.front.launcher.tasks if t.kind == "load"]
                    assert task.status is TransferStatus.ABANDONED
                    parts = task.plan.parts  # type: ignore[attr-defined]
                    late = {n: set(p.gpu_block_ids) for n, p in parts.items()}
                    assert set(late) == {g.name for g in engine.kv_groups}
                    for name, ids in late.items():
                        assert ids
                        assert all(engine.pinners[name].is_pinned(b) for b in ids)
                if not gate.is_set():
                    for r in engine._batch.running:
                        for gi, t in zip(engine._batch._attn, r.tables, strict=True):
                            held = late[engine.groups[gi].name]
                            assert not held & set(t), "a request holds a late copy's block"
                        rec = engine._batch._rec
                        if rec is not None:
                            assert not late[engine.groups[rec].name] & set(r.rec_table)
                if steps == 2:
                    gate.set()  # the late copies land mid-run
                engine.check_invariants()
                off.check_invariants()
            assert steps > 2
            assert got["b"] == first["a"] == reference(ref, prompt, 4)
            assert got["c"] == reference(ref, other, 6)
            stats = engine.statistics()
            assert stats.abandoned_loads == 1
            assert stats.failed_loads == 0
            await off.drain()
            sched = off.statistics().scheduler
            assert sched.abandoned_loads == 1
            assert sched.loaded_tokens == 0
            groups = off.statistics().groups
            assert groups is not None
            for s in groups.values():
                assert s.loaded_blocks == 0
                assert s.free_cpu_blocks == s.num_cpu_blocks
            off.check_invariants()
        engine.check_invariants()
        assert all(p.num_pinned == 0 for p in engine.pinners.values())
    finally:
        gate.set()
        for host in hosts.values():
            host.close()


async def test_a_deadline_that_is_not_missed_loads_every_group() -> None:
    ref = gemma3()
    model = copy.deepcopy(ref)
    engine = PagedEngine(
        model,
        num_gpu_blocks=32,
        block_size=BS,
        max_batch_tokens=16,  # a's prefill in chunks: each group stores its points
        enable_prefix_caching=False,
        load_deadline_s=60,
    )
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    async with offloader_for(engine) as off:
        engine.attach(off)
        engine.add_request("a", prompt, max_new_tokens=3)
        await run_checked(engine)
        await off.drain()
        engine.add_request("b", prompt, max_new_tokens=3)
        got = await run_checked(engine)
        assert got["b"] == reference(ref, prompt, 3)
        assert engine.statistics().abandoned_loads == 0
        assert engine.statistics().loaded_tokens > 0
        await off.drain()
        off.check_invariants()


async def test_offload_with_preemption_and_batching_equals_a_recompute(
    models: tuple[Any, Any],
) -> None:
    """Three conversations at once in a cache that cannot hold them: preemptions store
    each group's last point, re-admissions and later turns load it back."""
    model, ref = models
    engine = PagedEngine(model, num_gpu_blocks=14, block_size=BS, max_batch_tokens=12)
    gen = torch.Generator().manual_seed(3)
    convs = [torch.randint(0, VOCAB, (9 + 2 * i,), generator=gen).tolist() for i in range(3)]
    async with offloader_for(engine) as off:
        engine.attach(off)
        for turn in range(3):
            for i, c in enumerate(convs):
                engine.add_request(f"c{i}-{turn}", c, max_new_tokens=4)
            got = await run_checked(engine)
            for i, c in enumerate(convs):
                toks = got[f"c{i}-{turn}"]
                assert toks == reference(ref, c, 4), (i, turn)
                convs[i] = [*c, *toks, *torch.randint(0, VOCAB, (3,), generator=gen).tolist()]
            off.check_invariants()
        await off.drain()
    stats = engine.statistics()
    assert stats.preemptions > 0
    assert stats.loaded_tokens > 0
    engine.check_invariants()


def offload_config(num_cpu_blocks: int = 96) -> OffloadConfig:
    return OffloadConfig(
        block_size=BS, num_cpu_blocks=num_cpu_blocks, checkpoint_tokens=2 * BS, model_id="t"
    )


def offloader_for(engine: PagedEngine, num_cpu_blocks: int = 96) -> KVOffloader:
    return KVOffloader(
        offload_config(num_cpu_blocks),
        engine.offload_kv,
        groups=engine.kv_groups,
        pinner=engine.pinners,
    )


async def converse(
    engine: PagedEngine, ref: Any, *, turns: int = 3, seed: int = 5
) -> tuple[int, list[list[int]]]:
    """Interleaved multi-turn conversations, one request at a time; each answer equals a
    full recompute of the stock model. Returns the tokens loaded from CPU and the
    answers."""
    gen = torch.Generator().manual_seed(seed)
    convs = [torch.randint(0, VOCAB, (10 + 3 * i,), generator=gen).tolist() for i in range(3)]
    loaded, answers = 0, []
    for turn in range(turns):
        for i, c in enumerate(convs):
            engine.add_request(f"c{i}-{turn}", c, max_new_tokens=4)
            (res,) = await engine.run_until_done()
            engine.check_invariants()
            assert res.error is None, res.error
            assert res.output_token_ids == reference(ref, c, 4), (i, turn)
            assert res.computed_tokens + res.gpu_cached_tokens + res.loaded_tokens == len(c)
            loaded += res.loaded_tokens
            answers.append(res.output_token_ids)
            extra = torch.randint(0, VOCAB, (3,), generator=gen).tolist()
            convs[i] = [*c, *res.output_token_ids, *extra]
    return loaded, answers


async def test_offload_serves_hybrids_from_cpu_with_tokens_equal_to_a_recompute(
    models: tuple[Any, Any],
) -> None:
    """A GPU cache too small for the history of three conversations: later turns load
    every group from CPU (the full blocks, the sliding window's blocks, the recurrent
    state snapshot), and every answer equals a full recompute of the stock model."""
    model, ref = models
    engine = PagedEngine(model, num_gpu_blocks=12, block_size=BS, max_batch_tokens=16)
    async with offloader_for(engine) as off:
        engine.attach(off)
        loaded, _ = await converse(engine, ref)
        await off.drain()
        stats = off.statistics()
        assert stats.groups is not None
        assert set(stats.groups) == {g.name for g in engine.kv_groups}
        assert all(s.loaded_blocks > 0 for s in stats.groups.values()), stats.groups
        assert stats.scheduler.live_requests == 0
        off.check_invariants()
        assert all(p.num_pinned == 0 for p in engine.pinners.values())
    assert loaded > 0
    assert engine.statistics().loaded_tokens == loaded
    engine.check_invariants()
    for alloc in engine.allocators.values():
        assert alloc.statistics().num_held == 0


@pytest.mark.parametrize("which", [None, "full", "other"])
async def test_a_corrupted_cpu_block_of_one_group_changes_the_answer(
    models: tuple[Any, Any], which: str | None
) -> None:
    """The negative control: overwrite one group's host blocks (the full group's, or the
    other one's: Gemma 3's sliding window, Qwen3-Next's recurrent state) after the first
    turn; the second turn loads them (its prefix was evicted from the GPU cache), and its
    answer differs from a recompute, while without the corruption it equals it (so the
    equality above depends on every group's bytes)."""
    model, ref = models
    engine = PagedEngine(model, num_gpu_blocks=12, block_size=BS, max_batch_tokens=16)
    (other,) = [g.name for g in engine.kv_groups if g.name != "full"]
    corrupt = other if which == "other" else which
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, VOCAB, (22,), generator=gen).tolist()
    filler = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    async with offloader_for(engine) as off:
        engine.attach(off)
        engine.add_request("t1", prompt, max_new_tokens=4)
        (first,) = await engine.run_until_done()
        engine.add_request("filler", filler, max_new_tokens=2)  # evicts t1 from the GPU
        await engine.run_until_done()
        await off.drain()
        if corrupt is not None:
            host = off._life.hosts[corrupt]  # type: ignore[union-attr]
            host.raw.fill_(0x47)  # every float becomes about 51,000
        turn2 = [*prompt, *first.output_token_ids, 7, 8, 9]
        engine.add_request("t2", turn2, max_new_tokens=4)
        (second,) = await engine.run_until_done()
        await off.drain()
    assert second.loaded_tokens >= 16
    expected = reference(ref, turn2, 4)
    if corrupt is None:
        assert second.output_token_ids == expected
    else:
        assert second.output_token_ids != expected


async def test_a_session_hint_retains_every_groups_blocks_of_a_hybrid(
    models: tuple[Any, Any],
) -> None:
    """``add_request(retain_for_s=...)`` with a hybrid model's offloader (refused before):
    the finished request's prefix is retained in every group's pool, then released."""
    model, _ = models
    engine = PagedEngine(model, num_gpu_blocks=12, block_size=BS, max_batch_tokens=16)
    async with offloader_for(engine) as off:
        engine.attach(off)
        engine.add_request("a", list(range(1, 18)), max_new_tokens=2, retain_for_s=60, session="s")
        (res,) = await engine.run_until_done()
        assert res.error is None, res.error
        await off.drain()
        off.store()  # a hint given before the last store completed is retained now
        assert off.hints.sessions == ("s",)
        groups = off._life.front
        assert groups is not None
        pools = [groups.scheduler.ledger(g).pool for g in groups.scheduler.statistics()]
        assert all(p.num_retained > 0 for p in pools)
        held = sum(p.num_retained for p in pools)
        assert off.hints.release("s") == held
        assert all(p.num_retained == 0 for p in pools)
        off.check_invariants()


async def test_a_hybrid_prefix_in_a_disk_tier_is_loaded_after_the_cpu_pool_was_emptied(
    models: tuple[Any, Any], tmp_path: Any
) -> None:
    """With a disk tier, ``off.tiers`` is the groups' tier front, so the engine's lookups
    may answer "ask again": after the CPU pool was emptied, the repeated prompt's lookup
    waits for every group's promotion and loads the prefix from the tier (loaded tokens
    > 0) instead of computing it, and the answer equals the stock model's."""
    model, ref = models
    engine = PagedEngine(model, num_gpu_blocks=12, block_size=BS, max_batch_tokens=16)
    disk = {"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": "8MiB"}
    cfg = OffloadConfig(**{**offload_config().model_dump(), "tiers": [disk]})
    gen = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, VOCAB, (22,), generator=gen).tolist()
    filler = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    async with KVOffloader(
        cfg, engine.offload_kv, groups=engine.kv_groups, pinner=engine.pinners
    ) as off:
        engine.attach(off)
        tiers = off.tiers
        assert tiers is not None
        engine.add_request("t1", prompt, max_new_tokens=4)
        (first,) = await engine.run_until_done()
        engine.add_request("filler", filler, max_new_tokens=2)  # evicts t1 from the GPU
        await engine.run_until_done()
        await off.drain()
        while tiers.statistics().refs_held:  # every group's write-downs landed
            await anyio.sleep(0.01)
        assert {t.name for t in tiers.tiers} == {f"disk0.{g.name}" for g in engine.kv_groups}
        assert all(t.blocks_written for t in tiers.statistics().tiers)
        assert await off.reset()  # the CPU pool is empty; the tier keeps every group's blocks
        turn2 = [*prompt, *first.output_token_ids, 7, 8, 9]
        engine.add_request("t2", turn2, max_new_tokens=4)
        (second,) = await engine.run_until_done()
        await off.drain()
        stats = tiers.statistics()
        assert stats.deferred_lookups > 0
        assert all(t.blocks_promoted > 0 for t in stats.tiers)
        tiers.check_invariants()
        off.check_invariants()
    assert second.error is None, second.error
    assert second.loaded_tokens >= 16
    assert second.output_token_ids == reference(ref, turn2, 4)

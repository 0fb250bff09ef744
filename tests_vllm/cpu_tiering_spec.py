"""A test-only tiering spec that runs vLLM's OffloadingConnector in the vLLM CPU engine.

vLLM's `TieringOffloadingSpec` (a CPU primary region plus secondary tiers) refuses a
CPU engine: its copy worker moves blocks between the GPU KV cache and the primary region
with device streams, and ``get_worker`` raises on any other platform. This subclass
replaces only that worker with `CPUCopyWorker`, which copies the same bytes with plain
tensor copies between vLLM's CPU KV cache tensors and the primary region. Everything
else (the tiering manager, the primary region, the secondary tiers, the connector) is
vLLM's own. It is loaded as vLLM loads any out-of-tree spec::

    "spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "cpu_tiering_spec"
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CPUCopyWorker", "CPUTieringOffloadingSpec", "copies"]

copies = {"store_blocks": 0, "load_blocks": 0}
"""Engine blocks copied into (store) and out of (load) the primary region, process-wide."""


class CPUCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Synchronous copies between the engine's KV cache pages and primary-region chunks.

    Args:
        kv_caches: vLLM's KV cache tensors (one page per block) and each group's layers.
        blocks_per_chunk: engine blocks per primary-region chunk.
        region: the worker's view of vLLM's shared primary region (owned from here on).
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._bpc = blocks_per_chunk
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._engine: list[torch.Tensor] = []
        self._primary: list[torch.Tensor] = []  # (chunks, blocks_per_chunk, page) views
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            engine = t.tensor.view(torch.int8).view(-1, page)
            assert engine.device.type == "cpu"
            rows = region.create_next_worker_view(page * blocks_per_chunk)
            self._engine.append(engine)
            self._primary.append(
                rows.as_strided(
                    (rows.shape[0], blocks_per_chunk, page),
                    (rows.stride(0), page, 1),
                )
            )
        self._done: list[TransferResult] = []

    def _sub_blocks(self, chunks: Any, skip: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk, position in chunk) of ``count`` engine-sized blocks, the first ``skip``
        of the first chunk left out."""
        flat = torch.arange(skip, skip + count)
        chunk_ids = torch.as_tensor(chunks, dtype=torch.long)[flat // self._bpc]
        return chunk_ids, flat % self._bpc

    def _copy(self, engine_spec: GPULoadStoreSpec, chunk_spec: LoadStoreSpec, store: bool) -> int:
        assert isinstance(chunk_spec, BlockIDsLoadStoreSpec)
        blocks = engine_spec.block_ids
        chunks = chunk_spec.block_ids
        at_block = at_chunk = 0
        nbytes = 0
        for refs, size, index in zip(
            self._refs, engine_spec.group_sizes, engine_spec.block_indices, strict=True
        ):
            if size == 0:
                continue
            skip = index % self._bpc
            num_chunks = -(-(size + skip) // self._bpc)
            engine_ids = torch.as_tensor(blocks[at_block : at_block + size], dtype=torch.long)
            chunk_ids, within = self._sub_blocks(
                chunks[at_chunk : at_chunk + num_chunks], skip, size
            )
            for ref in refs:
                n = ref.page_size_bytes
                engine = self._engine[ref.tensor_idx]
                primary = self._primary[ref.tensor_idx]
                if store:
                    primary[chunk_ids, within, :n] = engine[engine_ids, :n]
                else:
                    engine[engine_ids, :n] = primary[chunk_ids, within, :n]
                nbytes += size * n
            at_block += size
            at_chunk += num_chunks
        assert at_block == len(blocks)
        assert at_chunk == len(chunks)
        copies["store_blocks" if store else "load_blocks"] += len(blocks)
        return nbytes

    def _run(self, job_id: int, engine_spec: Any, chunk_spec: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(engine_spec, GPULoadStoreSpec)
        start = time.perf_counter()
        nbytes = self._copy(engine_spec, chunk_spec, store)
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Engine blocks into primary-region chunks (done before returning)."""
        return self._run(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Primary-region chunks into engine blocks (done before returning)."""
        return self._run(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Every job finished when it was submitted."""

    def shutdown(self) -> None:
        self._engine.clear()
        self._primary.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CPUTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's tiering spec with `CPUCopyWorker` as its copy worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, region)
        return self._worker

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvoffload.config import KVLayout
from kvoffload.storage.host_buffer import HostKVBuffer


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def host_factory() -> Iterator[Callable[[KVLayout, int], HostKVBuffer]]:
    made: list[HostKVBuffer] = []

    def make(layout: KVLayout, num_blocks: int) -> HostKVBuffer:
        buf = HostKVBuffer(layout, num_blocks, pin_memory="never")
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()

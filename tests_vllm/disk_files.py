"""What the tests do to a disk tier's file behind the connector's back."""

from __future__ import annotations

from pathlib import Path

from kvoffload.tiers.disk_layout import DiskLayout


def corrupt_every_slot(path: Path, capacity: int, block_nbytes: int, *, offset: int = 100) -> int:
    """Flip 16 bytes ``offset`` bytes into every slot a disk tier's file of ``capacity``
    bytes has room for (a payload past the slot's header); the slots written."""
    layout = DiskLayout(capacity, block_nbytes=block_nbytes, namespace=b"\0" * 32, name="t")
    size = path.stat().st_size
    hit = 0
    with open(path, "r+b") as f:
        for slot in range(layout.num_slots):
            at = layout.offset(slot) + offset
            if at >= size:
                break
            f.seek(at)
            old = f.read(16)
            f.seek(at)
            f.write(bytes(b ^ 0xA5 for b in old))
            hit += 1
    return hit

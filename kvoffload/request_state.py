"""The request state's old home: `RequestOffloadState` is `kvoffload.scheduler.core`'s
(the view `OffloadScheduler.request_state()` returns), `RequestPhase`
`kvoffload.scheduler.state`'s.

Kept so that ``from kvoffload.request_state import RequestOffloadState`` goes on working.
"""

from __future__ import annotations

from kvoffload.scheduler.core import RequestOffloadState
from kvoffload.scheduler.state import RequestPhase

__all__ = ["RequestOffloadState", "RequestPhase"]

"""The request state's old home; it lives in `kvoffload.scheduler.state` now.

Kept so that ``from kvoffload.request_state import RequestOffloadState`` goes on working.
"""

from __future__ import annotations

from kvoffload.scheduler.state import RequestOffloadState, RequestPhase

__all__ = ["RequestOffloadState", "RequestPhase"]

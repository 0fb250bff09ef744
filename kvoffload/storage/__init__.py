"""Host memory for the CPU blocks."""

from kvoffload.storage.host_buffer import CudaHostRegistrar, HostKVBuffer, HostRegistrar

__all__ = ["CudaHostRegistrar", "HostKVBuffer", "HostRegistrar"]

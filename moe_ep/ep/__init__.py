"""Expert-parallel dispatch/combine: ``EPAllToAll`` (``front``), the front over protocol objects
(``protocol`` says what they share and offer; ``low_latency`` is the NVSHMEM one).
"""
from .front import EPAllToAll, EPHandle, check_config

__all__ = ["EPAllToAll", "EPHandle", "check_config"]

"""Distributed set-up: parallel layout, device profile, megatron-core initialisation and its CPU shims."""

from mpo.parallel.config import LayoutError, ParallelConfig
from mpo.parallel.device import DeviceProfile, detect_device
from mpo.parallel.init import ParallelContext, destroy_parallel, initialize_parallel

__all__ = ["LayoutError", "ParallelConfig", "DeviceProfile", "detect_device", "ParallelContext",
           "initialize_parallel", "destroy_parallel"]

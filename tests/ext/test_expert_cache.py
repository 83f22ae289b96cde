"""Converted expert layers saved and memory-mapped (CpuExpertPool.save_layer / load_layer,
ext/cpu/cache.py): bit-identical to a fresh conversion per format and across node splits, and
every bad file (short, corrupted, stale key, wrong shape) is refused without harm."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import CpuExpertPool, ExpertCache, default_cache_root
from tandem.ext.cpu.cache import EXPERT_CACHE_ENV, STALE_TEMP_SECONDS
from tandem.ext.cpu.pool import check_layer_file

CASES = [("bf16", 64), ("int8", 64), ("int4", 32), ("int4", 64)]
E, INTER, H = 6, 160, 200  # I and H not multiples of 64: padding is saved too


def _layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


def _outputs(pool: CpuExpertPool, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(9)])
    return pool.forward(layer, x, ids, torch.rand(9, 3, generator=g))


@pytest.mark.parametrize("fmt,group", CASES)
def test_save_then_load_is_bit_identical(fmt: str, group: int, tmp_path: Path) -> None:
    w13, w2 = _layer()
    fresh = CpuExpertPool(2)
    fresh.add_layer(5, w13, w2, fmt, group)
    path = tmp_path / "layer.bin"
    fresh.save_layer(5, path, key="k")
    assert [p.name for p in tmp_path.iterdir()] == ["layer.bin"]  # no temporary left behind
    loaded = CpuExpertPool(2)
    loaded.load_layer(5, path, key="k", shape=(E, INTER, H), fmt=fmt, group_size=group)
    assert loaded.layers_converted == 0 and loaded.layers_loaded == 1
    assert loaded.layer_format(5) == (fmt, group if fmt == "int4" else 0)
    assert torch.equal(_outputs(fresh, 5), _outputs(loaded, 5))
    for a, b in zip(fresh.dequantize(5), loaded.dequantize(5), strict=True):
        assert torch.equal(a, b)
    assert loaded.info()["bytes_per_format"] == fresh.info()["bytes_per_format"]


@pytest.mark.parametrize("fmt,group", CASES)
@pytest.mark.parametrize("save_nodes,load_nodes", [(2, 1), (1, 2), (2, 2)])
def test_file_is_independent_of_the_node_split(
    fmt: str, group: int, save_nodes: int, load_nodes: int, tmp_path: Path
) -> None:
    """Saved from a pool split over two (pseudo) NUMA nodes and loaded into one (the copy path
    by each node's workers) or the reverse: the same weights as converting in place."""
    w13, w2 = _layer(2)
    ref = CpuExpertPool(2, split_nodes=load_nodes)
    ref.add_layer(0, w13, w2, fmt, group)
    saver = CpuExpertPool(2, split_nodes=save_nodes)
    saver.add_layer(0, w13, w2, fmt, group)
    saver.save_layer(0, tmp_path / "l.bin")
    loaded = CpuExpertPool(2, split_nodes=load_nodes)
    assert len(loaded.info()["numa_nodes"]) == load_nodes
    loaded.load_layer(0, tmp_path / "l.bin")
    assert torch.equal(_outputs(ref, 0), _outputs(loaded, 0))
    for a, b in zip(ref.dequantize(0), loaded.dequantize(0), strict=True):
        assert torch.equal(a, b)


def _saved(tmp_path: Path, fmt: str = "int4") -> Path:
    pool = CpuExpertPool(1)
    pool.add_layer(0, *_layer(), fmt, 32)
    pool.save_layer(0, tmp_path / "l.bin", key="k")
    return tmp_path / "l.bin"


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda b: b[:4000], "shorter"),
        (lambda b: b[:-1], "size"),
        (lambda b: b + b"\0" * 64, "size"),
        (lambda b: b"XXXX" + b[4:], "not an expert cache"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "checksum"),
        (lambda b: b"", "shorter"),
        # the data overwritten after the header was written: zeroed, or the halves swapped
        (lambda b: b[:4096] + b"\0" * (len(b) - 4096), "data checksum"),
        (
            lambda b: b[:4096] + b[(len(b) + 4096) // 2 :] + b[4096 : (len(b) + 4096) // 2],
            "data checksum",
        ),  # fmt: skip
        (lambda b: b[:-64] + bytes(x ^ 0xFF for x in b[-64:]), "data checksum"),  # the last line
    ],
)
def test_bad_files_are_refused(damage, match: str, tmp_path: Path) -> None:
    """By load_layer, and by the header check a loader runs before it reads any weight."""
    path = _saved(tmp_path)
    check_layer_file(path, key="k", shape=(E, INTER, H), fmt="int4", group_size=32)
    path.write_bytes(damage(path.read_bytes()))
    pool = CpuExpertPool(1)
    with pytest.raises(ValueError, match=match):
        pool.load_layer(0, path, key="k")
    assert pool.info()["layers"] == []
    with pytest.raises(ValueError, match=match):
        check_layer_file(path, key="k")


def test_expectations_are_checked(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    pool = CpuExpertPool(1)
    with pytest.raises(ValueError, match="key mismatch"):
        pool.load_layer(0, path, key="other")
    with pytest.raises(ValueError, match="shape"):
        pool.load_layer(0, path, shape=(E, INTER + 1, H))
    with pytest.raises(ValueError, match="format"):
        pool.load_layer(0, path, fmt="int8")
    with pytest.raises(ValueError, match="format"):
        pool.load_layer(0, path, fmt="int4", group_size=64)
    with pytest.raises(ValueError, match="cannot open"):
        pool.load_layer(0, tmp_path / "missing.bin")
    for kwargs, match in [
        ({"key": "other"}, "key mismatch"),
        ({"shape": (E, INTER + 1, H)}, "shape"),
        ({"fmt": "int8"}, "format"),
        ({"fmt": "int4", "group_size": 64}, "format"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_layer_file(path, **kwargs)
    with pytest.raises(ValueError, match="cannot open"):
        check_layer_file(tmp_path / "missing.bin")
    pool.load_layer(0, path, key="k", shape=(E, INTER, H), fmt="int4", group_size=32)


def test_save_error_leaves_no_file(tmp_path: Path) -> None:
    pool = CpuExpertPool(1)
    pool.add_layer(0, *_layer(), "bf16")
    with pytest.raises(RuntimeError):
        pool.save_layer(0, tmp_path / "no_such_dir" / "l.bin")
    with pytest.raises(ValueError):
        pool.save_layer(1, tmp_path / "l.bin")  # no such layer
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_a_file_whole(tmp_path: Path) -> None:
    """save_layer writes a temporary file and renames it over the old one: no temporary is
    left, and a file another pool mapped keeps its old contents."""
    path = _saved(tmp_path, fmt="int4")
    reader = CpuExpertPool(1)
    reader.load_layer(0, path, key="k")
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((3, 2), 0.5)
    before = reader.forward(0, hidden, ids, weights)
    pool = CpuExpertPool(1)
    pool.add_layer(0, *(2 * t for t in _layer()), "int4", 32)
    pool.save_layer(0, path, key="k")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.bin"]
    assert torch.equal(reader.forward(0, hidden, ids, weights), before)
    fresh = CpuExpertPool(1)
    fresh.load_layer(0, path, key="k")
    assert torch.equal(
        fresh.forward(0, hidden, ids, weights), pool.forward(0, hidden, ids, weights)
    )
    assert not torch.equal(fresh.forward(0, hidden, ids, weights), before)


def test_cache_falls_back_with_a_warning(tmp_path: Path, caplog) -> None:
    w13, w2 = _layer()
    cache = ExpertCache(tmp_path, "file:x", "int8", 64)
    key = cache.layer_key(0, w13.shape, w2.shape, "file:torch.float32")
    pool = CpuExpertPool(1)
    assert not cache.load(pool, 0, key, (E, INTER, H))  # nothing saved yet: a silent miss
    pool.add_layer(0, w13, w2, "int8")
    cache.save(pool, 0, key)
    assert cache.load(CpuExpertPool(1), 0, key, (E, INTER, H))
    other = cache.layer_key(0, w13.shape, w2.shape, "file:torch.bfloat16")  # other source dtype
    assert other != key
    with caplog.at_level(logging.WARNING):
        assert not cache.load(CpuExpertPool(1), 0, other, (E, INTER, H))
    assert "key mismatch" in caplog.text
    cache.layer_path(0).write_bytes(cache.layer_path(0).read_bytes()[:5000])
    with caplog.at_level(logging.WARNING):
        assert not cache.load(CpuExpertPool(1), 0, key, (E, INTER, H))
    assert "size" in caplog.text
    assert (cache.hits, cache.misses, cache.writes) == (1, 3, 1)
    assert not cache.check(0, key, (E, INTER, H))  # the short file, by its header and size
    cache.save(pool, 0, key)
    assert cache.check(0, key, (E, INTER, H)) and not cache.check(0, other, (E, INTER, H))
    assert not cache.check(1, key, (E, INTER, H))  # no file
    assert ExpertCache(tmp_path, "file:y", "int8", 64).dir != cache.dir
    assert ExpertCache(tmp_path, "file:x", "int4", 64).dir != cache.dir


def test_first_save_removes_stale_temporary_files(tmp_path: Path) -> None:
    """A process killed mid-save leaves a layer-sized temporary file (the pool's and the
    extension's names): the next process's first save deletes those older than an hour and
    keeps fresh ones (a save in progress, maybe of another host) and every layer file."""
    w13, w2 = _layer()
    cache = ExpertCache(tmp_path, "file:x", "int8", 64)
    cache.dir.mkdir(parents=True)
    old_names = [".layer_3.bin.4242.140.tmp", ".layer_3.bin.4242.140.tmp.tmp4242"]
    for name in [*old_names, ".layer_5.bin.77.1.tmp", "layer_9.bin"]:
        (cache.dir / name).write_bytes(b"x" * 100)
    hour_ago = time.time() - 2 * STALE_TEMP_SECONDS
    for name in [*old_names, "layer_9.bin"]:
        os.utime(cache.dir / name, (hour_ago, hour_ago))
    pool = CpuExpertPool(1)
    pool.add_layer(0, w13, w2, "int8")
    key = cache.layer_key(0, w13.shape, w2.shape, "file:torch.float32")
    cache.save(pool, 0, key)
    left = sorted(p.name for p in cache.dir.iterdir())
    assert left == [".layer_5.bin.77.1.tmp", "layer_0.bin", "layer_9.bin"]
    (cache.dir / old_names[0]).write_bytes(b"x")  # once per cache object: no sweep per layer
    os.utime(cache.dir / old_names[0], (hour_ago, hour_ago))
    cache.save(pool, 0, key)
    assert (cache.dir / old_names[0]).exists()
    assert cache.remove_stale_temps() == 1


def test_default_root_from_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.delenv(EXPERT_CACHE_ENV, raising=False)
    assert default_cache_root() == tmp_path / "expert_cache"
    monkeypatch.setenv(EXPERT_CACHE_ENV, "0")
    assert default_cache_root() is None
    monkeypatch.setenv(EXPERT_CACHE_ENV, str(tmp_path / "elsewhere"))
    assert default_cache_root() == tmp_path / "elsewhere"


@pytest.mark.parametrize("fmt,group", CASES)
def test_dequantize_a_subset_of_experts(fmt: str, group: int) -> None:
    """What GPU placement copies: chosen experts, in the order asked, as the whole layer has them."""
    pool = CpuExpertPool(2, split_nodes=2)
    pool.add_layer(0, *_layer(), fmt, group)
    w13, w2 = pool.dequantize(0)
    s13, s2 = pool.dequantize(0, [4, 1, 4])
    assert torch.equal(s13, w13[[4, 1, 4]]) and torch.equal(s2, w2[[4, 1, 4]])
    assert pool.dequantize(0, [])[0].shape == (0, 2 * INTER, H)
    with pytest.raises(ValueError):
        pool.dequantize(0, [E])


def test_source_identity_covers_weights_and_config_only(tmp_path: Path) -> None:
    """A checkpoint directory's identity (the expert cache's key) changes with its weight files
    and config.json, not with its tokenizer or README: editing a chat template reconverted
    every layer and left the old entry on disk."""
    from tandem.ext.cpu.cache import source_identity

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"0" * 64)
    before = source_identity(tmp_path)
    for name in ("tokenizer_config.json", "tokenizer.json", "README.md", "generation_config.json"):
        (tmp_path / name).write_text("changed")
    assert source_identity(tmp_path) == before
    st = (tmp_path / "model.safetensors").stat()
    os.utime(tmp_path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert source_identity(tmp_path) != before
    touched = source_identity(tmp_path)
    (tmp_path / "config.json").write_text('{"num_experts": 8}')
    assert source_identity(tmp_path) != touched

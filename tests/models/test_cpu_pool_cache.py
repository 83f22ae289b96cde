"""The expert cache through load_model: converted experts saved on the first start and
mapped on the next, no expert tensor read on a hit, a damaged entry re-read alone, GGUF experts
converted from the file's own blocks. Checkpoints from tests/models/moe_cases.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.models.layers.cpu_experts import CpuPoolExpertBackend
from tandem.models.loader import load_model
from tests.models.moe_cases import _llm, _run, _save


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_second_start_loads_converted_experts_from_the_cache(
    fmt: str, tmp_path: Path, monkeypatch
) -> None:
    """The first LLM converts each MoE layer and saves it under $TANDEM_HOME/expert_cache; the
    second maps the saved layers (no conversion) and generates the same greedy tokens. A
    corrupted file falls back to converting; TANDEM_EXPERT_CACHE=0 turns the cache off."""
    from tandem.runtime.sampling_params import SamplingParams

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TANDEM_EXPERT_CACHE", raising=False)
    model_dir = tmp_path / "model"
    _save("qwen3_moe", model_dir)  # layer 0 dense, layer 1 MoE
    prompts = [[5, 9, 17, 3], list(range(1, 30))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def start(**spec: object) -> tuple[list[list[int]], CpuPoolExpertBackend]:
        llm = _llm(model_dir, cpu_experts="all", cpu_threads=1, cpu_expert_format=fmt, **spec)
        backend = llm.engine.model.expert_backend
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        backend.close()
        return tokens, backend

    first, b1 = start()
    assert (b1.pool.layers_converted, b1.pool.layers_loaded) == (1, 0)
    files = list((tmp_path / "home" / "expert_cache").glob("*/layer_1.bin"))
    assert len(files) == 1
    second, b2 = start()
    assert (b2.pool.layers_converted, b2.pool.layers_loaded) == (0, 1)
    assert second == first
    files[0].write_bytes(files[0].read_bytes()[:-7])  # short: converted again, then re-saved
    third, b3 = start()
    assert (b3.pool.layers_converted, b3.pool.layers_loaded) == (1, 0) and third == first
    assert start()[1].pool.layers_loaded == 1
    # another dtype converts other bytes: its own entry, and the first one stays
    assert start(dtype="bfloat16")[1].pool.layers_converted == 1
    assert start(dtype="bfloat16")[1].pool.layers_loaded == 1
    assert start()[1].pool.layers_loaded == 1
    monkeypatch.setenv("TANDEM_EXPERT_CACHE", "0")
    off, b5 = start()
    assert (b5.pool.layers_converted, b5.pool.layers_loaded) == (1, 0) and off == first


def _count_reads(monkeypatch) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor the safetensors loader reads from now on."""
    import tandem.models.loader.safetensors as st_loader

    reads: list[tuple[str, int]] = []
    real = st_loader.safe_open

    class Counting:
        """safe_open's handle, used with or without `with`; counts get_tensor's bytes."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            self._file = real(*args, **kwargs)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.__exit__(*exc)

        def __getattr__(self, name: str) -> object:  # keys, get_slice, metadata...
            return getattr(self._file, name)

        def get_tensor(self, name: str) -> torch.Tensor:
            t = self._file.get_tensor(name)
            reads.append((name, t.numel() * t.element_size()))
            return t

    monkeypatch.setattr(st_loader, "safe_open", Counting)
    return reads


def _expert_layers_read(reads: list[tuple[str, int]]) -> set[int]:
    from tandem.models.weights import expert_layer

    return {expert_layer(n) for n, _ in reads} - {None}


@pytest.mark.parametrize(
    "name,fmt,cpu_experts", [("qwen3_moe", "int4", "all"), ("mixtral", "int8", 5)]
)
def test_cache_hit_reads_no_expert_tensor(
    name: str, fmt: str, cpu_experts: str | int, tmp_path: Path, monkeypatch, paged_runner, caplog
) -> None:
    """A second start maps every MoE layer from the expert cache without reading one expert
    tensor of the checkpoint, and computes the first start's logits exactly (with 3 experts a
    layer "on the GPU" for Mixtral, placed from the pool's weights either way). A layer whose
    file is damaged before the start is read and converted again, alone; one damaged after the
    loader's header check (the read has skipped it) is re-read alone, with a warning."""
    from tandem.models.layers.cpu_experts import CpuPoolExpertBackend

    # a directory of its own (TANDEM_HOME would also move the built extension: a rebuild)
    monkeypatch.setenv("TANDEM_EXPERT_CACHE", str(tmp_path / "expert_cache"))
    model_dir = tmp_path / "model"
    _save(name, model_dir)
    reads = _count_reads(monkeypatch)
    opts = {"fmt": fmt, "isa": "scalar", "num_threads": 2, "cpu_experts": cpu_experts,
            "rebalance_after_tokens": 0}  # fmt: skip

    def start() -> tuple[dict[int, torch.Tensor], CpuPoolExpertBackend, set[int]]:
        reads.clear()
        model, config = load_model(
            model_dir, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
            expert_options=opts,
        )  # fmt: skip
        backend = model.expert_backend
        _, rows = _run(model, config, paged_runner)
        backend.close()
        return rows, backend, _expert_layers_read(reads)

    first, b1, read1 = start()
    moe_layers = set(b1._counts)
    assert moe_layers == ({1} if name == "qwen3_moe" else {0, 1})
    assert read1 == moe_layers and b1.pool.layers_converted == len(moe_layers)
    all_bytes = sum(n for _, n in reads)

    second, b2, read2 = start()
    assert read2 == set() and (b2.pool.layers_converted, b2.pool.layers_loaded) == (
        0,
        len(moe_layers),
    )
    assert not any(".experts." in n for n, _ in reads) and reads  # the rest is still read
    assert sum(n for _, n in reads) < all_bytes
    for seq, rows in first.items():
        assert torch.equal(rows, second[seq])
    if cpu_experts != "all":
        for b in (b1, b2):  # (stats() needs the open pool)
            assert {i: p.expert_ids.tolist() for i, p in b._placements.items()} == {
                0: [0, 1, 2],
                1: [0, 1, 2],
            }

    bad = max(moe_layers)
    path = next((tmp_path / "expert_cache").glob(f"*/layer_{bad}.bin"))
    path.write_bytes(path.read_bytes()[:-1])  # before the start: the header check refuses it
    third, b3, read3 = start()
    assert read3 == {bad} and (b3.pool.layers_converted, b3.pool.layers_loaded) == (
        1,
        len(moe_layers) - 1,
    )
    for seq, rows in first.items():
        assert torch.equal(rows, third[seq])

    real_skip = CpuPoolExpertBackend.skip_expert_layers

    def skip_then_damage(self, *args):  # the file goes bad between the check and attach
        skipped = real_skip(self, *args)
        assert skipped == frozenset(moe_layers)
        data = bytearray(path.read_bytes())
        data[20] ^= 1  # header checksum
        path.write_bytes(bytes(data))
        return skipped

    monkeypatch.setattr(CpuPoolExpertBackend, "skip_expert_layers", skip_then_damage)
    with caplog.at_level("WARNING"):
        fourth, b4, read4 = start()
    assert read4 == {bad} and b4.pool.layers_converted == 1
    assert "checksum" in caplog.text and f"re-reading layer {bad}'s experts" in caplog.text
    for seq, rows in first.items():
        assert torch.equal(rows, fourth[seq])
    monkeypatch.setattr(CpuPoolExpertBackend, "skip_expert_layers", real_skip)
    fifth, b5, read5 = start()  # re-saved by the fall-back: a clean hit again
    assert read5 == set() and b5.pool.layers_loaded == len(moe_layers)


def test_skipped_layers_are_not_expected(tmp_path: Path) -> None:
    """Leaving out a layer's experts leaves out exactly those: a missing router or shared
    expert of that layer is still an error, and so is a missing expert of another layer."""
    from safetensors.torch import load_file, save_file

    from tandem.models.config import ModelConfig, UnsupportedModelError
    from tandem.models.loader import build_model
    from tandem.models.weights import expert_layer

    _save("qwen2_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    model = build_model(ModelConfig.from_pretrained(tmp_path), dtype=torch.float32, device="cpu")

    def not_layer_1(name: str) -> bool:
        return expert_layer(name) != 1

    kept = {n: t for n, t in tensors.items() if not_layer_1(n)}
    assert len(kept) < len(tensors)
    assert any("layers.1.mlp.shared_expert." in n for n in kept)
    assert "model.layers.1.mlp.gate.weight" in kept
    model.load_weights(kept.items(), expected=not_layer_1)
    for missing in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight",
                    "model.layers.0.mlp.experts.3.up_proj.weight"):  # fmt: skip
        partial = {n: t for n, t in kept.items() if n != missing}
        with pytest.raises(UnsupportedModelError, match="missing"):
            model.load_weights(partial.items(), expected=not_layer_1)
    save_file(kept, tmp_path / "model.safetensors")  # a checkpoint really without them
    with pytest.raises(UnsupportedModelError, match=r"missing tensors.*layers\.1\.mlp\.experts"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def _tiny_qwen3moe_gguf(path: Path) -> None:
    """Two MoE layers, F32 tensors holding bf16 values (the pool's bf16 is then lossless)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    g = torch.Generator().manual_seed(0)
    vocab, hidden, heads, kv_heads, hd, experts, inter = 128, 64, 4, 2, 16, 8, 32

    def rand(*shape: int, std: float = 0.05) -> np.ndarray:
        return (torch.randn(*shape, generator=g) * std).bfloat16().float().numpy()

    tensors = {"token_embd.weight": rand(vocab, hidden), "output_norm.weight": rand(hidden) + 1,
               "output.weight": rand(vocab, hidden)}  # fmt: skip
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": rand(hidden) + 1,
            f"blk.{i}.attn_q.weight": rand(heads * hd, hidden),
            f"blk.{i}.attn_k.weight": rand(kv_heads * hd, hidden),
            f"blk.{i}.attn_v.weight": rand(kv_heads * hd, hidden),
            f"blk.{i}.attn_output.weight": rand(hidden, heads * hd),
            f"blk.{i}.attn_q_norm.weight": rand(hd) + 1,
            f"blk.{i}.attn_k_norm.weight": rand(hd) + 1,
            f"blk.{i}.ffn_norm.weight": rand(hidden) + 1,
            f"blk.{i}.ffn_gate_inp.weight": rand(experts, hidden, std=0.5),
            f"blk.{i}.ffn_gate_exps.weight": rand(experts, inter, hidden),
            f"blk.{i}.ffn_up_exps.weight": rand(experts, inter, hidden),
            f"blk.{i}.ffn_down_exps.weight": rand(experts, hidden, inter),
        }
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in {"block_count": 2, "embedding_length": hidden, "vocab_size": vocab,
                       "feed_forward_length": 96,
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                       "attention.key_length": hd, "expert_count": experts,
                       "expert_used_count": 2, "expert_feed_forward_length": inter,
                       "context_length": 256}.items():  # fmt: skip
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_experts_are_never_decoded_by_the_loader(
    tmp_path: Path, monkeypatch, paged_runner
) -> None:
    """A GGUF's stacked experts go into the pool from the file's blocks: the loader never
    decodes them into torch (first start), and a cache hit reads them not at all (second)."""
    import tandem.models.loader.gguf as gguf_loader
    import tandem.models.loader.gguf_experts as gguf_experts

    # a directory of its own (TANDEM_HOME would also move the built extension: a rebuild)
    monkeypatch.setenv("TANDEM_EXPERT_CACHE", str(tmp_path / "expert_cache"))
    path = tmp_path / "moe.gguf"
    _tiny_qwen3moe_gguf(path)
    decoded: list[str] = []
    for module in (gguf_loader, gguf_experts):
        monkeypatch.setattr(
            module,
            "dequantize_tensor",
            lambda reader, info, *a, _real=module.dequantize_tensor, **k: (
                decoded.append(info.name) or _real(reader, info, *a, **k)
            ),
        )
    ref_model, config = load_model(path, dtype=torch.float32, device="cpu")
    _, ref = _run(ref_model, config, paged_runner)
    assert sum("_exps" in n for n in decoded) == 6  # the torch backend needs them

    def start():
        decoded.clear()
        model, config = load_model(
            path, dtype=torch.float32, device="cpu", expert_backend="cpu_pool",
            expert_options={"fmt": "auto", "isa": "scalar", "num_threads": 2},
        )  # fmt: skip
        _, rows = _run(model, config, paged_runner)
        model.expert_backend.close()
        return rows, model.expert_backend.pool, [n for n in decoded if "_exps" in n]

    first, pool1, exps1 = start()
    assert pool1.layers_converted == 2 and len(exps1) == 6  # once each, by gguf_experts only
    for seq, rows in ref.items():
        assert float((first[seq] - rows).abs().max() / rows.abs().max()) < 1e-4
    second, pool2, exps2 = start()
    assert (pool2.layers_converted, pool2.layers_loaded) == (0, 2) and exps2 == []
    for seq, rows in first.items():
        assert torch.equal(rows, second[seq])


def test_auto_and_bf16_share_one_entry_for_a_float_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """--cpu-expert-format auto converts a float checkpoint to bf16, so a start with auto maps
    what a start with bf16 saved (and the reverse) instead of converting and saving a second
    copy of the same bytes (before: two directories, a 57 GB duplicate for a 30B model)."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TANDEM_EXPERT_CACHE", raising=False)
    model_dir = tmp_path / "model"
    _save("qwen3_moe", model_dir)  # layer 0 dense, layer 1 MoE

    def start(fmt: str) -> CpuPoolExpertBackend:
        llm = _llm(model_dir, cpu_experts="all", cpu_threads=1, cpu_expert_format=fmt)
        backend = llm.engine.model.expert_backend
        backend.close()
        return backend

    assert start("bf16").pool.layers_converted == 1
    assert start("auto").pool.layers_loaded == 1
    assert len(list((tmp_path / "home" / "expert_cache").glob("*/layer_1.bin"))) == 1
    assert start("int8").pool.layers_converted == 1  # another format: its own entry

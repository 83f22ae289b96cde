"""tools/peers/gen_gguf.py: the random-weight GGUFs llama.cpp and Tandem are both measured on
load and generate in Tandem (shrunk with --scale; the real shapes are the same code)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tandem.runtime import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


SHAPED = {  # kind -> (Tandem's architecture, llama.cpp's expert tensor type)
    "gpt-oss": ("GptOssForCausalLM", gguf.GGMLQuantizationType.MXFP4),
    "glm4moe": ("Glm4MoeForCausalLM", gguf.GGMLQuantizationType.Q4_0),
}


def _check_shape(path: Path, kind: str) -> None:
    """The file reads back as its family at the shape of tools/shapes (divided by 8)."""
    from tandem.models.loader.gguf import gguf_model_config

    arch, qtype = SHAPED[kind]
    cfg = gguf_model_config(path)
    assert cfg.architecture == arch and cfg.num_hidden_layers == 2 and cfg.num_experts == 16
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type == qtype
    if kind == "gpt-oss":  # hidden 2880 / 8 -> 320, windows on even layers, sinks, biases
        assert cfg.hidden_size == cfg.moe_intermediate_size == 320
        assert cfg.sliding_layers == (0,) and cfg.sliding_window == 128 and cfg.moe_bias
        assert "blk.0.attn_sinks.weight" in tensors and "blk.1.ffn_down_exps.bias" in tensors
    else:  # layer 0 dense, shared expert, sigmoid routing bias, partial rope
        assert cfg.hidden_size == 512 and cfg.moe_intermediate_size == 128
        assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
        assert "blk.1.exp_probs_b.bias" in tensors and "blk.1.ffn_up_shexp.weight" in tensors
        assert "blk.0.ffn_gate_exps.weight" not in tensors


@pytest.mark.parametrize(
    "args",
    [["moe", "--scale", "8", "--experts-type", "q4_0"], ["moe", "--scale", "8", "--experts-type", "q8_0"],
     ["dense", "--scale", "8"], ["dense", "--scale", "8", "--dense-type", "q4_k"],
     ["gpt-oss", "--scale", "8"], ["glm4moe", "--scale", "8"]],
    ids=["moe-q4_0", "moe-q8_0", "dense-bf16", "dense-q4_k", "gpt-oss-mxfp4", "glm4moe-q4_0"],
)  # fmt: skip
def test_generated_gguf_serves(tmp_path: Path, args: list[str]) -> None:
    path = tmp_path / "m.gguf"
    kind, *rest = args
    subprocess.run(
        [sys.executable, str(ROOT / "tools/peers/gen_gguf.py"), kind, str(path), "--layers", "2", *rest],
        check=True,
        capture_output=True,
    )  # fmt: skip
    if "--dense-type" in rest:  # the file's type label names what its matrices are
        ftype = gguf.GGUFReader(str(path)).fields["general.file_type"].parts[-1][0]
        assert ftype == gguf.LlamaFileType.MOSTLY_Q4_K_S
    if kind in SHAPED:
        _check_shape(path, kind)
    llm = LLM(str(path), dtype="float32", device="cpu")
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3

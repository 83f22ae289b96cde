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


@pytest.mark.parametrize(
    "args",
    [["moe", "--scale", "8", "--experts-type", "q4_0"], ["moe", "--scale", "8", "--experts-type", "q8_0"],
     ["dense", "--scale", "8"], ["dense", "--scale", "8", "--dense-type", "q4_k"]],
    ids=["moe-q4_0", "moe-q8_0", "dense-bf16", "dense-q4_k"],
)  # fmt: skip
def test_generated_gguf_serves(tmp_path: Path, args: list[str]) -> None:
    path = tmp_path / "m.gguf"
    kind, *rest = args
    subprocess.run(
        [sys.executable, str(ROOT / "tools/peers/gen_gguf.py"), kind, str(path), "--layers", "1", *rest],
        check=True,
        capture_output=True,
    )  # fmt: skip
    if "--dense-type" in rest:  # the file's type label names what its matrices are
        ftype = gguf.GGUFReader(str(path)).fields["general.file_type"].parts[-1][0]
        assert ftype == gguf.LlamaFileType.MOSTLY_Q4_K_S
    llm = LLM(str(path), dtype="float32", device="cpu")
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3

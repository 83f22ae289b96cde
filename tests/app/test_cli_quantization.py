"""`--quantization gptq|awq|fp8` from the command line: it serves an HF int4 checkpoint whose
config.json does not name its format, and an unserved format is a one-line error naming it."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from tandem.app.cli import main
from tests.models.hf_quant_cases import write_quantized

ARGV = ["generate", "--device", "cpu", "--dtype", "bfloat16", "--max-tokens", "2"]


def _word_tokenizer(path: Path) -> None:
    """A word-level tokenizer.json inside the checkpoint's 128-token vocabulary."""
    vocab = {"[UNK]": 0, "hi": 1, **{f"w{i}": i for i in range(2, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def test_quantization_names_the_format(tmp_path: Path, capsys) -> None:
    write_quantized(tmp_path, "awq", group=32, config_json=False)
    _word_tokenizer(tmp_path)
    capsys.readouterr()
    assert main([*ARGV, "--model", str(tmp_path), "--quantization", "awq", "hi"]) == 0
    capsys.readouterr()
    assert main([*ARGV, "--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: ") and "--quantization gptq or --quantization awq" in err


def test_unserved_format_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    write_quantized(tmp_path, "gptq", group=32)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main([*ARGV, "--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: ") and "\n" not in err and "GPTQ with 3-bit" in err

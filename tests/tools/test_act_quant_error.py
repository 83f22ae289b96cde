"""tools/act_quant_error.py on a tiny random Llama (config only, dummy weights, synthetic
tokenizer): one row per layer, both schemes' errors, and the row scale not the more accurate
of the two on average (a block's absmax is at most its row's: its steps are no coarser)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.models.config import ModelConfig  # noqa: E402
from tandem.models.hf_export import to_hf_config_dict  # noqa: E402
from tools import act_quant_error  # noqa: E402


def test_errors_per_layer(tmp_path: Path) -> None:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    out = tmp_path / "r.json"
    argv = ["--model", str(model), "--load-format", "dummy", "--repeat", "1", "--json", str(out)]
    assert act_quant_error.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["layer"] for r in res["layers"]] == [0, 1]
    assert all(0 < r["block32"] < 0.1 and 0 < r["row"] < 0.5 for r in res["layers"])
    assert res["mean"]["row"] >= res["mean"]["block32"]
    assert all(0 < r["row16"] < r["block32"] / 10 for r in res["layers"])  # the AMX int8 tiles

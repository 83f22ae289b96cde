"""tools/upcycle_moe.py: SmolLM2 turned into an 8-expert Mixtral computes the dense model's
function. The upcycled directory holds bf16 weights; the dense reference runs on the same
bf16-rounded weights in fp32, and the pool runs a fp32-activation ISA (avx2 or scalar), so the
only difference is summation order (the 1/8 routing weight and the x8 down scaling are exact):
greedy tokens must be equal. HF transformers loads the same directory and agrees.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tandem.ext.cpu import supported_isas
from tandem.runtime.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.llm import LLM
from tandem.runtime.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _tool():
    spec = importlib.util.spec_from_file_location("upcycle_moe", ROOT / "tools" / "upcycle_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory) -> Path:
    return _tool().upcycle(tmp_path_factory.mktemp("upcycled"), num_experts=8)


def _llm(**spec: object) -> LLM:
    ec = EngineConfig(
        model=ModelSpec(device="cpu", dtype="float32", **spec),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256),
    )
    return LLM(engine_config=ec)


def _greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _dense_bf16_weights() -> LLM:
    llm = _llm()  # the default model (GGUF)
    with torch.no_grad():
        for p in llm.engine.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return llm


def _check(upcycled: Path, monkeypatch, max_tokens: int) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx2" if "avx2" in supported_isas() else "scalar")
    config = json.loads((upcycled / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == config["num_experts_per_tok"] == 8
    dense = _greedy(_dense_bf16_weights(), max_tokens)
    moe_llm = _llm(model=str(upcycled), cpu_experts="all")
    assert moe_llm.tokenizer.chat_template  # tokenizer files came along
    backend = moe_llm.engine.model.expert_backend
    assert backend.name == "cpu_pool"
    assert _greedy(moe_llm, max_tokens) == dense
    stats = backend.stats()
    assert all(len(set(c)) == 1 for c in stats.routing_counts.values())  # all 8, equally
    backend.close()

    import transformers as hf

    model = hf.MixtralForCausalLM.from_pretrained(upcycled, dtype=torch.float32).eval()
    tok = hf.AutoTokenizer.from_pretrained(upcycled)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    assert ids[0].tolist() == moe_llm.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    assert out[0, ids.shape[1] :].tolist() == dense[0]


def test_upcycled_smollm2_equals_dense(upcycled: Path, monkeypatch) -> None:
    _check(upcycled, monkeypatch, max_tokens=4)


@pytest.mark.slow
def test_upcycled_smollm2_equals_dense_long(upcycled: Path, monkeypatch) -> None:
    _check(upcycled, monkeypatch, max_tokens=48)


def test_split_is_exact_for_one_mlp() -> None:
    """The arithmetic itself on random weights: experts summed with weight 1/E == dense MLP."""
    tool = _tool()
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
    down = torch.randn(16, 64, generator=g)
    x = torch.randn(5, 16, generator=g)
    dense = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T
    parts = dict(tool.split_mlp(3, gate, up, down, num_experts=4))
    assert parts["model.layers.3.block_sparse_moe.gate.weight"].abs().sum() == 0
    total = torch.zeros_like(dense)
    for e in range(4):
        w1, w3, w2 = (
            parts[f"model.layers.3.block_sparse_moe.experts.{e}.{w}.weight"]
            for w in ("w1", "w3", "w2")
        )
        total += 0.25 * (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T) @ w2.T)
    torch.testing.assert_close(total, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", ["attention_bias", "o_proj_bias", "mlp_bias"])
def test_dense_models_with_biases_are_refused(bias: str) -> None:
    """Mixtral has no attention or MLP biases: upcycling a model with them would drop them."""
    import dataclasses

    from tandem.models.config import ModelConfig

    dense = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    assert _tool().moe_config(dense, 4).num_experts == 4
    with pytest.raises(ValueError, match=bias):
        _tool().moe_config(dataclasses.replace(dense, **{bias: True}), 4)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--experts", "0"], "argument --experts: expected an integer >= 1, got '0'"),
        (["--experts", "-2"], "argument --experts: expected an integer >= 1, got '-2'"),
        (["--model", "MISSING"], "error: no config.json in"),
    ],
)
def test_bad_input_is_an_error_line_not_a_traceback(args, says: str, tmp_path: Path, capsys):
    """--experts 0 was a ZeroDivisionError traceback, -2 a torch RuntimeError, a missing
    --model a FileNotFoundError one; now an `error:` line and exit 2, with nothing written."""
    args = [str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        _tool().main([str(out), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not out.exists()

"""MoE placement options that cannot apply give one clear `tandem: error:` line (exit 2),
before any weight is read: a dense model, more experts than a layer has, experts "on the GPU"
without one, a non-number, a CUDA device on a machine without CUDA, the pool's format or threads
without the pool, more pool threads than cpus, a --gpu-prefill token count without a GPU (it
was silently ignored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.app.cli import main
from tandem.models.config import ModelConfig
from tandem.models.hf_export import to_hf_config_dict

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
)  # fmt: skip


def _config_dir(path: Path, **kw) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(to_hf_config_dict(ModelConfig(**COMMON, **kw))))
    return path


@pytest.fixture
def moe_dir(tmp_path: Path) -> Path:
    return _config_dir(
        tmp_path / "moe", architecture="Qwen3MoeForCausalLM", num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip


@pytest.fixture
def dense_dir(tmp_path: Path) -> Path:
    return _config_dir(tmp_path / "dense", architecture="LlamaForCausalLM")


def _error(capsys, *args: str) -> str:
    argv = ["generate", "--load-format", "dummy", "--device", "cpu", "--max-tokens", "2"]
    assert main([*argv, *args, "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--cpu-experts", "999"), "exceeds the 8 experts"),
        (("--cpu-experts", "all", "--gpu-experts", "9"), "exceeds the 8 experts"),
        (("--cpu-experts", "foo"), "cpu_experts must be 'all' or a non-negative int"),
        (("--cpu-experts", "0"), "on the GPU, but the model runs on cpu"),
        (("--cpu-experts", "5"), "on the GPU, but the model runs on cpu"),
        (("--gpu-experts", "5"), "on the GPU, but the model runs on cpu"),
        (("--cpu-experts", "all", "--cpu-expert-group-size", "32"), "applies to int4 experts"),
        (("--cpu-experts", "all", "--gpu-prefill", "512"), "--gpu-prefill 512 computes the pool's"),
        (("--gpu-prefill", "512"), "--gpu-prefill only apply to the CPU expert pool"),
        (
            (
                "--cpu-experts",
                "all",
                "--cpu-expert-format",
                "int8",
                "--cpu-expert-group-size",
                "64",
            ),
            "applies to int4",
        ),
    ],
)
def test_bad_moe_options_are_one_line_errors(capsys, moe_dir: Path, args, says: str) -> None:
    assert says in _error(capsys, "--model", str(moe_dir), *args)


def test_more_pool_threads_than_cpus_is_an_error(capsys, moe_dir: Path) -> None:
    """Workers past the process's cpus share them (999 on 2 cpus decoded ~8x slower)."""
    from tandem.runtime.engine_setup import allowed_cpu_count

    too_many = str(allowed_cpu_count() + 1)
    err = _error(capsys, "--model", str(moe_dir), "--cpu-experts", "all", "--cpu-threads", too_many)
    assert f"--cpu-threads {too_many} exceeds the {allowed_cpu_count()} cpus" in err


def test_expert_options_on_a_dense_model_are_an_error(capsys, dense_dir: Path) -> None:
    assert "dense" in _error(capsys, "--model", str(dense_dir), "--cpu-experts", "all")
    assert "dense" in _error(capsys, "--model", str(dense_dir), "--gpu-experts", "0")
    assert "dense" in _error(capsys, "--model", str(dense_dir), "--cpu-expert-format", "int4")
    assert "dense" in _error(capsys, "--model", str(dense_dir), "--gpu-prefill", "512")


@pytest.mark.parametrize(
    "args", [("--cpu-expert-format", "int4"), ("--cpu-threads", "2"), ("--cpu-expert-format", "int8", "--cpu-threads", "1"),
             ("--cpu-expert-format", "int4", "--cpu-expert-group-size", "32")]
)  # fmt: skip
def test_pool_options_without_the_pool_are_an_error(capsys, moe_dir: Path, args) -> None:
    """Without --cpu-experts the experts run in torch: an int4 format or a thread count given
    alone would be dropped silently (full-width experts, maybe out of memory), so it is an error
    that says what selects the pool. With ModelSpec(expert_backend="cpu_pool") they apply."""
    err = _error(capsys, "--model", str(moe_dir), *args)
    assert "only apply to the CPU expert pool" in err and "--cpu-experts all" in err
    from tandem.runtime.config import ModelSpec
    from tandem.runtime.engine_setup import check_expert_options

    cfg = ModelConfig(**COMMON, architecture="Qwen3MoeForCausalLM", num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    spec = ModelSpec(expert_backend="cpu_pool", cpu_expert_format="int4", cpu_threads=1)
    check_expert_options(spec, torch.device("cpu"), cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_an_error(capsys, moe_dir: Path) -> None:
    err = _error(capsys, "--model", str(moe_dir), "--device", "cuda", "--cpu-experts", "all")
    assert "no CUDA device" in err


def test_good_options_still_run(capsys, moe_dir: Path) -> None:
    argv = ["generate", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32"]
    for experts in ("all", "ALL", "8"):
        args = ["--model", str(moe_dir), "--max-tokens", "2", "--cpu-experts", experts]
        assert main([*argv, *args, "hi"]) == 0
    pool = ["--cpu-experts", "all", "--cpu-expert-format", "int4", "--cpu-threads", "1"]
    assert main([*argv, "--model", str(moe_dir), "--max-tokens", "2", *pool, "hi"]) == 0
    for gpu_prefill in ("off", "0", "auto"):  # nothing on the GPU: accepted without one
        pool = ["--cpu-experts", "all", "--gpu-prefill", gpu_prefill]
        assert main([*argv, "--model", str(moe_dir), "--max-tokens", "2", *pool, "hi"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("group", [None, 32])
def test_int4_group_size_reaches_the_pool(moe_dir: Path, group: int | None) -> None:
    """--cpu-expert-group-size: the pool's int4 layers take it (default 64)."""
    from tandem.runtime.config import EngineConfig, ModelSpec
    from tandem.runtime.llm import LLM

    spec = ModelSpec(model=str(moe_dir), load_format="dummy", device="cpu", dtype="float32",
                     cpu_experts="all", cpu_expert_format="int4", cpu_expert_group_size=group)  # fmt: skip
    backend = LLM(engine_config=EngineConfig(model=spec)).engine.model.expert_backend
    layers = sorted(backend._num_experts)
    assert layers and {backend.pool.layer_format(i) for i in layers} == {("int4", group or 64)}


def test_no_cpu_pool_build_is_a_one_line_error(capsys, moe_dir: Path, monkeypatch) -> None:
    """No compiler (or a failed build) with --cpu-experts all: one line, not a traceback."""
    from tandem.ext.cpu import CpuExtensionError
    from tandem.ext.cpu import pool as pool_mod

    def no_compiler():
        raise CpuExtensionError("no C++ compiler found (set CXX or install g++)")

    monkeypatch.setattr(pool_mod, "load_extension", no_compiler)
    err = _error(capsys, "--model", str(moe_dir), "--cpu-experts", "all")
    assert "CPU expert pool is unavailable: no C++ compiler" in err


def test_expert_format_defaults_to_the_checkpoints_own() -> None:
    """--cpu-expert-format auto (the default): a GGUF's Q4_0/Q8_0 experts stay int4/int8 in the
    pool (models/loader/gguf_experts.AUTO_FORMATS) instead of widening to bf16."""
    from tandem.app.cli import build_parser
    from tandem.runtime.config import ModelSpec

    for command in (["generate", "hi"], ["serve"], ["chat"]):
        assert build_parser().parse_args(command).cpu_expert_format == "auto"
    assert ModelSpec().cpu_expert_format == "auto"


def test_zero_cpu_experts_from_python_is_not_all() -> None:
    """ModelSpec(cpu_experts=0) (an int, from the Python API) means no expert on the pool, not
    "all": on a CPU-only machine that leaves experts on a missing GPU."""
    from tandem.models.config import ModelConfig
    from tandem.runtime.config import ModelSpec
    from tandem.runtime.engine_setup import check_expert_options

    cfg = ModelConfig(**COMMON, architecture="Qwen3MoeForCausalLM", num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    with pytest.raises(ValueError, match="8 experts a layer would stay on the GPU"):
        check_expert_options(ModelSpec(cpu_experts=0), torch.device("cpu"), cfg)
    check_expert_options(ModelSpec(cpu_experts="all"), torch.device("cpu"), cfg)


@pytest.mark.parametrize("threads", [0, -3, 2.5, "4", True])
def test_cpu_threads_from_python_is_checked_by_name(threads) -> None:
    """ModelSpec(cpu_threads=...) from the Python API (the CLI's argparse checks its own) is
    refused before any weight is read, naming the option, not the pool's num_threads."""
    from tandem.models.config import ModelConfig
    from tandem.runtime.config import ModelSpec
    from tandem.runtime.engine_setup import check_expert_options

    cfg = ModelConfig(**COMMON, architecture="Qwen3MoeForCausalLM", num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    with pytest.raises(ValueError, match="--cpu-threads must be a positive integer"):
        check_expert_options(
            ModelSpec(cpu_experts="all", cpu_threads=threads), torch.device("cpu"), cfg
        )
    check_expert_options(ModelSpec(cpu_experts="all", cpu_threads=1), torch.device("cpu"), cfg)

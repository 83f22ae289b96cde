"""Start-up decisions of runtime/engine_setup.py: which tokenizer an engine gets, and an engine
on a directory that holds only a config.json (`--load-format dummy`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.models.config import ModelConfig
from tandem.models.hf_export import to_hf_config_dict
from tandem.models.tokenizer import Tokenizer
from tandem.runtime import LLM, SamplingParams
from tandem.runtime.config import EngineConfig, ModelSpec, SchedulerConfig
from tandem.runtime.engine_setup import load_tokenizer, resolve_max_model_len, resolve_tokenizer


@pytest.fixture
def config_only_dir(tmp_path: Path) -> Path:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return tmp_path


def test_dummy_weights_without_tokenizer_files_get_a_synthetic_tokenizer(
    config_only_dir: Path,
) -> None:
    tok = load_tokenizer(config_only_dir, "dummy", 512)
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 512
    # real weights without a tokenizer stay token-ids-only: made-up text would mislead
    assert load_tokenizer(config_only_dir, "safetensors", 512) is None
    assert load_tokenizer(config_only_dir) is None


def test_engine_on_a_config_only_directory_generates_text(config_only_dir: Path) -> None:
    llm = LLM(
        engine_config=EngineConfig(
            model=ModelSpec(
                model=str(config_only_dir), load_format="dummy", device="cpu", dtype="float32"
            ),
            scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=128),
        )
    )
    assert llm.engine.model_name == config_only_dir.name
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    by_text, by_ids = llm.generate(["hello", [104, 101, 108, 108, 111]], params)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 6
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids) and by_text.text
    (chat,) = llm.chat([{"role": "user", "content": "hello"}], params)
    assert len(chat.token_ids) == 6


def test_pool_threads_that_would_starve_the_engine_are_clamped(caplog) -> None:
    import logging

    import torch

    from tandem.runtime.engine_setup import clamp_pool_threads

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    caplog.set_level(logging.WARNING)
    # before: 16 of 16 cores on CUDA were taken as asked, and hybrid decode fell 60 -> 3.6 tok/s
    assert clamp_pool_threads(16, cuda, cpus=16) == 14
    assert "using 14" in caplog.text and "16 cpus" in caplog.text
    assert clamp_pool_threads(16, cpu, cpus=16) == 15
    assert clamp_pool_threads(14, cuda, cpus=16) == 14  # what is left over: as asked
    assert clamp_pool_threads(2, cuda, cpus=2) == 1  # never below one worker
    assert clamp_pool_threads(None, cuda, cpus=16) is None  # the pool's own default


def _positions(n: int, window: int | None = None) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=n, sliding_window=window,
    )  # fmt: skip


def test_max_model_len_defaults_to_the_model_and_refuses_more() -> None:
    assert resolve_max_model_len(None, _positions(8192)) == 8192
    assert resolve_max_model_len(1000, _positions(8192)) == 1000
    assert resolve_max_model_len(8192, _positions(8192)) == 8192
    with pytest.raises(ValueError, match=r"--max-model-len 100000 is more than this model allows"):
        resolve_max_model_len(100000, _positions(8192))
    # sliding windows are computed as windows: the positions still bound the length
    assert resolve_max_model_len(None, _positions(4096, window=1024)) == 4096


def test_default_max_model_len_is_capped_by_the_kv_cache(caplog) -> None:
    from tests.app.tiny_engine import TinyTokenizer, make_tiny_engine

    tok = TinyTokenizer()
    assert make_tiny_engine(tok, num_blocks=512, max_model_len=None).max_model_len == 512
    with caplog.at_level("WARNING"):
        engine = make_tiny_engine(tok, num_blocks=20, block_size=4, max_model_len=None)
    assert engine.max_model_len == 19 * 4  # one block spare, as for an explicit length
    assert "capped at 76 tokens, what the KV cache holds" in caplog.text
    with pytest.raises(ValueError, match="KV cache too small"):  # asked for: refused, not cut
        make_tiny_engine(tok, num_blocks=20, block_size=4, max_model_len=400)


def test_tokenizer_path_and_chat_template_override(config_only_dir: Path, tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    Tokenizer.synthetic(512).backend.save(str(tok_dir / "tokenizer.json"))

    def spec(**kw) -> EngineConfig:
        return EngineConfig(
            model=ModelSpec(
                model=str(config_only_dir), load_format="safetensors", device="cpu", **kw
            ),
            scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=64),
        )

    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    with pytest.raises(FileNotFoundError, match="tokenizer path"):
        resolve_tokenizer(spec(tokenizer_path=str(tmp_path / "nope")).model, None, 512)
    with pytest.raises(ValueError, match="no tokenizer in"):
        resolve_tokenizer(spec(tokenizer_path=str(config_only_dir)).model, None, 512)
    tok = resolve_tokenizer(
        spec(tokenizer_path=str(tok_dir), chat_template=template).model, config_only_dir, 512
    )
    assert tok is not None and tok.vocab_size == 512
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    with pytest.raises(ValueError, match="--chat-template does not compile"):
        resolve_tokenizer(
            spec(tokenizer_path=str(tok_dir), chat_template="{% for %}").model, None, 512
        )
    with pytest.raises(ValueError, match="needs a tokenizer"):  # real weights, no tokenizer
        resolve_tokenizer(spec(chat_template=template).model, config_only_dir, 512)


def test_engine_seed_makes_unseeded_sampling_repeat(config_only_dir: Path) -> None:
    def sample(seed: int) -> list[int]:
        llm = LLM(
            engine_config=EngineConfig(
                model=ModelSpec(
                    model=str(config_only_dir), load_format="dummy", device="cpu", dtype="float32"
                ),
                scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=64),
                seed=seed,
            )
        )
        params = SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True)
        return list(llm.generate([[5, 6, 7]], params)[0].token_ids)

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"sliding_window": 32, "sliding_layers": (0, 1)},  # Mistral-like: every layer
        {"sliding_window": 32, "sliding_layers": (0,), "attention_sinks": True},  # GPT-OSS-like
    ],
)
def test_cuda_picks_the_cupy_kernels_for_windows_and_sinks(monkeypatch, extra) -> None:
    """The CUDA kernels read windows and sinks: windowed models take them on CUDA (not the
    torch reference); where the kernels do not serve the head_dim, torch."""
    import torch

    import tandem.models.cupy_backend as cupy_backend
    from tandem.runtime.engine_setup import _auto_attention_backend

    monkeypatch.setattr(
        cupy_backend, "cupy_backend_supports", lambda head_dim, dtype, device: head_dim == 64
    )
    cuda = torch.device("cuda")
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, **extra,
    )  # fmt: skip
    assert _auto_attention_backend(cuda, torch.bfloat16, cfg) == "cupy"
    narrow = ModelConfig(**{**cfg.__dict__, "head_dim": 16})
    assert _auto_attention_backend(cuda, torch.bfloat16, narrow) == "torch"
    if extra:  # the CPU's C++ kernel has neither: the torch reference there
        assert _auto_attention_backend(torch.device("cpu"), torch.bfloat16, cfg) == "torch"

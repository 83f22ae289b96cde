"""tools/bench_serving.py against a real listening server on the FakeEngine: exact token
counts from usage, one TTFT and output-1 ITL gaps per request, SLO goodput, the /health probe,
the sweep's JSON and PNG."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tandem.app.config import ServerConfig
from tandem.app.serve import RunningServer, start_server
from tests.app.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]


def load_tool():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "tools" / "bench_serving.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = load_tool()


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    engine = FakeEngine(max_model_len=4096, max_num_seqs=8, step_delay=0.002)
    engine.tokenizer.vocab_size = 40000  # token-id prompts of the tool's range are valid
    running = await start_server(ServerConfig(port=0), engine)
    yield running
    await running.shutdown(timeout=5)


def parse(server: RunningServer, *extra: str) -> argparse.Namespace:
    args = bench.build_parser().parse_args(
        [
            "--base-url",
            f"http://127.0.0.1:{server.port}",
            "--tokenizer",
            "none",
            "--warmup",
            "0",
            *extra,
        ]
    )
    return args


async def test_random_dataset_counts_are_exact(server: RunningServer) -> None:
    args = parse(
        server,
        "--num-prompts",
        "12",
        "--input-len",
        "20",
        "--output-len",
        "9",
        "--max-concurrency",
        "4",
        "--health-probe",
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
    )
    result = await bench.main_async(args)
    (run,) = result["runs"]
    assert result["model"] == "fake-model"
    assert (run["completed"], run["failed"]) == (12, 0)
    assert run["total_input_tokens"] == 12 * 20
    assert run["total_output_tokens"] == 12 * 9
    assert run["goodput"] == pytest.approx(run["request_throughput"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = run[key]
        assert 0 < s["median"] <= s["p99"] and s["mean"] > 0, (key, s)
    assert run["e2e_ms"]["median"] >= run["ttft_ms"]["median"]
    assert run["health"]["samples"] >= 1 and run["health"]["failures"] == 0


async def test_tight_slo_lowers_goodput_and_send_measures_each_chunk(server: RunningServer) -> None:
    args = parse(server, "--num-prompts", "4", "--output-len", "6", "--slo-ttft-ms", "0.001")
    (run,) = (await bench.main_async(args))["runs"]
    assert run["completed"] == 4 and run["goodput"] == 0.0
    import aiohttp

    req = bench.BenchRequest("completions", prompt=[200, 201, 202], max_tokens=7)
    async with aiohttp.ClientSession() as http:
        r = await bench.send(http, args.base_url, "fake-model", req, {})
    assert r.ok and r.output_tokens == 7 and r.prompt_tokens == 3
    assert len(r.itl) <= 6 and all(g >= 0 for g in r.itl)  # chunks may coalesce tokens
    assert r.tpot is not None and r.tpot > 0


async def test_conversation_sweep_writes_json_and_plot(
    server: RunningServer, tmp_path: Path
) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    argv = [
        "--base-url",
        f"http://127.0.0.1:{server.port}",
        "--dataset",
        "conversation",
        "--num-prompts",
        "3",
        "--output-len",
        "6",
        "--sweep-concurrency",
        "1,4",
        "--warmup",
        "0",
        "--result-json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    args = bench.build_parser().parse_args(argv)
    result = await bench.main_async(args)
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 4]
    assert [r["num_prompts"] for r in result["runs"]] == [3, 4]  # at least one per slot
    for run in result["runs"]:
        assert run["failed"] == 0 and run["total_input_tokens"] > 0
        assert 3 * run["num_prompts"] <= run["total_output_tokens"] <= 9 * run["num_prompts"]
    bench.plot_sweep(result["runs"], str(out_png), "test")
    out_json.write_text(json.dumps(result, default=str))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out_json.read_text())["runs"][1]["max_concurrency"] == 4


def test_percentile_interpolates() -> None:
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([5.0], 99) == 5.0
    assert math.isclose(bench.percentile(list(map(float, range(101))), 99), 99.0)


async def test_sweep_num_prompts_per_level_and_json_after_each_level(
    server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_json = tmp_path / "r.json"
    written: list[int] = []
    write_json = bench.write_json

    def spy(path: str, result: dict) -> None:
        write_json(path, result)
        written.append(len(json.loads(Path(path).read_text())["runs"]))

    monkeypatch.setattr(bench, "write_json", spy)
    args = parse(
        server,
        *("--input-len", "5", "--output-len", "3", "--sweep-concurrency", "1,4"),
        *("--sweep-num-prompts", "2,9", "--result-json", str(out_json)),
    )
    result = await bench.main_async(args)
    assert [r["num_prompts"] for r in result["runs"]] == [2, 9]
    assert [r["total_output_tokens"] for r in result["runs"]] == [6, 27]
    assert written == [1, 2]  # a sweep cut short keeps the levels it finished
    bad = parse(server, "--sweep-concurrency", "1,4", "--sweep-num-prompts", "2")
    with pytest.raises(ValueError, match="1 counts for 2 levels"):
        await bench.main_async(bad)


def test_plot_falls_back_to_svg_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xml.etree.ElementTree as ET

    runs = [
        {
            "max_concurrency": c,
            "ttft_ms": {"p50": 10.0 * c, "p99": 20.0 * c},
            "tpot_ms": {"p50": 2.0, "p99": None},
            "output_throughput": 100.0 * c,
        }
        for c in (1, 16, 256)
    ]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = bench.plot_sweep(runs, str(tmp_path / "sweep.png"), "a <title> & more")
    assert path == str(tmp_path / "sweep.svg") and not (tmp_path / "sweep.png").exists()
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    # TTFT p50 + p99, TPOT p50 (p99 missing), output tok/s
    assert len(root.findall(f"{ns}polyline")) == 4
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "a <title> & more" in texts and "28,160" in texts and "256" in texts  # ymax = 1.1 x max


async def test_warmup_and_levels_never_repeat_a_prompt(server: RunningServer, monkeypatch) -> None:
    """A prompt sent twice would be served from the prefix cache the second time: the warm-up
    and each sweep level draw fresh prompts from one seeded stream."""
    sent: list[tuple[int, ...]] = []
    real = bench.run_load

    async def recording(args, requests, *rest):  # noqa: ANN001, ANN202
        sent.extend(tuple(r.prompt) for r in requests)
        return await real(args, requests, *rest)

    monkeypatch.setattr(bench, "run_load", recording)
    args = parse(server, "--input-len", "8", "--output-len", "2", "--sweep-concurrency", "1,2")
    args.warmup, args.sweep_num_prompts = 2, "3,4"
    result = await bench.main_async(args)
    assert [r["completed"] for r in result["runs"]] == [3, 4]
    assert len(sent) == 2 + 3 + 4 and len(set(sent)) == len(sent)
    again: list[tuple[int, ...]] = []
    sent, first = again, sent
    await bench.main_async(args)
    assert again == first  # still reproducible from --seed

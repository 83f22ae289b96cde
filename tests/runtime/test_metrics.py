from __future__ import annotations

from tandem.models.layers.cpu_pool_stats import HybridMoeStats
from tandem.runtime.metrics import ServingMetrics, render_metrics
from tandem.runtime.types import EngineStats


def test_hybrid_counters_appear_only_for_a_hybrid_engine():
    dense = render_metrics(EngineStats(num_steps=3), ServingMetrics(), num_admitted=0, healthy=True)
    assert "tandem:num_steps_total 3" in dense and "moe_" not in dense
    h = HybridMoeStats(
        layer_calls=4,
        pool_wait_seconds=0.25,
        d2h_bytes=1024,
        h2d_bytes=2048,
        pool_threads=15,
        pool_busy_seconds=3.0,
        wall_seconds=1.0,
        stream_errors=2,
        routing_counts={0: [5, 0, 2], 1: [1, 1, 1]},
    )
    text = render_metrics(EngineStats(hybrid=h), ServingMetrics(), num_admitted=0, healthy=True)
    assert "tandem:moe_pool_wait_seconds_total 0.25" in text
    assert "tandem:moe_layer_calls_total 4" in text
    assert "tandem:moe_device_to_host_bytes_total 1024" in text
    assert "tandem:moe_host_to_device_bytes_total 2048" in text
    assert "tandem:moe_pool_utilisation 0.2" in text
    assert "tandem:moe_stream_errors_total 2" in text  # a failed CUDA-stream call is not silent
    assert 'tandem:moe_expert_routed_total{expert="0",layer="0"} 5' in text
    assert 'tandem:moe_expert_routed_total{expert="2",layer="1"} 1' in text
    # every sample line belongs to a declared metric family
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            family = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
            assert name in declared or family in declared, line


def test_cuda_runner_counters_appear_only_for_a_cuda_runner():
    cpu = render_metrics(EngineStats(num_steps=3), ServingMetrics(), num_admitted=0, healthy=True)
    assert "cuda_" not in cpu
    stats = EngineStats(
        graph_steps=7,
        eager_steps=2,
        runner_fallbacks={"graph_capture_failed": 1, "prefill_recompile": 3},
    )
    text = render_metrics(stats, ServingMetrics(), num_admitted=0, healthy=True)
    assert "tandem:cuda_graph_steps_total 7" in text
    assert "tandem:cuda_eager_steps_total 2" in text
    assert 'tandem:cuda_runner_fallbacks_total{reason="graph_capture_failed"} 1' in text
    assert 'tandem:cuda_runner_fallbacks_total{reason="prefill_recompile"} 3' in text
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            assert any(name == d or name.startswith(d + "_") for d in declared), line

"""tools/peers/cpu_bandwidth: the compiled read-bandwidth probe behind every CPU floor."""

from __future__ import annotations

import subprocess

import pytest

from tools.peers import cpu_bandwidth


def test_parse_reads_the_isa_and_one_rate_per_thread_count() -> None:
    out = "# isa avx2, buffer 2.000 GB, best of 5 passes\n1 11.50\n8 63.25\n"
    assert cpu_bandwidth.parse(out) == ("avx2", {1: 11.5, 8: 63.25})


def test_probe_builds_once_and_measures_a_positive_rate(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    binary = cpu_bandwidth.build()
    assert cpu_bandwidth.build() == binary  # cached by source and flags
    isa, rates = cpu_bandwidth.measure([1, 2], gigabytes=0.05, passes=1)
    assert isa in {"avx512", "avx2", "scalar"}
    assert set(rates) == {1, 2} and all(0 < r < 10_000 for r in rates.values())


def test_probe_refuses_bad_arguments(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    binary = str(cpu_bandwidth.build())
    for args in ([], ["0.05", "0"], ["0.000001", "1"]):
        assert subprocess.run([binary, *args], capture_output=True).returncode == 2
    with pytest.raises(RuntimeError, match="probe failed"):
        cpu_bandwidth.measure([0], gigabytes=0.05)

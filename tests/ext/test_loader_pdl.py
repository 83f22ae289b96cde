"""ext/cuda/_loader's programmatic-dependent-launch path on the CPU: the launch structs match
cuda.h's layout, a `pdl` launch goes through cuLaunchKernelEx only where it may, and a failing
driver call falls back to a plain launch (once, for the rest of the process)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tandem.ext.cuda import _loader


def test_launch_structs_match_cuda_h() -> None:
    # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union; CUlaunchConfig: six
    # uints, sharedMemBytes, then the stream, attrs pointer and count at 8-byte alignment.
    assert ctypes.sizeof(_loader._LaunchAttribute) == 72
    assert _loader._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_loader._LaunchConfig) == 56
    assert _loader._LaunchConfig.stream.offset == 32
    assert _loader._LaunchConfig.attrs.offset == 40
    assert _loader._LaunchConfig.num_attrs.offset == 48


@pytest.fixture
def fake_launches(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(_loader, "get_kernel", lambda f, n, i: object())
    monkeypatch.setattr(_loader, "_launch", lambda *a: calls.append("plain"))
    monkeypatch.setattr(_loader, "_pdl_ok", lambda i: _loader.PDL["on"])
    monkeypatch.setitem(_loader.PDL, "on", True)
    return calls


def _go(**kw) -> None:
    args = (np.uint64(0), np.int32(1), np.int64(2), np.float32(3.0))
    _loader.launch("x.cu", "k", torch.device("cuda", 0), (1, 1, 1), (32, 1, 1), args, **kw)


def test_pdl_launch_only_when_asked_and_without_dynamic_shared_memory(fake_launches, monkeypatch):
    monkeypatch.setattr(_loader, "_launch_pdl", lambda *a: fake_launches.append("pdl"))
    _go()
    _go(pdl=True)
    _go(pdl=True, shared_mem=1024)
    assert fake_launches == ["plain", "pdl", "plain"]


def test_failing_driver_call_falls_back_to_plain_launches(fake_launches, monkeypatch):
    def broken(*a):
        fake_launches.append("pdl")
        raise RuntimeError("cuLaunchKernelEx returned CUresult 1")

    monkeypatch.setattr(_loader, "_launch_pdl", broken)
    _go(pdl=True)
    _go(pdl=True)
    assert fake_launches == ["pdl", "plain", "plain"]
    assert _loader.PDL["on"] is False

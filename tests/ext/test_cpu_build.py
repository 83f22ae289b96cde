"""ext/cpu/build.py: an ISA unit that fails to compile is left out with a warning naming the
ISA, its file and the compiler's first errors (and so are the units that need it), not
silently; the core units are still built and linked."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tandem.ext.cpu import build as cpu_build


def test_first_errors_are_the_compilers_first_error_lines(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f() { return undeclared_a; }\nint g() { return undeclared_b; }\n")
    with pytest.raises(cpu_build.CpuExtensionError) as info:
        cpu_build._run([cpu_build._compiler(), "-c", str(bad), "-o", str(tmp_path / "bad.o")])
    first = cpu_build.first_errors(info.value)
    assert "undeclared_a" in first and "error" in first, first
    assert first.index("undeclared_a") < first.index("undeclared_b"), first


def test_a_unit_that_fails_to_compile_is_named_in_a_warning(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The compiler is faked: kernels_vnni.cpp fails with a real-looking error, every other
    command succeeds; the AMX int8 unit needs VNNI's and is left out too."""
    if not cpu_build._is_x86():
        pytest.skip("the ISA units are x86 only")  # pragma: no cover
    compiled: list[str] = []

    def fake_run(cmd: list[str]) -> None:
        out = cmd[cmd.index("-o") + 1]
        if "-c" in cmd:
            src = Path(cmd[cmd.index("-c") + 1]).name
            if src == "kernels_vnni.cpp":
                raise cpu_build.CpuExtensionError(
                    f"command failed (1): {' '.join(cmd)}\n"
                    "kernels_vnni.cpp: In function 'void f()':\n"
                    "kernels_vnni.cpp:12:3: error: '_mm512_dpbusd_epi32' was not declared\n"
                    "kernels_vnni.cpp:40:1: error: expected ';' before '}' token\n"
                    "compilation terminated.\n"
                )
            compiled.append(src)
        Path(out).write_bytes(b"")

    monkeypatch.setattr(cpu_build, "_run", fake_run)
    monkeypatch.setattr(cpu_build, "_include_dirs", lambda: [])
    target = tmp_path / "lib" / "_tandem_cpu.so"
    target.parent.mkdir()
    with caplog.at_level(logging.WARNING, logger=cpu_build.log.name):
        skipped = cpu_build._build("g++", target)
    assert target.exists() and "moe_step.cpp" in compiled and "kernels_amx.cpp" in compiled
    assert "kernels_vnni.cpp" not in compiled and "kernels_amx_int8.cpp" not in compiled
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    vnni = [w for w in warnings if "kernels_vnni.cpp" in w]
    assert len(vnni) == 1 and "vnni" in vnni[0].split("(")[0], warnings
    assert "error: '_mm512_dpbusd_epi32' was not declared" in vnni[0]
    assert "expected ';'" in vnni[0]  # the second error line too
    amx_int8 = [w for w in warnings if "kernels_amx_int8.cpp" in w]
    assert len(amx_int8) == 1 and "needs the vnni kernels" in amx_int8[0], warnings
    assert len(skipped) == 2 and all(os.sep not in s.split(":")[0] for s in skipped)

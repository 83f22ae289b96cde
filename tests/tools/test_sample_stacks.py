"""tools/sample_stacks.py: a program run under it leaves a report naming its threads, the
functions they spent their samples in, and their CPU seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import threading, time

def spin_here(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))

t = threading.Thread(target=spin_here, args=(0.6,), name="busy-worker")
t.start()
t.join()
"""


def test_report_names_the_busy_thread_and_its_function(tmp_path: Path) -> None:
    script, out = tmp_path / "prog.py", tmp_path / "prof.txt"
    script.write_text(PROGRAM)
    subprocess.run(
        [sys.executable, str(ROOT / "tools/sample_stacks.py"), "--out", str(out),
         "--interval-ms", "1", str(script)],
        check=True, timeout=60,
    )  # fmt: skip
    text = out.read_text()
    block = text.split("== thread busy-worker:")[1].split("== thread")[0]
    samples = int(block.split()[0])
    assert samples > 50
    assert "s of CPU" in block.splitlines()[0]
    self_part = block.split("-- self")[1].split("-- inclusive")[0]
    top = self_part.strip().splitlines()[0]
    assert "spin_here (prog.py:4)" in top and float(top.split("%")[0]) > 50

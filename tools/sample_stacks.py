#!/usr/bin/env python3
"""Runs a Python module (`-m`) or script with a sampling profiler of every thread, standard
library only: a daemon thread reads `sys._current_frames()` every --interval-ms and, when the
program exits (a served `tandem serve` on SIGTERM included), writes per thread the functions
seen on top of the stack (self) and anywhere in it (inclusive), as % of that thread's samples,
and the CPU seconds each thread used (Linux: /proc/self/task). A thread in C (idle in its event
loop's poll, or working in a C library) shows the Python function that called into C, so the
CPU seconds tell idle from busy.

    python tools/sample_stacks.py --out prof.txt -m tandem.app.cli serve MODEL ...
    python tools/sample_stacks.py --out prof.txt script.py ARGS...
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import runpy
import sys
import threading
import time
from pathlib import Path


class StackSampler:
    """Samples every other thread's Python stack; `report` aggregates per thread name."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.samples: collections.Counter[str] = collections.Counter()
        self.self_hits: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.incl_hits: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.cpu_s: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        me = threading.get_ident()
        last_cpu = 0.0
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - last_cpu > 0.5:  # threads that end take their /proc entry along
                self.cpu_s.update(self.thread_cpu_s())
                last_cpu = time.monotonic()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, f"thread-{ident}")
                self.samples[name] += 1
                seen: set[str] = set()
                top = True
                while frame is not None:
                    code = frame.f_code
                    key = f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno})"
                    if top:
                        self.self_hits[name][key] += 1
                        top = False
                    if key not in seen:
                        self.incl_hits[name][key] += 1
                        seen.add(key)
                    frame = frame.f_back

    @staticmethod
    def thread_cpu_s() -> dict[str, float]:
        """CPU seconds (user + system) of every live thread, by name; {} off Linux."""
        out: dict[str, float] = {}
        for t in threading.enumerate():
            try:
                fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1]
            except OSError:
                continue
            utime, stime = fields.split()[11:13]
            out[t.name] = (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
        return out

    def report(self, top: int) -> str:
        lines = [f"# sampled every {1e3 * self.interval_s:g} ms"]
        cpu = {**self.cpu_s, **self.thread_cpu_s()}
        for name, n in self.samples.most_common():
            used = f", {cpu[name]:.1f} s of CPU" if name in cpu else ""
            lines.append(f"\n== thread {name}: {n} samples{used}")
            for title, hits in (
                ("self", self.self_hits[name]),
                ("inclusive", self.incl_hits[name]),
            ):
                lines.append(f"-- {title}")
                for key, c in hits.most_common(top):
                    lines.append(f"{100 * c / n:6.1f}%  {key}")
        return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interval-ms", type=float, default=2.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("-m", dest="module", default=None)
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    sampler = StackSampler(a.interval_ms / 1e3)
    t0 = time.perf_counter()

    def write() -> None:
        sampler.stop()
        a.out.write_text(f"# wall {time.perf_counter() - t0:.1f} s\n" + sampler.report(a.top))

    atexit.register(write)
    sampler.start()
    if a.module:
        sys.argv = [a.module, *a.args]
        runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = a.args
        runpy.run_path(a.args[0], run_name="__main__")


if __name__ == "__main__":
    main()

"""docs/configuration.md names every TANDEM_* environment variable the code reads and every
flag of the `tandem` commands; the README's links resolve."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tandem.app.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DOC = (ROOT / "docs" / "configuration.md").read_text()
# C++ preprocessor macros of ext/cpu, set by the build: not environment variables
MACROS = {"TANDEM_X86", "TANDEM_AMX_EMULATE", "TANDEM_LINEAR_PREFETCH"}
MACRO_PREFIXES = ("TANDEM_HAVE_", "TANDEM_TILE_STEP", "TANDEM_SCALE_STEP")


def _env_names() -> set[str]:
    names: set[str] = set()
    for folder in ("app", "runtime", "models", "ext", "tools"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh"):
                names |= set(re.findall(r"TANDEM_[A-Z0-9_]+", path.read_text()))
    return {n for n in names if n not in MACROS and not n.startswith(MACRO_PREFIXES)}


def test_every_environment_variable_is_documented() -> None:
    names = _env_names()
    assert "TANDEM_HOME" in names and "TANDEM_CPU_LINEAR" in names  # the scan finds them
    missing = sorted(n for n in names if f"`{n}`" not in CONFIG_DOC)
    assert not missing, f"not in docs/configuration.md: {missing}"


def test_every_flag_is_documented() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {
        opt
        for parser in sub.choices.values()
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }
    assert "--allowed-origins" in flags
    missing = sorted(f for f in flags if f"`{f}" not in CONFIG_DOC)
    assert not missing, f"not in docs/configuration.md: {missing}"


def test_readme_links_resolve() -> None:
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"

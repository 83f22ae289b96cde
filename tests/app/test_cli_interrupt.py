"""Ctrl-C while `tandem serve` loads the model (before the server handles SIGINT itself)."""

from __future__ import annotations

import pytest

from tandem.app import serve as app_serve
from tandem.app.cli import main


def test_ctrl_c_while_loading_exits_130_without_a_traceback(monkeypatch, capsys):
    def loading(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(app_serve, "run_server", loading)
    # before: the KeyboardInterrupt escaped main(), a 20-80 line traceback on stderr
    assert main(["serve", "--model", "unused"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip() == "tandem: interrupted"


def test_other_errors_still_propagate(monkeypatch):
    def broken(args):
        raise KeyError("x")

    monkeypatch.setattr(app_serve, "run_server", broken)
    with pytest.raises(KeyError):
        main(["serve", "--model", "unused"])

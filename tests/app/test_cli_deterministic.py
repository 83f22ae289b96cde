"""`--deterministic` reaches the model spec; off by default."""

from __future__ import annotations

import argparse

from tandem.app.engine_args import add_engine_arguments, engine_config_from_args


def _spec(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv))).model


def test_flag_sets_the_spec() -> None:
    assert _spec().deterministic is False
    assert _spec("--deterministic").deterministic is True

"""The installed Tandem version, for `tandem --version` and `GET /version`."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "tandem-serve"


def tandem_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"

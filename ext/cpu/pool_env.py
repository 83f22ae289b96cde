"""The CPU expert pool's environment knobs (kernel set, integer path, packed rows, AMX
thresholds): their names, and parsing that refuses a bad value with a clear error."""

from __future__ import annotations

import os

ISA_ENV = "TANDEM_CPU_ISA"
# The integer path for int8/int4 experts (ext/cpu/kernels.h: kQBlock): "off", "auto" (default)
# or the minimum tokens per expert from which it is used.
INT_PATH_ENV = "TANDEM_CPU_INT_PATH"
ISAS = ("scalar", "avx2", "avx512", "amx")


def isa_from_env(isa: str | None) -> str | None:
    """A pool's `isa` argument: None takes $TANDEM_CPU_ISA (unset or empty: the best the CPU
    has, None); anything else must be one of ISAS (ValueError naming them)."""
    if isa is None:
        isa = os.environ.get(ISA_ENV, "") or None
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    return isa


_ENV_ON = ("on", "1", "yes", "true")
_ENV_OFF = ("off", "0", "no", "false")


def _int_min_tokens_from_env() -> int | None:
    """TANDEM_CPU_INT_PATH as a minimum token count: None for unset/"auto", 0 for "off"."""
    raw = os.environ.get(INT_PATH_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _ENV_OFF:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"{INT_PATH_ENV} must be 'auto', 'off' or a positive int, got {raw!r}")
    return value


def int_path_enabled() -> bool:
    """Whether the integer path may be used at all ($TANDEM_CPU_INT_PATH not "off")."""
    return _int_min_tokens_from_env() != 0


PACK_ROWS_ENV = "TANDEM_CPU_PACK_ROWS"
# Tokens of one expert from which AMX int8 tiles replace VNNI (ext/cpu/kernels.h:
# kAmxTileMinTokens); read by the extension when its first pool starts, checked here.
AMX_TILE_ENV = "TANDEM_AMX_TILE_MIN_TOKENS"
# Tokens of one expert from which AMX bf16 tiles replace the AVX-512 kernel (kAmxMinTokens, 1).
AMX_BF16_ENV = "TANDEM_AMX_BF16_MIN_TOKENS"


def _check_amx_tile_env() -> None:
    for name in (AMX_TILE_ENV, AMX_BF16_ENV):
        raw = os.environ.get(name, "").strip()
        if raw and not (raw.isdigit() and int(raw) > 0):
            raise ValueError(f"{name} must be a positive int, got {raw!r}")


def switch_from_env(name: str) -> bool | None:
    """An auto/on/off environment switch: None for unset or "auto", else True/False."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _ENV_ON:
        return True
    if raw in _ENV_OFF:
        return False
    raise ValueError(f"{name} must be 'auto', 'on' or 'off', got {raw!r}")


def _pack_rows_from_env() -> bool | None:
    """TANDEM_CPU_PACK_ROWS: None for unset/"auto", else on/off."""
    return switch_from_env(PACK_ROWS_ENV)

"""The GEMV's start-up switches (ops/quant/gemv_tiles): each reads its environment variable with
its default, ignores case and surrounding spaces, and a bad value names the variable and the
allowed values."""

from __future__ import annotations

import pytest

from ops.quant import gemv_tiles

# (variable, reader, default, an accepted spelling -> value, a bad value, the allowed values)
SWITCHES = [
    (gemv_tiles.ENV_PRELOAD, gemv_tiles.preload_mode, "on", ("OFF ", "off"), "1", "off, on"),
    (gemv_tiles.ENV_ROPE, gemv_tiles.rope_gemv_mode, "on", (" Off", "off"), "auto", "off, on"),
    (gemv_tiles.ENV_SILU, gemv_tiles.silu_gemv_mode, "auto", (" OFF", "off"), "fused",
     "auto, on, off"),
    (gemv_tiles.ENV_FP8_BITS, gemv_tiles.fp8_bits_mode, "auto", ("On", "on"), "maybe",
     "auto, on, off"),
]  # fmt: skip


@pytest.mark.parametrize("env, read, default, spelled, bad, allowed", SWITCHES)
def test_a_switch_reads_its_default_its_values_and_names_a_bad_one(
    env, read, default, spelled, bad, allowed, monkeypatch
):
    monkeypatch.delenv(env, raising=False)
    assert read() == default
    monkeypatch.setenv(env, spelled[0])
    assert read() == spelled[1]
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=f"{env}='{bad}': allowed values are {allowed}"):
        read()

"""scripts/block_rows.py (the GPU timing of the forward-only input-projection block size): on the
emulated CuPy it checks, measures and prints a row per block size; without a GPU it fails loudly."""
from __future__ import annotations

import pytest

from helpers import gpu_scripts
from lltm_cupy._cuda import sequence as _sequence


@pytest.fixture
def block_rows():
    return gpu_scripts.load("block_rows")


def _table(text):
    """{(size line, block label): row fields} of the printed tables."""
    rows, size = {}, None
    for line in text.splitlines():
        if line.startswith("(T, B, F, S)"):
            size = line.split(";")[0]
        elif size and line.split() and line.split()[0] in ("3", "6", "whole"):
            rows[size, line.split()[0]] = line.split()
    return rows


def test_measures_every_block_size_on_the_emulated_gpu(emulated_cupy, block_rows, capsys):
    emu = emulated_cupy.emulator
    before = _sequence._BLOCK_ROWS
    emu.reset()
    status = block_rows.main(["--sizes", "5x3x2x4,4x2x3x5", "--blocks", "3,6,whole",
                              "--runs", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert _sequence._BLOCK_ROWS == before      # restored
    # label, rows, steps per block: 3 rows hold one step of B = 3 or 2, 6 rows two or three
    rows = _table(out)
    assert [r[:3] for r in rows.values()] == [
        ["3", "3", "1"], ["6", "6", "2"], ["whole", "15", "5"],
        ["3", "3", "1"], ["6", "6", "3"], ["whole", "8", "4"]], out
    assert "vs 2048" in out and len(emu.log) > 0


def test_peak_counts_the_call_s_allocations(emulated_cupy, block_rows):
    """The peak of one call: the outputs ([h0, h_1..h_T]) and more, and a gate block of 15 rows
    instead of 3 adds exactly 12 rows of 3S float32 gate pre-activations."""
    T, B, F, S = 5, 3, 2, 4
    before = _sequence._BLOCK_ROWS
    rows = block_rows.measure(emulated_cupy, T, B, F, S, [3, None], 1, 0, "float32")
    assert _sequence._BLOCK_ROWS == before      # restored
    peak = {label: p for label, _, _, _, p, _ in rows}
    assert peak["3"] >= (T + 1) * B * S * 4
    assert peak["whole"] - peak["3"] == (T * B - 3) * 3 * S * 4, peak
    assert all(error < 1e-6 for *_, error in rows), rows


def test_a_wrong_result_fails_the_size(emulated_cupy, block_rows, capsys, monkeypatch):
    monkeypatch.setitem(block_rows.TOLERANCE, "float32", 0.0)
    status = block_rows.main(["--sizes", "5x3x2x4", "--blocks", "3", "--runs", "1"])
    out = capsys.readouterr().out
    assert status == 1 and "FAIL" in out and "off the float64 run" in out, out


def test_bad_arguments_are_refused(block_rows):
    gpu_scripts.assert_refuses(block_rows.main, ["--sizes", "5x3x2"], ["--blocks", "0"],
                               ["--blocks", "all"], ["--runs", "0"])


def test_without_a_gpu_it_fails_loudly():
    gpu_scripts.assert_fails_without_a_gpu("block_rows")

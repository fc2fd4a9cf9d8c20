"""scripts/fused_kernel_time.py (the fused kernels' own time per step on a GPU): on the emulated
CuPy with the kernels' host build it checks, times and prints a row per size and dtype; a wrong
kernel posts no time; without a GPU it fails loudly."""
from __future__ import annotations

import pytest

from helpers import gpu_scripts


@pytest.fixture
def script():
    return gpu_scripts.load("fused_kernel_time")


def _rows(text):
    return [line.split() for line in text.splitlines()
            if line.split() and line.split()[0].isdigit()]


def test_times_every_size_and_dtype_on_the_emulated_gpu(fused_cupy, script, capsys):
    from lltm_cupy._cuda import fused_kernels

    real = fused_kernels.get_kernels
    status = script.main(["--sizes", "5x3x2x4,3x2x3x6", "--dtypes", "float32,bfloat16,float64",
                          "--runs", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert fused_kernels.get_kernels is real     # restored
    rows = _rows(out)
    assert [r[:5] for r in rows] == [
        ["5", "3", "2", "4", d] for d in ("float32", "bfloat16", "float64")] + [
        ["3", "2", "3", "6", d] for d in ("float32", "bfloat16", "float64")], out
    for r in rows:      # fwd, bwd kernel and whole call us/step: timed, and a kernel within its call
        fwd, bwd, whole = map(float, r[5:8])
        assert 0 < fwd and 0 < bwd and fwd + bwd <= whole, r


def test_the_kernels_alone_are_timed(fused_cupy, script):
    """One event pair per fused launch, around the launch alone: a forward then a backward per
    call, and the launches are the real kernels'."""
    emu = fused_cupy.emulator
    from lltm_cupy._cuda import fused_kernels, kernels

    timed = script._Timed(fused_cupy, fused_kernels.get_kernels)
    kernels_used = timed(fused_cupy.float32)
    emu.reset()
    stored = {k: fused_cupy.asarray(v.astype("float32")) for k, v in script._case(4, 2, 3, 5).items()}
    real = fused_kernels.get_kernels
    fused_kernels.get_kernels = timed
    try:
        script._run(fused_cupy, stored, True)
    finally:
        fused_kernels.get_kernels = real
    assert [name for name, _, _ in timed.events] == ["fwd", "bwd"]
    assert isinstance(kernels_used, kernels.FusedKernels)
    assert emu.log.count("kernel:seq_fwd") == 1 and emu.log.count("kernel:seq_bwd") == 1


def test_a_wrong_kernel_posts_no_time(fused_cupy, script, capsys, monkeypatch):
    real = script._run

    def wrong(cupy, arrays, fused):
        results = real(cupy, arrays, fused)
        if fused:
            results[0] = results[0] + 1      # as a kernel writing wrong outputs would
        return results

    monkeypatch.setattr(script, "_run", wrong)
    status = script.main(["--sizes", "5x3x2x4", "--dtypes", "float32", "--runs", "1"])
    out = capsys.readouterr().out
    assert status == 1 and "FAIL" in out and "off the float64 run" in out, out
    assert not _rows(out), out


def test_a_size_the_kernels_cannot_run_is_refused(fused_cupy, script, capsys, monkeypatch):
    from lltm_cupy._cuda import fused

    monkeypatch.setattr(fused, "usable", lambda state, dtype: False)
    status = script.main(["--sizes", "3x2x2x4", "--dtypes", "float32", "--runs", "1"])
    out = capsys.readouterr().out
    assert status == 1 and "did not run" in out, out


def test_bad_arguments_are_refused(script):
    gpu_scripts.assert_refuses(script.main, ["--sizes", "5x3x2"], ["--dtypes", "int8"],
                               ["--runs", "0"])


def test_without_a_gpu_it_fails_loudly():
    gpu_scripts.assert_fails_without_a_gpu("fused_kernel_time")

"""A non-editable install ships the CUDA source inside the package and finds it there."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_and_finds_the_cuda_source(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("lltm_cupy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for source in ("lltm.cu", "lltm_fused.cu", "lltm_fused_mma.cu", "lltm_fused_cluster.cu"):
        assert f"lltm_cupy/cuda_src/{source}" in names, names
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    code = ("import lltm_cupy._cuda.kernels as k; p = k.source_path(); "
            "from lltm_cupy._cuda import cluster_kernels as c, fused_mma as m; "
            "assert 'lltm_fwd_kernel' in c.source() and 'lltm_seq_bwd_group_kernel' in c.source(); "
            "assert 'lltm_seq_fwd_mma_kernel' in m.source(); print(p)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(target), proc.stdout

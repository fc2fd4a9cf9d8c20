"""What a cubin (the ELF file NVRTC or ptxas writes) records about each kernel's resources, read
without a GPU, a driver or the CUDA toolkit: the registers per thread and the local-memory stack
frame (where spilled registers and local arrays live) that ptxas -v prints, from the global
``.nv.info`` section's attributes (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE),
keyed by the kernel's symbol. tests/kernels/test_fused_compilers.py checks these against
ptxas -v on the same cubin where nvcc is installed."""
from __future__ import annotations

import struct

#: .nv.info attribute codes (one record per kernel: symbol index, value)
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_REGCOUNT = 0x2F
_FIELDS = {EIATTR_REGCOUNT: "registers", EIATTR_FRAME_SIZE: "frame",
           EIATTR_MIN_STACK_SIZE: "stack"}
#: record formats: EIFMT_SVAL (a size, then that many bytes); the others carry no payload
_EIFMT_SVAL = 4


def _sections(elf: bytes) -> dict:
    """{name: (offset, size)} of an ELF64 little-endian file's sections."""
    assert elf[:4] == b"\x7fELF" and elf[4] == 2 and elf[5] == 1, "not an ELF64 LE file"
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
               for i in range(shnum)]
    names = headers[shstrndx][4]
    return {_string(elf, names + h[0]): (h[4], h[5]) for h in headers}


def _string(elf: bytes, at: int) -> str:
    return elf[at:elf.index(b"\0", at)].decode()


def kernel_resources(elf: bytes) -> dict:
    """{kernel symbol: {"registers": n, "frame": bytes, "stack": bytes}} of every kernel (every
    symbol with a register count) the cubin's ``.nv.info`` section describes; a figure the
    section does not give is missing from the kernel's dict."""
    sec = _sections(elf)
    sym_off, sym_size = sec[".symtab"]
    str_off = sec[".strtab"][0]
    symbols = [_string(elf, str_off + struct.unpack_from("<I", elf, sym_off + i)[0])
               for i in range(0, sym_size, 24)]
    info_off, info_size = sec[".nv.info"]
    result, at, end = {}, info_off, info_off + info_size
    while at < end:
        fmt, attr, size = struct.unpack_from("<BBH", elf, at)
        at += 4
        if fmt != _EIFMT_SVAL:
            continue
        if attr in _FIELDS:
            index, value = struct.unpack_from("<II", elf, at)
            result.setdefault(symbols[index], {})[_FIELDS[attr]] = value
        at += size
    return {name: r for name, r in result.items() if "registers" in r}


# ------------------------------------------------------------------------- register pins

#: The compilers the kernels' register pins (tests/kernels/test_fused_*.py) were measured with:
#: NVRTC 13.5 (the nvidia-cuda-nvrtc wheel CI installed then) and ptxas of nvcc 13.0 (this machine
#: kind's toolkit). Another version allocates registers otherwise: NVRTC 13.0 gives the cluster
#: kernels up to 35 % more on sm_100 than 13.5, and the sm_80 group kernel's float32 forward of
#: two blocks 96 registers where 13.5 gives 56 (+71 %). Against those versions a pin holds up to
#: twice the pin (plus the margin), so that a compiler update does not fail CI while a change
#: that more than doubles a kernel's registers still does; no local memory is required whatever
#: the version.
PINNED_COMPILERS = {"nvrtc": (13, 5), "ptxas": (13, 0)}
#: one register allocation unit per thread: what a pinned compiler's figure may grow by
MARGIN = 8


def compiler_version(compiler: str) -> tuple:
    """(major, minor) of NVRTC (the library CuPy compiles with) or of nvcc's ptxas."""
    if compiler == "nvrtc":
        from cupy_backends.cuda.libs import nvrtc

        return tuple(nvrtc.getVersion())
    import re
    import shutil
    import subprocess

    out = subprocess.run([shutil.which("nvcc") or "nvcc", "--version"], capture_output=True,
                         text=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


_versions: dict = {}


def register_ceiling(pin: int, compiler: str = "nvrtc") -> int:
    """The most registers per thread a kernel pinned at ``pin`` may use when built by
    ``compiler`` ("nvrtc" or "ptxas") as installed: see PINNED_COMPILERS."""
    if compiler not in _versions:
        _versions[compiler] = compiler_version(compiler)
    if _versions[compiler] == PINNED_COMPILERS[compiler]:
        return pin + MARGIN
    return 2 * pin + MARGIN

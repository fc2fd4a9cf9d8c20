"""Python calls counted with ``sys.setprofile``: the host work of the library measured without a
clock (deterministic, so a budget can be a test).

:func:`counted` runs a callable and returns a :class:`Calls`:

- ``library``: calls of functions defined in ``lltm_cupy/`` (Python functions and methods;
  a generator's every resumption counts, as ``sys.setprofile`` reports it);
- ``cupy``: calls made by ``lltm_cupy`` code into CuPy (the real one's compiled functions and
  methods, or the tests' emulated CuPy, tests/helpers/emulated_cupy.py, whose functions are
  Python): what a CuPy call costs on a GPU host is host time the library spends.

Calls into torch, NumPy and the standard library are not counted: they are the work itself
(or the price of the language), the same for any implementation of the layer.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import lltm_cupy

PACKAGE = str(Path(lltm_cupy.__file__).resolve().parent)
EMULATED = str(Path(__file__).resolve().parent / "emulated_cupy.py")


@dataclass
class Calls:
    library: int = 0
    cupy: int = 0
    names: dict = field(default_factory=dict)    # "file:function" -> calls (library only)

    @property
    def total(self) -> int:
        return self.library + self.cupy

    def __str__(self) -> str:
        top = sorted(self.names.items(), key=lambda kv: -kv[1])
        return (f"{self.library} library + {self.cupy} CuPy calls: "
                + ", ".join(f"{n} x{c}" for n, c in top))


def _in_package(code) -> bool:
    return code.co_filename.startswith(PACKAGE)


def _is_cupy_builtin(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    if not module:
        owner = getattr(fn, "__self__", None)
        module = type(owner).__module__ if owner is not None else ""
    return module == "cupy" or module.startswith(("cupy.", "cupy_backends", "cupyx"))


def counted(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), Calls)``."""
    calls = Calls()
    names = calls.names

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if _in_package(code):
                calls.library += 1
                key = f"{Path(code.co_filename).name}:{code.co_name}"
                names[key] = names.get(key, 0) + 1
            elif code.co_filename == EMULATED or "/cupy/" in code.co_filename:
                caller = frame.f_back
                if caller is not None and _in_package(caller.f_code):
                    calls.cupy += 1
        elif event == "c_call":
            if _in_package(frame.f_code) and _is_cupy_builtin(arg):
                calls.cupy += 1

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return result, calls


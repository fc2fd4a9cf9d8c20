"""This thread's memory for the CPU backend, and its floating-point error state.

- :func:`scratch`: temporaries of one call, reused call after call (no page faults);
- :func:`recycled`: large arrays a call returns or keeps, in the memory of earlier ones that
  nothing refers to any more;
- :func:`zeros`: a read-only zeros array (``minimum(z, zeros)`` beats ``minimum(z, 0)``);
- :func:`quiet` / :func:`loud`: NumPy's floating-point errors ignored around an entry point.

Every buffer kept here, and everything the backend keeps over them (the sequence loops'
workspaces, the one-step forward's views and closure), is private to the process: a forked
child (``multiprocessing``'s fork, ``DataLoader`` workers, Hogwild training) gets its own
copy-on-write pages, so parent and child never write each other's memory (:func:`_mapped`).
"""
from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

__all__ = ["scratch", "recycled", "zeros", "quiet", "loud"]

try:    # NumPy 2: the error state is a context variable; setting it is one C call
    from numpy._core.umath import _extobj_contextvar as _ERROR_STATE, _make_extobj

    _IGNORE = _make_extobj(all="ignore")

    def quiet():
        """Ignore floating-point errors in this thread until :func:`loud` of the token returned
        (what ``np.errstate(all="ignore")`` does, in one C call instead of a context manager's
        several Python ones)."""
        return _ERROR_STATE.set(_IGNORE)

    loud = _ERROR_STATE.reset
except ImportError:     # pragma: no cover -- a NumPy without it
    def quiet():
        return np.seterr(all="ignore")

    def loud(token):
        np.seterr(**token)

_local = threading.local()
#: the flags of an anonymous mapping of this process alone (``mmap`` adds MAP_ANONYMOUS for
#: fileno -1); Windows has no fork, and its ``mmap`` no flags
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def _mapped(count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` in a mapping of their own, outside the heap: a
    long-lived block among the heap's short-lived ones would change where they land and when
    the heap is trimmed. Zero-filled (fresh anonymous pages).

    The fork rule of the backend's kept memory: the mapping is private (``MAP_PRIVATE``), so a
    forked child's writes go to its own copies of the pages, as for the heap. (``mmap.mmap``'s
    default on Linux is ``MAP_SHARED``: parent and child would share every scratch buffer.)"""
    memory = mmap.mmap(-1, max(count * dtype.itemsize, 1), **_PRIVATE)
    return np.frombuffer(memory, dtype, count)


def scratch(count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` from this thread's scratch buffer, reused call after call:
    for what a step needs only while it runs (fresh memory of a step's size costs a page fault
    per 4 KiB touched on every call once the allocator hands it back to the system: at (64, 256,
    512) about 800 faults, a quarter of the step). Nothing that outlives the call may live
    there; the buffer grows to the largest request and stays (per thread, per dtype)."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.size < count:
        buffer = buffers[dtype] = _mapped(count, dtype)
    return buffer[:count]


def zeros(count: int, dtype) -> np.ndarray:
    """``count`` zeros of ``dtype``, read-only, this thread's (grown as needed and kept):
    ``minimum(z, zeros)`` costs 0.5 us less per call than ``minimum(z, 0)`` at (3, 16, 128)
    (NumPy's loop for a scalar operand is not vectorised), 30 % of the call."""
    table = getattr(_local, "zeros", None)
    if table is None:
        table = _local.zeros = {}
    buffer = table.get(dtype)
    if buffer is None or buffer.size < count:
        buffer = table[dtype] = _mapped(count, dtype)
        buffer.flags.writeable = False
    return buffer[:count]


#: arrays of at least this many bytes come from :func:`recycled`'s memory; smaller ones from
#: ``np.empty``, which glibc's malloc serves from its heap, reused without page faults, once an
#: array of their size was freed (its threshold for mapping fresh memory rises to the largest
#: freed mapping, up to 32 MiB: from there on every array is a fresh mapping)
_RECYCLE_BYTES = 32 << 20
#: arrays :func:`recycled` remembers per thread (the most recently handed out)
_RECYCLE_COUNT = 8


def recycled(dtype, *shapes) -> list:
    """New C-ordered arrays of ``dtype``, one per shape, uninitialised (as ``np.empty``), for
    what a call returns or keeps for a backward; each large one in the memory of an array this
    thread handed out before that nothing refers to any more (no array, view or tensor over
    it): fresh memory of a training call's size costs a page fault per 4 KiB or 2 MiB touched,
    and on a virtual machine a fault that finds memory the host took back costs much more and
    varies (at (T, B, F, S) = (32, 256, 512, 1024) 20-300 ms of system time per call, against
    none reused). The thread remembers the last :data:`_RECYCLE_COUNT` large arrays, so what it
    holds when idle is at most that many of the calls' arrays."""
    dtype = np.dtype(dtype)
    out = []
    for shape in shapes:
        count = 1
        for n in shape:
            count *= n
        if count * dtype.itemsize < _RECYCLE_BYTES:
            out.append(np.empty(shape, dtype))
            continue
        kept = getattr(_local, "recycled", None)
        if kept is None:
            kept = _local.recycled = []
        for i in range(len(kept)):
            owner = kept[i]
            # referred to by the list, ``owner`` and getrefcount's argument only: free
            if owner.size == count and owner.dtype == dtype and sys.getrefcount(owner) == 3:
                kept.append(kept.pop(i))        # the most recently used last
                break
        else:
            owner = np.empty(count, dtype)
            kept.append(owner)
            if len(kept) > _RECYCLE_COUNT:
                del kept[0]
        out.append(owner.reshape(shape))
        del owner
    return out


def forget_recycled() -> None:
    """Forget this thread's :func:`recycled` arrays (their memory is freed with the last
    reference to each)."""
    _local.recycled = []

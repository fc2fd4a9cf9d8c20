"""What the CPU backend keeps per thread, in one owner, and NumPy's floating-point error state.

- :func:`workspace`: this thread's :class:`Workspace` for one (batch, state, dtype), the memory
  the steps run on, with the element-wise steps over it (:mod:`.elementwise`), made once;
- :func:`scratch`: the temporaries of one call whose size follows the call's (an input
  projection's block, every step's gate gradients), one buffer per dtype, grown as needed;
- :func:`recycled` / :func:`reuse`: large arrays a call returns or keeps, in the memory of
  earlier ones that nothing refers to any more (the torch layer's tensors by the same rule);
- :func:`forget`: everything this thread keeps dropped (made again when next needed);
- :func:`quiet` / :func:`loud`: NumPy's floating-point errors ignored around an entry point.

What a step needs is kept, not made per call: fresh memory of a step's size costs a page fault
per 4 KiB touched on every call once the allocator hands it back to the system (figures:
docs/performance.md, "How the sequence loops are laid out"), and a step's views and closures
cost more than the step at small sizes.

The fork rule: everything kept here is private to the process. The workspaces and the scratch
buffers are anonymous mappings that :func:`_mapped` alone makes, ``MAP_PRIVATE`` (``mmap``'s
default on Linux is ``MAP_SHARED``: parent and child would share every buffer); the recycled
arrays are in the heap. A forked child (``multiprocessing``'s fork, ``DataLoader`` workers,
Hogwild training) goes on using what its parent's thread kept, in copy-on-write pages of its
own: parent and child never write each other's memory.
"""
from __future__ import annotations

import math
import mmap
import sys
import threading

import numpy as np

from .elementwise import backward_step, forward_step, step_factors

__all__ = ["Workspace", "workspace", "scratch", "recycled", "reuse", "forget", "quiet", "loud"]

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

#: the flags of an anonymous mapping of this process alone (``mmap`` adds MAP_ANONYMOUS for
#: fileno -1); Windows has no fork, and its ``mmap`` no flags
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def _mapped(count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` in a private mapping of their own (the fork rule, see
    the module docstring), outside the heap: a long-lived block among the heap's short-lived
    ones would change where they land and when the heap is trimmed. Zero-filled."""
    memory = mmap.mmap(-1, max(count * dtype.itemsize, 1), **_PRIVATE)
    return np.frombuffer(memory, dtype, count)


class _Kept(threading.local):
    """What one thread keeps (every thread sees attributes of its own)."""

    def __init__(self):
        #: (batch, state, dtype) -> Workspace: the last :data:`_WORKSPACES` made
        self.workspaces = {}
        #: dtype -> the scratch buffer
        self.scratch = {}
        #: kind -> the large arrays handed out (:func:`reuse`), the most recently used last
        self.recycled = {}


_kept = _Kept()


def forget() -> None:
    """Drop everything this thread keeps: workspaces and their steps (which bind NumPy's
    functions when made), scratch, recycled arrays and tensors (freed with the last reference
    to each); all made again when next needed."""
    _kept.__init__()


# ------------------------------------------------------------------------------ workspaces

#: a sequence's forward computes the factors of a group of consecutive steps in one call each
#: (``elementwise.step_factors``), as many steps as keep that call's arguments (_GROUP_ROWS
#: rows of (batch, state): scratch, z[1:], new_h, new_cell, factors) within _GROUP_BYTES, next
#: to the weights in a core's L2 cache; at least one: a workspace's forward slots (read when a
#: workspace is made: :func:`forget` applies a change)
_GROUP_BYTES = 1 << 20
_GROUP_ROWS = 14
#: workspaces kept per thread (the most recently made shapes: the cells' and the sequences'
#: of a few layers and batch sizes)
_WORKSPACES = 8


class Workspace:
    """This thread's memory for one (batch, state, dtype), made at first use and reused call
    after call, and the element-wise steps over it. One mapping, as named views (n = batch *
    state):

    - ``z`` (group, 3n) and ``s`` (group, 6n): the forward slots, a step's gate pre-activations
      (3, rows, state) and its element-wise scratch (6, rows, state), on any rows <= batch, for
      up to ``group`` consecutive steps of a sequence (whose factors one call computes); slot 0
      on every row is also the one-step forward's (:attr:`cells`);
    - ``product`` (3n,): the one-step forward's GEMM product (the bias add writes it into
      slot 0's z, gate-major);
    - ``d`` (5n,): the backward step's scratch; ``d_c`` (batch, state): the cell gradient the
      backward loop carries from step to step and returns;
    - ``zero`` (3n,): zeros, read-only (``minimum(z, zero)`` costs less than ``minimum(z, 0)``:
      NumPy's loop for a scalar operand is not vectorised).

    The steps on them, each made once (its views and closure) and kept: :attr:`cells`, the
    one-step forward per mode, and in :attr:`made` those of :meth:`forward`, :meth:`backward`
    and :meth:`gate_rows`. Every step writes what it reads of its slot first: nothing here
    outlives a call's use of it."""

    def __init__(self, batch: int, state: int, dtype):
        n = batch * state
        group = max(1, _GROUP_BYTES // (_GROUP_ROWS * max(n, 1) * dtype.itemsize))
        self.batch, self.state, self.group = batch, state, group
        memory = _mapped((9 * group + 12) * n, dtype)
        at = 9 * group * n
        self.z = memory[: 3 * group * n].reshape(group, 3 * n)
        self.s = memory[3 * group * n: at].reshape(group, 6 * n)
        self.product = memory[at: at + 3 * n]
        self.d = memory[at + 3 * n: at + 8 * n]
        self.d_c = memory[at + 8 * n: at + 9 * n].reshape(batch, state)
        self.zero = memory[at + 9 * n:]
        self.zero.flags.writeable = False
        self.made = {}
        #: [derivatives]: ``(z, step, total, scratch)``, the one-step forward on slot 0: z
        #: (3, batch, state), into which the caller writes the gate pre-activations, bias
        #: included; ``step(old_cell, new_h, new_cell)`` (``elementwise.forward_step``); and
        #: total = z[1:] and scratch (6, batch, state), what ``step_factors`` reads after it
        self.cells = (self._cell(False), self._cell(True))

    def _cell(self, derivatives: bool) -> tuple:
        shape = (self.batch, self.state)
        z, scratch = self.z[0].reshape(3, *shape), self.s[0].reshape(6, *shape)
        step = forward_step(z, scratch, self.zero.reshape(3, *shape), derivatives)
        return z, step, z[1:], scratch

    def gate_rows(self, derivatives: bool, operand) -> tuple:
        """``(z, run)`` for a caller whose GEMM writes the gate pre-activations (the torch
        layer's): :attr:`cells`' z as ``operand`` makes it (a GEMM engine's operand), and
        ``run(old_cell, new_h, new_cell, factors=None)``, the step on it with NumPy's errors
        ignored, and with ``derivatives`` the factors (4, batch, state) after it. Kept in
        :attr:`made` under ``(derivatives, operand)``."""
        z, step, total, scratch = self.cells[derivatives]
        factor_step = step_factors

        def run(old_cell, new_h, new_cell, factors=None):
            token = quiet()
            try:
                step(old_cell, new_h, new_cell)
                if factors is not None:
                    factor_step(total, scratch, new_h, new_cell, factors)
            finally:
                loud(token)
        found = self.made[derivatives, operand] = (operand(z), run)
        return found

    def forward(self, i: int, rows: int, derivatives: bool, mm) -> tuple:
        """Slot ``i``'s forward step on ``rows`` rows, ``(step, z as mm's kept operand, z)``
        (kept in :attr:`made` under ``((i, rows), (derivatives, mm))``)."""
        key = ((i, rows), (derivatives, mm))
        found = self.made.get(key)
        if found is None:
            k, state = 3 * rows * self.state, self.state
            z = self.z[i, :k].reshape(3, rows, state)
            step = forward_step(z, self.s[i, : 2 * k].reshape(6, rows, state),
                                self.zero[:k].reshape(3, rows, state), derivatives)
            found = self.made[key] = (step, mm.kept(z), z)
        return found

    def group_views(self, count: int, rows: int) -> tuple:
        """z[1:] and scratch of slots [0, count) on ``rows`` rows: (count, 2, rows, S) and
        (count, 6, rows, S), the arguments of one ``step_factors`` call for them."""
        k = 3 * rows * self.state
        z = self.z[:count, :k].reshape(count, 3, rows, self.state)
        return z[:, 1:], self.s[:count, : 2 * k].reshape(count, 6, rows, self.state)

    def backward(self, rows: int) -> tuple:
        """The backward step on ``rows`` rows (``elementwise.backward_step``) and its view of
        the cell gradient (kept in :attr:`made` under ``rows``)."""
        found = self.made.get(rows)
        if found is None:
            d = self.d[: 5 * rows * self.state].reshape(5, rows, self.state)
            found = self.made[rows] = (backward_step(d), self.d_c[:rows])
        return found


def workspace(batch: int, state: int, dtype) -> Workspace:
    """This thread's :class:`Workspace` for (batch, state, dtype) (``dtype`` a NumPy dtype):
    the last :data:`_WORKSPACES` shapes' are kept (the oldest made is dropped first)."""
    kept = _kept.workspaces
    found = kept.get((batch, state, dtype))
    if found is None:
        found = Workspace(batch, state, dtype)
        while len(kept) >= _WORKSPACES:
            del kept[next(iter(kept))]
        kept[batch, state, dtype] = found
    return found


def scratch(count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` from this thread's scratch buffer, reused call after call:
    for what a call needs only while it runs, at a size that follows the call's (what follows
    the batch and state alone is a :class:`Workspace`'s). Nothing that outlives the call may
    live there; the buffer grows to the largest request and stays (per thread, per dtype)."""
    buffers = _kept.scratch
    buffer = buffers.get(dtype)
    if buffer is None or buffer.size < count:
        buffer = buffers[dtype] = _mapped(count, dtype)
    return buffer[:count]


# ------------------------------------------------------------------------- recycled arrays

#: arrays of at least this many bytes come from memory :func:`reuse` remembers; smaller ones
#: from ``np.empty`` (or ``torch.empty``), which glibc's malloc serves from its heap, reused
#: without page faults, once an array of their size was freed (its threshold for mapping fresh
#: memory rises to the largest freed mapping, up to 32 MiB: from there on every array is a
#: fresh mapping)
RECYCLE_BYTES = 32 << 20
#: arrays :func:`reuse` remembers per thread and kind (the most recently handed out)
RECYCLE_COUNT = 8


def recycled(dtype, *shapes) -> list:
    """New C-ordered arrays of ``dtype``, one per shape, uninitialised (as ``np.empty``), for
    what a call returns or keeps for a backward; each large one (:data:`RECYCLE_BYTES`) by
    :func:`reuse`: fresh memory of a training call's size costs a page fault per 4 KiB or 2 MiB
    touched, and on a virtual machine a fault that finds memory the host took back costs much
    more and varies (docs/performance.md, "Steady at large sizes")."""
    dtype = np.dtype(dtype)
    out = []
    for shape in shapes:
        count = math.prod(shape)
        if count * dtype.itemsize < RECYCLE_BYTES:
            out.append(np.empty(shape, dtype))
        else:
            out.append(reuse("numpy", count, dtype, _unreferenced, np.empty).reshape(shape))
    return out


def _unreferenced(owner) -> bool:
    """Whether nothing refers to the array ``owner`` of :func:`reuse` (no array, view or tensor
    over it) but :func:`reuse`'s list and variable, this argument and getrefcount's."""
    return sys.getrefcount(owner) == 4


def reuse(kind: str, count: int, dtype, free, new):
    """A flat array (or tensor: what has ``len`` and ``dtype``) of ``count`` elements of
    ``dtype``: the one of this thread's of ``kind`` (the last :data:`RECYCLE_COUNT` handed out)
    of that size and dtype that ``free(it)`` says nothing refers to any more, else
    ``new(count, dtype)``, remembered. What the thread holds when idle is at most that many of
    the calls' arrays."""
    kept = _kept.recycled.get(kind)
    if kept is None:
        kept = _kept.recycled[kind] = []
    for i in range(len(kept)):
        owner = kept[i]
        if len(owner) == count and owner.dtype == dtype and free(owner):
            kept.append(kept.pop(i))        # the most recently used last
            return owner
    owner = new(count, dtype)
    kept.append(owner)
    if len(kept) > RECYCLE_COUNT:
        del kept[0]
    return owner

"""Variable-length sequences: the packed layout both backends run them in.

A batch of sequences of lengths L_b <= T is run as ``torch.nn.utils.rnn.PackedSequence`` lays it
out: the batch sorted by length, longest first (stable, so ties keep the caller's order), and
step tau holding the ``batch_sizes[tau]`` sequences still running, which are a prefix of the
sorted batch. The packed rows of step tau are rows ``offsets[tau] : offsets[tau + 1]``, N =
sum(L_b) rows in all: the GEMMs and kernels do no work for padded positions, and every per-step
operand (the rows still running, their state, their slice of the projection) is a contiguous
prefix, so the CUDA kernels need nothing new.

Row j of step tau is sequence ``perm[j]`` at time tau, or at time L - 1 - tau when ``reverse``
(each sequence run from its own last valid step back to step 0): ``t_index`` / ``b_index`` say
where each packed row lives in the caller's (T, B, ...) arrays, so that one gather packs the
inputs and one scatter unpacks the outputs.

A plan made by :func:`packed_plan` (the torch layer's ``PackedSequence`` input) takes the inputs
and gives the outputs in ``PackedSequence.data``'s own layout, (N, ...) rows, with no padded
arrays at all. It depends on ``batch_sizes`` alone (a host tensor, by torch's design) and works
in the sorted batch order (``perm`` is the identity): the caller permutes the initial state by
``sorted_indices`` and the final state by ``unsorted_indices`` on the device, as ``nn.LSTM``
does, so no index ever comes back to the host. In the forward direction the packed rows are
``data``'s rows; ``data_index`` maps them for ``reverse``.

Device copies. The GPU backend needs some of a plan's index arrays on the device;
:meth:`Plan.device_arrays` uploads each at most once per plan and device and keeps it with the
plan. Plans are cached (:func:`cached_plan`, :func:`packed_plan`: the last 64 of each, by their
lengths or batch_sizes), so a loop over batches of recurring lengths uploads nothing in steady
state; the torch layer's plans apart from the array API's (``pool="torch"``): the torch layer
uploads its plans' arrays as torch tensors, the array API as CuPy arrays in CuPy's pool, and
neither reads the other's (``lltm_cupy.warmup`` caches none). While a CUDA graph is being captured no
upload is allowed (it would stage through host memory and be invalid, or frozen, in the graph):
a plan must be on the device already (an eager call with the same lengths first), else
:class:`CaptureError`. A plan used under capture is
kept for the life of the process, since the graph reads its device arrays at every replay.
"""
from __future__ import annotations

import functools
import operator
import types
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

__all__ = ["Plan", "plan", "cached_plan", "packed_plan", "packed_layout", "pack_rows",
           "unpack_rows", "incoming_cell_grad", "block_steps", "step_blocks", "CaptureError"]


class CaptureError(RuntimeError):
    """Variable-length input whose index arrays are not on the device yet, met while a CUDA graph
    is being captured."""


def capture_error(why: str = "before its index arrays were on the device") -> CaptureError:
    return CaptureError(
        f"lltm_cupy: variable-length input (lengths= or a PackedSequence) met inside a CUDA-graph "
        f"capture {why}: a host-device copy is not allowed while capturing. Run the same call "
        f"eagerly once, with the same lengths (batch_sizes) given on the host, before the "
        f"capture (the warm-up iterations that torch.cuda.graph and make_graphed_callables ask "
        f"for do this); the graph then replays that layout, so it is valid only for those "
        f"lengths.")


def pin(plan_: "Plan") -> None:
    """Keep ``plan_`` (and its device arrays) for the life of the process: a captured graph
    reads them at every replay."""
    if plan_ not in _pinned:
        _pinned.append(plan_)


#: plans used while a graph was captured: their device arrays must outlive every replay
_pinned = []


@dataclass(frozen=True, eq=False)
class Plan:
    lengths: np.ndarray        # (B,) int64, the caller's order
    perm: np.ndarray           # (B,) sorted position j -> batch index
    batch_sizes: tuple         # per step tau, sequences still running (a prefix of perm)
    offsets: tuple             # (steps + 1,) first packed row of each step
    t_index: np.ndarray        # (N,) time of each packed row in the caller's arrays
    b_index: np.ndarray        # (N,) batch index of each packed row
    last_row: np.ndarray       # (B,) packed row of each sorted sequence's last step, -1 if L = 0
    reverse: bool
    steps: int                 # T of the caller's (T, B, ...) arrays
    packed_io: bool = False    # inputs and outputs in PackedSequence.data's (N, ...) layout
    data_index: Optional[np.ndarray] = None   # (N,) data row of each packed row; None: the same
    #: device id -> the index arrays on that device (see device_arrays)
    _device: dict = field(default_factory=dict, repr=False)
    #: device id -> the handles of the streams the index arrays there were used on
    _streams: dict = field(default_factory=dict, repr=False)

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    @property
    def identity_perm(self) -> bool:
        """Whether the sort order is the caller's order (no permutation to apply)."""
        return bool(np.array_equal(self.perm, np.arange(len(self.perm))))

    @property
    def ended(self) -> int:
        """How many sequences have length > 0: a prefix of the sorted order."""
        return int(np.count_nonzero(self.last_row >= 0))

    @property
    def prev_row(self) -> np.ndarray:
        """For every packed row of steps 1, 2, ...: the packed row of the previous step's
        output it reads as its hidden state (rows of step 0 read h0)."""
        sizes, offsets = np.asarray(self.batch_sizes, np.int64), np.asarray(self.offsets)
        if len(sizes) < 2:
            return np.empty(0, np.int64)
        taus = np.repeat(np.arange(1, len(sizes)), sizes[1:])
        rows = np.arange(offsets[1], offsets[-1])
        return (offsets[taus - 1] + rows - offsets[taus]).astype(np.int64)

    def on_device(self, device_id: int) -> bool:
        return device_id in self._device

    def first_use_on(self, device_id: int, stream: int):
        """The index arrays on ``device_id`` (:meth:`device_arrays`' namespace) if they are
        there and were not used on stream ``stream`` (a handle) before, else None; notes the
        stream as used. The stream they were uploaded on counts as used."""
        found = self._device.get(device_id)
        if found is None:
            return None
        seen = self._streams.setdefault(device_id, set())
        if stream in seen:
            return None
        seen.add(stream)
        return found

    def device_arrays(self, upload, device_id: int, stream: int, capturing: bool = False):
        """The index arrays the GPU paths read, on device ``device_id``, each made by
        ``upload`` (a host array -> its copy on that device, the current one: a CuPy array for
        the array API, a torch tensor for the torch layer) on the stream with handle
        ``stream``: ``t_index``, ``b_index`` (None for a PackedSequence plan), ``data_index``
        (None unless reverse over PackedSequence data), ``perm`` (None for the identity),
        ``order`` (perm even where it is the identity), ``last`` (the packed row of each ended
        sequence's last step), ``prev`` (:attr:`prev_row`; None where empty) and ``offsets``
        (:attr:`offsets`, int64: the fused kernels' step boundaries). Uploaded on the first call
        for that device, then reused; ``capturing``: a CUDA graph is being captured, where an
        upload is refused (:class:`CaptureError`) before any work."""
        found = self._device.get(device_id)
        if found is not None:
            if capturing:
                pin(self)
            return found
        if capturing:
            raise capture_error()

        def up(a):
            return None if a is None else upload(a)

        found = types.SimpleNamespace(
            t_index=None if self.packed_io else up(self.t_index),
            b_index=None if self.packed_io else up(self.b_index),
            data_index=up(self.data_index),
            perm=None if self.identity_perm else up(self.perm),
            order=up(self.perm),
            last=up(self.last_row[: self.ended]) if self.rows else None,
            prev=up(self.prev_row) if len(self.prev_row) else None,
            offsets=up(np.asarray(self.offsets, np.int64)))
        self._device[device_id] = found
        self._streams[device_id] = {stream}
        return found

    def step(self, tau: int) -> slice:
        return slice(self.offsets[tau], self.offsets[tau + 1])


def check_lengths(lengths, steps: int, batch: int) -> np.ndarray:
    """``lengths`` as (batch,) int64 on the host; TypeError/ValueError naming it otherwise.
    Lengths given on a GPU (a CuPy array, a CUDA tensor) are copied to the host here: a
    device-to-host copy that waits for the device (give them on the host to avoid it)."""
    if hasattr(lengths, "get") and type(lengths) is not np.ndarray:     # a CuPy array
        lengths = lengths.get()
    elif hasattr(lengths, "detach"):                                      # a torch tensor
        lengths = lengths.detach().cpu().numpy()
    elif isinstance(lengths, (list, tuple)) and any(isinstance(v, (bool, np.bool_))
                                                    for v in lengths):
        # NumPy makes [True, 2] an integer array: True would be a length of 1
        raise TypeError(f"lltm_cupy: lengths must hold integers, got a bool in {lengths!r}")
    try:
        values = np.asarray(lengths)
    except Exception as exc:
        raise TypeError(f"lltm_cupy: lengths must be a sequence of {batch} integers, got "
                        f"{type(lengths).__qualname__}") from exc
    if values.dtype == bool or not (np.issubdtype(values.dtype, np.integer) or (
            values.dtype.kind == "O" and all(isinstance(v, int) or hasattr(v, "__index__")
                                             for v in values.reshape(-1)))):
        raise TypeError(f"lltm_cupy: lengths must hold integers, got dtype {values.dtype}")
    if values.dtype.kind == "O":
        values = np.array([operator.index(v) for v in values.reshape(-1)]).reshape(values.shape)
    if values.shape != (batch,):
        raise ValueError(f"lltm_cupy: lengths must have shape ({batch},) (one per sequence of "
                         f"the batch), got {values.shape}")
    if batch and (values.min() < 0 or values.max() > steps):
        raise ValueError(f"lltm_cupy: lengths must lie in [0, {steps}] (steps), got "
                         f"{values.min()} .. {values.max()}")
    return values.astype(np.int64)


def plan(lengths: np.ndarray, steps: int, reverse: bool = False, perm=None,
         packed_io: bool = False) -> Plan:
    """The packed layout of checked ``lengths`` (see the module docstring); ``perm``: a given
    sort order, longest first (default: a stable sort)."""
    perm = np.argsort(-lengths, kind="stable") if perm is None else perm
    sorted_lengths = lengths[perm]
    longest = int(sorted_lengths[0]) if len(perm) else 0
    # batch_sizes[tau] = how many lengths exceed tau (lengths sorted descending)
    counts = np.bincount(sorted_lengths, minlength=longest + 1)
    sizes = len(perm) - np.cumsum(counts)[:longest]
    batch_sizes = tuple(int(n) for n in sizes)
    offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    rows = int(offsets[-1])
    tau = np.repeat(np.arange(longest), sizes)
    j = np.arange(rows) - offsets[:-1][tau]               # position within its step
    b_index = perm[j]
    t_index = lengths[b_index] - 1 - tau if reverse else tau
    # the packed row of each sorted sequence's last step (-1 for length 0)
    positions = np.arange(len(perm))
    last_row = np.where(sorted_lengths > 0,
                        offsets[np.maximum(sorted_lengths - 1, 0)] + positions, -1)
    data_index = None
    if packed_io and reverse:
        # data row of (time t, sequence b): offsets[t] + b's position in the sort order
        position = np.empty_like(perm)
        position[perm] = positions
        data_index = (offsets[:-1][t_index] + position[b_index]).astype(np.int64)
    return Plan(lengths, perm, batch_sizes, tuple(int(o) for o in offsets),
                t_index.astype(np.int64), b_index.astype(np.int64), last_row.astype(np.int64),
                bool(reverse), int(steps), bool(packed_io), data_index)


@functools.lru_cache(maxsize=64)
def _cached(key: bytes, batch: int, steps: int, reverse: bool, pool: str) -> Plan:
    return plan(np.frombuffer(key, np.int64, batch).copy(), steps, reverse)


def cached_plan(lengths: np.ndarray, steps: int, reverse: bool = False,
                pool: str = "cupy") -> Plan:
    """:func:`plan` of checked ``lengths`` (int64), from a cache of the last 64 (by value), so
    that recurring lengths reuse the plan and its device arrays. ``pool``: whose plans, "cupy"
    (the array API's) or "torch" (the torch layer's, with their arrays in torch's allocator)."""
    lengths = np.ascontiguousarray(lengths, np.int64)
    return _cached(lengths.tobytes(), len(lengths), int(steps), bool(reverse), pool)


def packed_layout(batch_sizes, reverse: bool = False) -> Plan:
    """The plan of a ``PackedSequence``'s ``batch_sizes`` (a sequence of ints), not cached (see
    :func:`packed_plan`)."""
    sizes = np.asarray(batch_sizes, dtype=np.int64)
    batch = int(sizes[0]) if len(sizes) else 0
    lengths = (sizes[None, :] > np.arange(batch)[:, None]).sum(1).astype(np.int64)
    return plan(lengths, len(sizes), reverse, perm=np.arange(batch, dtype=np.int64),
                packed_io=True)


@functools.lru_cache(maxsize=64)
def _packed(sizes: tuple, reverse: bool, pool: str) -> Plan:
    return packed_layout(sizes, reverse)


def clear_caches() -> None:
    """Forget every cached plan (and its device arrays), pinned ones included. For tests; a
    graph captured with a plan forgotten here must not be replayed."""
    _cached.cache_clear()
    _packed.cache_clear()
    _pinned.clear()


def packed_plan(batch_sizes, reverse: bool = False, pool: str = "cupy") -> Plan:
    """The plan of a ``PackedSequence`` from its ``batch_sizes`` (a CPU tensor or a sequence of
    ints), with inputs and outputs in its ``data`` layout, in the sorted batch order (the caller
    applies ``sorted_indices`` / ``unsorted_indices`` to the states). Cached by batch_sizes and
    ``pool`` (as :func:`cached_plan`)."""
    if hasattr(batch_sizes, "tolist"):
        batch_sizes = batch_sizes.tolist()
    return _packed(tuple(int(n) for n in batch_sizes), bool(reverse), pool)


def pack_rows(a, plan: Plan, t_index, b_index, data_index):
    """The packed rows of ``a``: (T, B, ...) gathered at (``t_index``, ``b_index``), or a
    PackedSequence's data (N, ...) as it is (forward; the result is ``a`` itself) or gathered by
    ``data_index`` (reverse). The index arrays are ``plan``'s, on ``a``'s device."""
    if not plan.packed_io:
        return a[t_index, b_index]
    return a if data_index is None else a[data_index]


def unpack_rows(rows, plan: Plan, xp, t_index, b_index, data_index):
    """Inverse of :func:`pack_rows` (``xp``: the array module): packed ``rows`` (N, ...) into
    (T, B, ...) with zeros at padded positions, or into PackedSequence data order (``rows``
    itself in the forward direction)."""
    if plan.packed_io:
        if data_index is None:
            return rows
        out = xp.empty(rows.shape, rows.dtype)    # data_index covers every row
        out[data_index] = rows
        return out
    out = xp.zeros((plan.steps, len(plan.perm)) + rows.shape[1:], rows.dtype)
    if len(rows):
        out[t_index, b_index] = rows
    return out


def incoming_cell_grad(xp, d_c, grad_c_n, n: int, nxt: int, state: int, dtype):
    """The cell-state gradient entering step tau of a packed backward (``xp``: the array
    module), for the step's ``n`` rows, of which the first ``nxt`` run on at step tau + 1:
    ``d_c`` (nxt, state), what step tau + 1 passed back (None: no step yet), for those, and
    the final state's gradient ``grad_c_n[nxt:n]`` (``grad_c_n``: (batch, state) in the sorted
    order, or None for zero) for the rows whose sequences end at step tau. Returns ``d_c``
    itself where no sequence ends there, and None (zero) where both are None."""
    if d_c is not None and nxt == n:
        return d_c
    if d_c is None and grad_c_n is None:
        return None
    dc_in = xp.empty((n, state), dtype)     # each row written once (not zeros, then a copy)
    dc_in[:nxt] = 0 if d_c is None else d_c
    dc_in[nxt:] = 0 if grad_c_n is None else grad_c_n[nxt:n]
    return dc_in


def block_steps(batch: int, rows: int) -> int:
    """Steps per block of a fixed-length sequence's input projection: as many as fit in
    ``rows`` rows of ``batch`` each, at least one."""
    return max(1, rows // max(batch, 1))


def step_blocks(offsets, rows: int) -> list:
    """The packed steps in blocks of consecutive steps, ``[(tau0, tau1), ...]``: each block's
    packed rows ``offsets[tau0]:offsets[tau1]`` number at most ``rows``, or one step's."""
    blocks, tau0 = [], 0
    for tau in range(1, len(offsets)):
        if offsets[tau] - offsets[tau0] > rows and tau - 1 > tau0:
            blocks.append((tau0, tau - 1))
            tau0 = tau - 1
    if len(offsets) > 1:
        blocks.append((tau0, len(offsets) - 1))
    return blocks

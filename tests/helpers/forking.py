"""Running the library in a forked child beside its parent, at the same time, and comparing both
processes' results with what one process computes (tests/processes/test_fork.py).

A forked child starts with one thread's worth of torch: ``torch.set_num_threads(1)`` before
anything else, as ``DataLoader``'s workers do. GNU OpenMP, which torch's CPU build uses, is not
fork-safe: a child forked after torch ran an operation on several threads hangs in the next one
that would (torch's own operations included, whatever library calls them).
"""
from __future__ import annotations

import os
import struct
import traceback

import numpy as np
import torch

__all__ = ["same", "in_parent_and_child", "in_child"]


def same(result, expected) -> bool:
    """Whether ``result`` equals ``expected`` bit for bit: tensors, arrays, or (nested) tuples
    and lists of them (None where None)."""
    if isinstance(expected, (tuple, list)):
        return (isinstance(result, (tuple, list)) and len(result) == len(expected)
                and all(same(r, e) for r, e in zip(result, expected)))
    if expected is None:
        return result is None
    if isinstance(expected, torch.Tensor):
        return (isinstance(result, torch.Tensor) and result.shape == expected.shape
                and result.dtype == expected.dtype and torch.equal(result, expected))
    return (np.shape(result) == np.shape(expected)
            and np.array_equal(np.asarray(result), np.asarray(expected), equal_nan=True))


def _exit_with(write_end: int, payload: bytes, code: int) -> None:
    try:
        os.write(write_end, payload)
    finally:
        os._exit(code)


def in_parent_and_child(run, expected, rounds: int):
    """Fork; then the parent and the child each call ``run()`` ``rounds`` times at the same time
    (the parent starts when the child says it is ready), each result compared bit for bit with
    ``expected``. Returns ``(wrong in the parent, wrong in the child)``; an error in the child
    is raised here with its traceback."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: never returns
        os.close(ready_r)
        os.close(done_r)
        try:
            torch.set_num_threads(1)
            os.write(ready_w, b"r")
            wrong = sum(not same(run(), expected) for _ in range(rounds))
            _exit_with(done_w, struct.pack("q", wrong), 0)
        except BaseException:                       # noqa: BLE001 (reported to the parent)
            _exit_with(done_w, traceback.format_exc().encode(), 1)
    os.close(ready_w)
    os.close(done_w)
    try:
        os.read(ready_r, 1)
        wrong_here = sum(not same(run(), expected) for _ in range(rounds))
    finally:
        payload = _read_all(done_r)
        _, status = os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(done_r)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(f"the forked child failed:\n{payload.decode(errors='replace')}")
    return wrong_here, struct.unpack("q", payload)[0]


def in_child(run):
    """Fork; the child calls ``run()`` once (after ``torch.set_num_threads(1)``). Returns what
    it raised, as ``(type name, message)``, or None where it returned."""
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(done_r)
        try:
            torch.set_num_threads(1)
            run()
            _exit_with(done_w, b"", 0)
        except BaseException as exc:                # noqa: BLE001 (reported to the parent)
            _exit_with(done_w, f"{type(exc).__name__}\n{exc}".encode(), 0)
    os.close(done_w)
    payload = _read_all(done_r)
    _, status = os.waitpid(pid, 0)
    os.close(done_r)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child died"
    if not payload:
        return None
    name, message = payload.decode(errors="replace").split("\n", 1)
    return name, message


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)

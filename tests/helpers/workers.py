"""pytest-xdist's workers (the README's ``python -m pytest -n auto``): one thread per library in
each of them.

The workers already occupy every core; a pool of a thread per core in each worker (torch's
OpenMP threads, NumPy's OpenBLAS, MKL) only oversubscribes the machine, and OpenMP's threads spin
while they wait: tests/torch_layer/test_dropin.py, test_digits_array.py and test_saved_tensors.py on
two workers took 137 s with the libraries' default pools and 27 s with one thread each (a 2-core
machine shared with other jobs, load average 4 to 6). The
controlling process sets the variables below (unless the environment already does) before it
starts the workers, which inherit its environment; a run without workers keeps the libraries'
defaults.
"""
from __future__ import annotations

import os

#: the thread pools of the libraries the tests call
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        for name in THREAD_VARIABLES:
            os.environ.setdefault(name, "1")

"""The optional dependencies of the examples (``pip install '.[examples]'``: scikit-learn,
matplotlib, tqdm), imported on use with a message that names the extra."""
from __future__ import annotations

import importlib

__all__ = ["MissingExtra", "require", "pyplot"]


class MissingExtra(RuntimeError):
    """An optional dependency of the examples is not installed."""


def require(*modules):
    """Import the named modules, or raise MissingExtra naming the extra to install."""
    loaded = []
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except ImportError as exc:
            raise MissingExtra(
                f"{name} is not installed: it comes with the examples extra, "
                f"pip install '.[examples]' (scikit-learn, matplotlib, tqdm)") from exc
    return loaded


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    (matplotlib,) = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

"""The optional dependencies of the examples (``pip install '.[examples]'``: scikit-learn,
matplotlib, tqdm), imported on use with a message that names the extra."""
from __future__ import annotations

import importlib

__all__ = ["MissingExtra", "require", "pyplot", "save_figure"]


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


def save_figure(fig, path) -> tuple:
    """Lay out ``fig``, write it to ``path`` and close it; its size in pixels (width, height)."""
    fig.tight_layout()
    fig.savefig(path)
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    pyplot().close(fig)
    return size

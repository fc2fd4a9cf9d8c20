"""The one-step module :class:`LLTMCell`: a drop-in for the tutorial's ``LLTM``, shaped like
``nn.LSTMCell``."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ._module_args import _CellBase, _check_pair
from ._ops import eager_step, lltm

__all__ = ["LLTMCell"]


class LLTMCell(_CellBase):
    """The LLTM cell as a module: a drop-in for the tutorial's ``LLTM``, called like
    ``nn.LSTMCell``.

    ``LLTMCell(input_size, hidden_size, bias=True, device=None, dtype=None)`` (the tutorial's
    ``input_features=`` / ``state_size=`` are accepted too, and readable as attributes).
    Parameters: ``weights (3 * hidden_size, input_size + hidden_size)`` and
    ``bias (1, 3 * hidden_size)``, uniform in +-1/sqrt(hidden_size), so a state_dict of the
    tutorial's module loads into this one.
    """

    def forward(self, input: Tensor, state: Optional[tuple[Tensor, Tensor]] = None):
        """One step: ``(h, c)``, each (batch, hidden_size), from ``input`` (batch, input_size)
        and ``state`` = (h, c) of the same shapes (None: zeros). An unbatched ``input``
        (input_size,) takes and returns (hidden_size,) states, as ``nn.LSTMCell``. TypeError
        or ValueError, naming the argument, for anything else."""
        if state.__class__ is tuple and len(state) == 2 and self.bias is not None:
            out = eager_step(input, self.weights, self.bias, state[0], state[1])
            if out is not None:     # (the fast path's checks imply the module's)
                return out
        if isinstance(input, Tensor) and input.dim() == 1:
            if state is not None:
                _check_pair("LLTMCell", state)
                for part, t in zip("hc", state):
                    if t.dim() != 1:    # (as nn.LSTMCell: unbatched input, unbatched state)
                        raise ValueError(f"LLTMCell: an unbatched input ({self.input_size},) "
                                         f"takes an unbatched state: {part} must have shape "
                                         f"({self.hidden_size},), got {tuple(t.shape)}")
                state = tuple(t.unsqueeze(0) for t in state)
            h, c = lltm(*self._args(input.unsqueeze(0), state))
            return h.squeeze(0), c.squeeze(0)
        return lltm(*self._args(input, state))


# Pickles (torch.save of a whole model) name the class by its public home, so that it loads
# whatever file inside lltm_cupy.torch defines it.
LLTMCell.__module__ = "lltm_cupy.torch"

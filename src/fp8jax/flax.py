"""flax.linen adapter: `Fp8DotGeneralOp`, for ``nn.Dense(dot_general_cls=...)`` and
``nn.DenseGeneral`` (``pip install fp8jax[flax]``).

The state lives in flax's ``"_overwrite_with_gradient"`` collection under the same
names as flax's own ``Fp8DirectDotGeneralOp`` (plus ``history_index`` and
``nonfinite_count``), so ``flax.training.train_state.TrainState.apply_gradients``
writes the new state and keeps it out of the optimizer, as it does for flax's ops::

    dense = nn.Dense(4096, dot_general_cls=fp8jax.flax.fp8_dot_general_cls(Fp8Config()))

The GEMMs are fp8jax's (real FP8, K-major), not flax's.
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from ._dot import STATE_FIELDS
from .config import Fp8Config
from .dot_general import Fp8DotGeneral


class Fp8DotGeneralOp(nn.Module):
    """A linen module with ``jax.lax.dot_general``'s signature running `Fp8DotGeneral`."""

    config: Fp8Config = Fp8Config()

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        template = Fp8DotGeneral(self.config)
        values = tuple(
            self.variable(OVERWRITE_WITH_GRADIENT, name, lambda name=name: getattr(template, name)).value
            for name in STATE_FIELDS
        )
        op = eqx.tree_at(lambda m: m.state(), template, values)
        return op(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type)


def fp8_dot_general_cls(config: Fp8Config | None = None):
    """What to pass as ``dot_general_cls`` to ``nn.Dense`` / ``nn.DenseGeneral``."""
    return functools.partial(Fp8DotGeneralOp, config=Fp8Config() if config is None else config)

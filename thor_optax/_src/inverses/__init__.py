"""The registry of inverse methods, one module each: ``cholesky``, ``eigh``, ``woodbury``,
``low_rank``, ``auto`` (the interface is ``base.InverseMethod``)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from thor_optax._src import static_args
from thor_optax._src.inverses import auto
from thor_optax._src.inverses import base
from thor_optax._src.inverses import cholesky
from thor_optax._src.inverses import eigh
from thor_optax._src.inverses import low_rank
from thor_optax._src.inverses import woodbury

InverseMethod = base.InverseMethod

# name -> (class, whether it takes woodbury_rows: 'no', 'optional' or 'required')
METHODS = {
    "cholesky": (cholesky.Cholesky, "no"),
    "eigh": (eigh.Eigh, "no"),
    "woodbury": (woodbury.Woodbury, "optional"),
    "low_rank": (low_rank.LowRank, "required"),
    "auto": (auto.Auto, "optional"),
}


def damps_factors_separately(name: str) -> bool:
  """Whether the inverse method ``name`` adds separate damping to ``A`` and ``G`` (it provides
  ``'factored damping'``, what the pi rule needs); ``'eigh'`` damps ``A (x) G`` exactly. An
  unknown name gives True: :func:`make` raises for it."""
  cls = METHODS.get(name, (base.InverseMethod, None))[0]
  return "factored damping" in cls.provides


def make(name: str, woodbury_rows: Optional[int] = None,
         inverse_power: Optional[float] = None) -> base.InverseMethod:
  """The inverse method ``name`` (``inverse_method=``), with ``woodbury_rows`` and
  ``inverse_power`` where they apply.

  Raises:
    ValueError: on an unknown name, a ``woodbury_rows`` that is not a positive int, given to a
      method that keeps no low-rank form, or missing for ``'low_rank'``; an ``inverse_power``
      that is not ``None`` or a Python number in ``(0, 1]`` (a traced value from
      ``optax.inject_hyperparams`` included), or other than 1 for a method that stores inverses
      (only ``'eigh'`` keeps the eigenvalues a power needs).
  """
  if name not in METHODS:
    raise ValueError(f"inverse_method must be one of {tuple(METHODS)}, got {name!r}")
  if inverse_power is None:
    inverse_power = 1.0
  if (not isinstance(inverse_power, (int, float, np.integer, np.floating))
      or isinstance(inverse_power, bool) or not 0.0 < float(inverse_power) <= 1.0):
    raise ValueError(
        f"inverse_power must be None or a Python number in (0, 1], got {inverse_power!r}; 1 "
        "(None) is the natural gradient, 0.5 its square root. It decides the preconditioner "
        "when the transform is built, so it cannot be traced: with optax.inject_hyperparams "
        "pass 'inverse_power' in static_args.")
  cls, rows = METHODS[name]
  if float(inverse_power) != 1.0 and not cls.takes_inverse_power:
    raise ValueError(
        f"inverse_power={inverse_power} needs inverse_method='eigh' (its eigenvalues can be "
        f"raised to any power); inverse_method={name!r} stores damped inverses. Pass "
        "inverse_method='eigh', or leave inverse_power at 1.")
  if woodbury_rows is not None and (not isinstance(woodbury_rows, (int, np.integer))
                                    or isinstance(woodbury_rows, bool) or woodbury_rows < 1):
    raise ValueError(f"woodbury_rows must be a positive Python int or None, got "
                     f"{woodbury_rows!r}; it fixes array shapes of the state, so it cannot be "
                     "a traced value: " + static_args.hint())
  if woodbury_rows is not None and rows == "no":
    raise ValueError(
        f"woodbury_rows keeps factors in low-rank Woodbury form: it needs inverse_method="
        f"'woodbury', 'low_rank' or 'auto', not {name!r}.")
  if woodbury_rows is None and rows == "required":
    raise ValueError(f"inverse_method={name!r} needs woodbury_rows=m, the rows a factor may "
                     "have.")
  if cls.takes_inverse_power:
    return cls(float(inverse_power))
  if rows == "no":
    return cls()
  return cls(None if woodbury_rows is None else int(woodbury_rows))

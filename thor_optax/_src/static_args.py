"""Constructor arguments: the ``static_args`` each constructor needs under
``optax.inject_hyperparams``, and the checks every constructor shares.

``optax.inject_hyperparams(factory, static_args=...)(...)`` turns every numeric argument (the
defaults too) into an array, so that the learning rate and damping can change between steps
without recompiling. Options that fix array shapes or decide in Python which blocks are refreshed
or averaged cannot be arrays; they must be named in ``static_args``. The errors that find such
an option traced name the tuple for every constructor (:func:`hint`);
``tests/test_optax_wrappers.py`` runs each tuple.

The same reason shapes the checks of numeric arguments at construction (:func:`real_value`,
:func:`check_number`): a concrete number (a Python or numpy scalar, a 0-d array with a value)
is checked when the transform is built, a value traced by ``inject_hyperparams`` under
``jax.jit`` passes unchecked (the steps check what they can: a damping that is not finite and
positive skips the step). :func:`check_transform` and :func:`check_state` give the wrappers'
errors for a wrapped object that is not a transform and for a state that is not theirs;
:func:`check_update_keywords` catches a misspelled ``curvature_stats=`` of ``update``.
"""

from __future__ import annotations

import difflib
import numbers
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

# Constructor -> the numeric options of its defaults that must stay Python values (add an option
# you pass yourself among ema_decay, ema_rows_ratio, max_stale_checks, inverse_power,
# adaptive_refresh, max_refresh_interval).
STATIC_ARGS = {
    "thor": ("block_size", "ema_decay", "ema_rows_ratio"),
    "kfac": ("ema_decay", "inverse_period"),
    "kaisa": ("ema_decay", "inverse_period"),
    "spngd": ("adaptive_refresh", "max_refresh_interval"),
    "skfac": (),
    "scale_by_thor": ("block_size", "inverse_period", "refresh_buckets"),
    "scale_by_kfac": ("ema_decay", "inverse_period"),
}


def hint() -> str:
  """One sentence naming the ``static_args`` of every constructor."""
  parts = "; ".join(f"{name}: {args!r}" for name, args in STATIC_ARGS.items() if args)
  return (f"with optax.inject_hyperparams pass it in static_args, with those of the "
          f"constructor ({parts}; add an option of this kind that you set yourself).")


def real_value(value: Any) -> Optional[float]:
  """``value`` as a Python float if it is a concrete real number, else ``None``.

  Concrete real numbers: Python and numpy ints and floats (not bools), and 0-d integer or
  floating arrays (numpy or JAX) whose value is known. ``None`` for everything else: a value
  traced under ``jax.jit`` (``optax.inject_hyperparams``), an array of several entries, a
  schedule, a string, ``None``.
  """
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, jax.core.Tracer) or not isinstance(value, (np.ndarray, jax.Array)):
    return None
  if value.ndim != 0 or not (jnp.issubdtype(value.dtype, jnp.integer)
                             or jnp.issubdtype(value.dtype, jnp.floating)):
    return None
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    return None
  return float(value)


def check_number(where: str, name: str, value: Any, ok: Callable[[float], bool], what: str, *,
                 optional: bool = False, schedule: bool = False, advice: str = "") -> None:
  """Checks a numeric argument at construction.

  Args:
    where: the function, e.g. ``'thor'`` (messages start ``thor_optax.thor:``).
    name: the argument's name.
    value: the argument.
    ok: the range check of a concrete value (a Python float).
    what: the range in words, e.g. ``'finite and > 0'``.
    optional: ``None`` is allowed (the argument's "off").
    schedule: a callable of the step (an optax schedule) is allowed.
    advice: a sentence appended to the messages.

  Raises:
    TypeError: for a value that is no number (a string, a bool, ``None`` where not
      ``optional``, a callable where not ``schedule``, any other object).
    ValueError: for a concrete number (see :func:`real_value`) that fails ``ok``.
  """
  number = real_value(value)
  if number is not None:
    if not ok(number):
      raise ValueError(f"thor_optax.{where}: {name} must be {what}, got {value!r}."
                       + (f" {advice}" if advice else ""))
    return
  if value is None and optional:
    return
  if (isinstance(value, (jax.core.Tracer, jax.Array, np.ndarray))
      and jnp.issubdtype(value.dtype, jnp.number)):
    return  # traced (inject_hyperparams) or an array: checked by the steps
  if callable(value) and schedule:
    return
  kinds = "a number" + (" or an optax schedule of the step" if schedule else "") + (
      " or None" if optional else "")
  raise TypeError(f"thor_optax.{where}: {name} must be {kinds} ({what}), got "
                  f"{type(value).__name__} {value!r}." + (f" {advice}" if advice else ""))


def check_transform(where: str, name: str, value: Any) -> None:
  """Raises ``TypeError`` unless ``value`` is an optax transformation (``init`` and ``update``).

  The message says what was passed instead: a function (the constructor itself, not called),
  or anything else (arguments in the wrong order).
  """
  if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
    return
  if callable(value):
    got = getattr(value, "__name__", type(value).__name__)
    hint = (f"got the function {got!r} itself: call it, e.g. {got}(...), and pass the "
            f"transformation it returns.")
  else:
    hint = (f"got {type(value).__name__} {value!r} (are the arguments in the order of the "
            f"signature?).")
  raise TypeError(f"thor_optax.{where}: {name} must be an optax GradientTransformation "
                  f"(with init and update); {hint}")


def check_state(where: str, state: Any, fields: tuple[str, ...], kind: str) -> None:
  """Raises ``TypeError`` unless ``state`` has the attributes ``fields`` of the state ``kind``
  that ``init`` returned (``None``, or parameters passed in its place)."""
  if all(hasattr(state, f) for f in fields):
    return
  raise TypeError(
      f"thor_optax.{where}: update's state must be the {kind} that init returned, got "
      f"{type(state).__name__}; call update(grads, opt_state, params) with opt_state = "
      f"tx.init(params) (in this order).")


# Keyword arguments of the preconditioners' update, and names close to them that are typos.
UPDATE_KEYWORDS = ("curvature_stats", "gradient_stats")


def check_update_keywords(where: str, extra_args: dict[str, Any]) -> None:
  """Raises ``ValueError`` for an extra keyword of ``update`` that is a misspelling of
  ``curvature_stats`` or ``gradient_stats`` (``difflib`` ratio >= 0.8, or ``'stats'``).

  Other unknown names pass: ``optax.chain`` gives every extra argument to every member that
  takes extra arguments, those of other members included.
  """
  for key in extra_args:
    close = difflib.get_close_matches(key, UPDATE_KEYWORDS, n=1, cutoff=0.8)
    if key in ("stats", "statistics") and not close:
      close = ["curvature_stats (a check step) or gradient_stats (a plain step from the rows)"]
    if close:
      raise ValueError(
          f"thor_optax.{where}: update got the keyword {key!r}, which it does not take; did you "
          f"mean {close[0]}? (Unknown keywords are left to the other members of a chain, so a "
          f"misspelled one would turn every check step into a plain step.)")

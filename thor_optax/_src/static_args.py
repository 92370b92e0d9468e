"""The ``static_args`` each constructor needs under ``optax.inject_hyperparams``.

``optax.inject_hyperparams(factory, static_args=...)(...)`` turns every numeric argument (the
defaults too) into an array, so that the learning rate and damping can change between steps
without recompiling. Options that fix array shapes or decide in Python which blocks are refreshed
or averaged cannot be arrays; they must be named in ``static_args``. The errors that find such
an option traced name the tuple for every constructor (:func:`hint`);
``tests/test_optax_wrappers.py`` runs each tuple.
"""

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

"""Full optimizers: the preconditioner chained with weight decay, momentum and a learning rate.

THOR's order (MindSpore ``nn/optim/thor.py``, ``construct``): precondition the gradient, add
weight decay to the *preconditioned* gradient, then momentum SGD (``ApplyMomentum``). SKFAC and
KAISA keep that order (KAISA scales the preconditioned gradient by its KL clip first); SP-NGD
replaces weight decay by rescaling the weights after the step. Everything after the
preconditioner is optax's own. The whole chain sits inside :func:`finite.skip_not_finite`: a
step whose gradient or update is not finite (a NaN in the data, a NaN learning rate or damping
from a schedule) returns zero updates and leaves momentum and curvature state as they were.

Robust defaults (benchmarks/README.md, "Robustness"): every alias KL-clips its preconditioned
update (``max_kl=1e-2``; ``thor`` 3e-2; ``kaisa``: KAISA's 1e-3; Ba et al. 2017, section 5) and
floors each factor block's damping at ``min_relative_damping`` times its mean eigenvalue (0.1;
``thor``, whose pi rule gives ``G`` less damping, 1; ``damping.py``). On
a learning-rate x damping grid of the MNIST MLP these took THOR and SKFAC from 15 and 16
non-finite runs of 20 to none, and left no alias with a non-finite or diverged run. The
building blocks ``scale_by_thor`` / ``scale_by_kfac`` keep the papers' damping (no floor) and
no clip unless asked.

References:
  Chen et al., "THOR", AAAI 2021; MindSpore ResNet-50 THOR recipe (polynomial learning-rate
  decay, damping ``lambda_0 * decay^(epoch / 10)``).
  Tang et al., "SKFAC", CVPR 2021 (official MindSpore code: current-batch factors, Woodbury,
  conv reduce; damping 0.03).
  Pauloski et al., "KAISA", SC 2021 (kfac-pytorch defaults: damping 0.001, factor decay 0.95,
  KL clip 0.001, eigendecomposition, inverse every 10 factor updates in the ImageNet example).
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020 (empirical Fisher, pi
  damping, newest statistics only, unit-wise BN Fisher, adaptive refresh, weight rescaling).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional, Union

import optax

from thor_optax._src import finite
from thor_optax._src import inverses
from thor_optax._src import kl_clip
from thor_optax._src import momentum as momentum_lib
from thor_optax._src import static_args
from thor_optax._src import transform
from thor_optax._src import weight_ratio
from thor_optax._src import weight_rescaling

ScalarOrSchedule = Union[float, optax.Schedule]


def _check_settings(where: str, learning_rate: Any, damping: Any, momentum: Any,
                    weight_decay: Any = 0.0) -> None:
  """Rejects numbers that cannot train and arguments that are no numbers.

  Concrete numbers (Python or numpy scalars, 0-d arrays) are checked here; schedules and values
  traced by ``optax.inject_hyperparams`` are checked at each step instead (see
  :func:`finite.skip_not_finite`).
  """
  static_args.check_number(where, "learning_rate", learning_rate, lambda v: 0 <= v < math.inf,
                           "finite and >= 0", schedule=True)
  static_args.check_number(where, "damping", damping, lambda v: 0 < v < math.inf,
                           "finite and > 0", schedule=True)
  static_args.check_number(where, "momentum", momentum, lambda v: 0 <= v < 1, "in [0, 1)",
                           optional=True)
  static_args.check_number(where, "weight_decay", weight_decay, lambda v: 0 <= v < math.inf,
                           "finite and >= 0", schedule=True)


def _first_order_tail(learning_rate: ScalarOrSchedule, momentum: float, nesterov: bool,
                      debias_momentum: bool, weight_decay: float, weight_decay_mask: Any,
                      max_update_ratio: Optional[float], layers: Any) -> list:
  # No Python branching on the numbers: optax.inject_hyperparams passes them in as arrays.
  return [optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
          *_momentum_sgd(learning_rate, momentum, nesterov, debias_momentum),
          *_step_clip(max_update_ratio, layers)]


def _momentum_sgd(learning_rate: ScalarOrSchedule, momentum: float, nesterov: bool,
                  debias_momentum: bool) -> list:
  """``optax.sgd``, then its momentum's bias correction when ``debias_momentum``."""
  sgd = [optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)]
  if not debias_momentum:
    return sgd
  return sgd + [momentum_lib.scale_by_momentum_bias_correction(momentum, nesterov)]


def _step_clip(max_update_ratio: Optional[float], layers: Any) -> list:
  """``[clip_by_weight_ratio(max_update_ratio, layers=layers)]``, or ``[]`` for ``None``."""
  if max_update_ratio is None:
    return []
  return [weight_ratio.clip_by_weight_ratio(max_update_ratio, layers=layers)]


def _preconditioner(pre: optax.GradientTransformation, learning_rate: ScalarOrSchedule,
                    max_kl: Optional[float], mask: Any) -> optax.GradientTransformation:
  """The preconditioner, restricted to ``mask``'s parameters if one is given (``optax.masked``:
  the others pass through it unchanged and get no curvature state), then KL-clipped
  (:func:`kl_clip.scale_by_kl_clip`) unless ``max_kl`` is ``None``. The clip reads and scales
  every leaf, masked or not, so a mask that drops layers the capture never preconditions
  (:func:`thor_optax.captured_mask`) changes the memory, not the updates."""
  pre = pre if mask is None else optax.masked(pre, mask)
  return pre if max_kl is None else kl_clip.scale_by_kl_clip(pre, learning_rate, max_kl)


def _guarded(skip: bool, tx: optax.GradientTransformationExtraArgs
             ) -> optax.GradientTransformationExtraArgs:
  """``tx`` inside :func:`finite.skip_not_finite` if ``skip``."""
  return finite.skip_not_finite(tx) if skip else tx


def thor(
    learning_rate: ScalarOrSchedule,
    damping: ScalarOrSchedule = 0.03,
    *,
    momentum: float = 0.9,
    nesterov: bool = True,
    debias_momentum: bool = False,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    block_size: Optional[int] = 128,
    trace_thresholds: tuple[float, float] = (0.01, 0.0),
    max_stale_checks: Optional[int] = None,
    ema_decay: Optional[float] = 0.95,
    ema_rows_ratio: Optional[float] = 4.0,
    pi_damping: Optional[bool] = None,
    max_pi: Optional[float] = 5.0,
    inverse_method: str = "cholesky",
    inverse_power: Optional[float] = None,
    block_sharding: Optional[Any] = None,
    axis_name: Optional[Union[str, tuple[str, ...]]] = None,
    precondition_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    layers: Optional[Any] = None,
    max_kl: Optional[float] = 3e-2,
    max_update_ratio: Optional[float] = None,
    min_relative_damping: float = 1.0,
    skip_not_finite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """THOR: :func:`scale_by_thor` with a KL clip, then weight decay, then Nesterov-momentum SGD.

  Args:
    learning_rate: float or optax schedule (the paper's shape:
      :func:`thor_learning_rate_schedule`).
    damping: float or schedule of the step (the paper's shape: :func:`thor_damping_schedule`).
    momentum: momentum of the SGD step after the preconditioner (0.9 in the paper).
    nesterov: Nesterov momentum (``optax.sgd(..., nesterov=True)``, as ``optax.contrib.muon``);
      ``False``: the paper's heavy-ball momentum. Default ``True``: on the MNIST models of
      ``benchmarks/`` (6 seeds, the tuned learning rate and damping) it took the CNN to 95 / 96
      / 97% test accuracy in 62 / 78 / 140 steps (means) instead of heavy-ball's 73 / 88 / 158,
      and the MLP to 92% in 95 instead of 105, with best accuracy 0.1-0.2 points lower (CNN
      0.973 against 0.974, MLP 0.927 against 0.930), and the character-level language model
      of ``benchmarks/lm.py`` to AdamW's final validation loss in 200 steps instead of 280
      (one seed; final 3.352 bits per character against 3.396); both learning-rate x damping
      grids of ``benchmarks/robustness.py`` stayed without a non-finite or diverged run
      (benchmarks/README.md, "Which of THOR's approximations costs steps").
    debias_momentum: divide the momentum SGD's update at step ``t`` by ``1 - momentum^t``
      (``t + 1`` with Nesterov; :func:`scale_by_momentum_bias_correction`, Adam's bias
      correction), so the first steps are full-size instead of growing over tens of steps.
      Default ``False``: on the MNIST models of ``benchmarks/`` (12 seeds, the tuned rate and
      damping) it took the CNN to 95 / 96% test accuracy in 45 / 69 steps (means, evaluated
      every 10 steps) instead of 52 / 78 and the MLP to 92% in 59 instead of 66, with the
      same best accuracy and the same language-model steps (3 seeds), but the MLP's
      learning-rate x damping grids of ``benchmarks/robustness.py`` on seeds 1-3 had 4
      diverged runs of 60, at damping 1e-4 and learning rates 0.003 and 0.01 (last-10 losses
      up to 1604; the default: none): there the KL clip does not bind, and the corrected first
      steps move by the full momentum's multiple (``1 / (1 - momentum)``) of a natural
      gradient taken at the initial curvature. With the KL clip measuring the corrected rate
      the grids train but the CNN's gain is gone (benchmarks/README.md, "Which of THOR's
      approximations costs steps"). Two alternatives that kept those grids clean (12 seeds;
      benchmarks/README.md, "First steps"): ``max_update_ratio=0.3`` beside it (MLP 92% in
      54 steps, CNN 95% in 44, but 97% in 9 of 12 seeds), or, instead of it, a warm start of
      the rate, ``thor(optax.exponential_decay(3 * lr, 20, 0.5, end_value=lr), damping)``
      (MLP 92% in 50 steps, level with Muon; CNN 95 / 96% in 44 / 67, 97% later: 186 against
      157; on the language model's warm-up schedule a final 3.19 bits per character against
      3.13).
    weight_decay: coefficient added to the preconditioned gradient (the paper: 5e-4).
    weight_decay_mask: optax mask (tree or callable) of the parameters that decay.
    block_size, trace_thresholds, max_stale_checks, inverse_method, inverse_power: see
      :func:`scale_by_thor` (``thor(..., inverse_method='eigh', inverse_power=0.5)`` is the
      square-root preconditioner that matched Adam's test accuracy on the MNIST MLP over 2,200
      steps, where the default stops 1.4 points below Adam's; benchmarks/README.md, "Long
      training").
    pi_damping: split the damping by K-FAC's pi rule (:func:`scale_by_thor`): ``pi sqrt(lambda)``
      to ``A`` and ``sqrt(lambda) / pi`` to ``G``, ``pi = sqrt((tr A / d_A) / (tr G / d_G))``
      clipped by ``max_pi``; ``False``: THOR's equal split, ``sqrt(lambda)`` to each. ``None``
      (default): the rule wherever the inverse method damps the factors one by one, that is
      every method but ``'eigh'``, whose exact damping of ``A (x) G`` has no split. Why: the
      output-gradient factor ``G`` of a mean loss has mean eigenvalues far below
      ``sqrt(lambda)`` (4e-4 to 2e-3 on the MNIST MLP's hidden layers against ``sqrt(0.03) =
      0.17``), so the equal split leaves ``(G + sqrt(lambda) I)^-1`` close to a multiple of the
      identity and preconditions the input side only; the rule moves damping from ``G`` to
      ``A``. Evidence (benchmarks/README.md, "Which of THOR's approximations costs steps", 6 seeds,
      the tuned settings): with ``max_pi=5``, the floor below and the KL clip at 1e-2, THOR reached
      92% test accuracy on the MNIST MLP in 65 steps (means) instead of the equal split's 95,
      with best accuracy 0.936 instead of 0.927, and 95 / 96 / 97% on the CNN in 62 / 77 / 163
      instead of 62 / 78 / 140; the language model of ``benchmarks/lm.py`` (one seed) ended
      at 3.331 bits per character instead of 3.352.
    max_pi: with the pi rule, ``pi`` is clipped to ``[1 / max_pi, max_pi]`` (``None``: the rule
      unclipped; 1: the equal split). Default 5. On the MNIST CNN a convolution's ``pi`` is
      1.4e3 to 3.4e4; unclipped, the rule damps its ``A (x) G`` by about ``lambda``, far above
      its eigenvalues, and its update becomes about its gradient over ``lambda`` (3 seeds: the
      CNN reached 95 / 96% in 77 / 163 steps and never 97%, best accuracy 0.964 against 0.975
      clipped). Clipped at 5 it keeps the MLP's gain (its dense layers' ``pi`` is 5 to 16).
    ema_decay: running average of each factor block across its refreshes, ``decay * old +
      (1 - decay) * new`` (:func:`scale_by_thor`), or ``None`` for the paper's current-batch
      factors. Default 0.95 (kfac-pytorch's ``factor_decay``), applied to the blocks
      ``ema_rows_ratio`` selects; THOR's paper has ``None``.
    ema_rows_ratio: average only the blocks formed from fewer than this many rows per
      dimension (rows: examples x positions); the others take the current batch's factor.
      Default 4. A batch of ``R`` rows gives a block of rank at most ``R``: a 128-block of a
      dense layer that sees 128 rows is near-singular, and its inverse, kept until the trace
      rule refreshes it, is about ``1 / sqrt(lambda)`` on every direction the batch missed;
      the average fills those directions from earlier checks. A block from ``R >= 4 d`` rows
      is well conditioned on its own, and averaging it only keeps stale curvature. Evidence
      (benchmarks/README.md, "Which of THOR's approximations costs steps", 3 seeds): on the MNIST
      models these defaults took the CNN to 95 / 96 / 97% test accuracy in 70 / 83 / 137 steps
      (means) instead of the paper's 83 / 97 / 173, and the MLP to 92% in 103 instead of 127; on the
      language model of ``benchmarks/lm.py`` (1,024 rows per block) averaging every block cost
      steps (80 instead of 60 to 3.8 bits per character, final 3.460 instead of 3.396), and
      with the ratio its blocks are not averaged (final 3.391). The stored factors double the
      factor blocks' memory; the step cost is one blend per refreshed block.
    Under ``optax.inject_hyperparams`` list ``block_size``, ``ema_decay``, ``ema_rows_ratio``
    and ``max_stale_checks`` in ``static_args``: they fix the state's shapes and which blocks
    are averaged or refreshed.
    block_sharding: shard the inversion work over a mesh axis; see :func:`scale_by_thor`.
    axis_name: under ``jax.pmap(..., axis_name=...)``, that name: check steps average the
      curvature statistics across replicas; see :func:`scale_by_thor`.
    precondition_mask: optax mask (tree or callable) of the parameters preconditioned; the
      others skip the preconditioner (no Kronecker blocks in the state) and only take the
      steps after it, the KL clip's scale among them. :func:`thor_optax.captured_mask`
      makes it from a capture's statistics.
    layers: the capture's layout, :func:`thor_optax.captured_layers` of its statistics (the
      layers it takes, as it takes them: attention projections without bias, einsums);
      ``None``: layers claimed from parameter shapes. See :func:`scale_by_thor`.
    max_kl: the KL clip of the preconditioned update (:func:`scale_by_kl_clip`,
      ``lr^2 <u, g> <= max_kl``; KAISA's), or ``None`` for none. Default 3e-2, 30 times
      kfac-pytorch's 1e-3 (which slowed THOR on the MNIST MLP; the other aliases: 1e-2). With
      the floor below it keeps every setting of a learning-rate x damping grid finite and
      training (benchmarks/README.md, "Robustness"). At the tuned settings the clip binds on the
      MNIST CNN's early steps: with 3e-2 instead of 1e-2 THOR reached 95 / 96 / 97% test accuracy in
      50 / 72 / 130 steps instead of 62 / 77 / 163 (means of 6 seeds; 0.1: 47 / 70 / 97% in 4 of 6),
      the MLP's runs were unchanged, and the language model of ``benchmarks/lm.py`` reached
      AdamW's final loss in the same 200 steps (benchmarks/README.md, "Which of THOR's
      approximations costs steps").
      On a plain step with ``gradient_stats=`` the clip's ``<u, g>`` of a layer preconditioned
      from its rows comes from the rows too, so its kernel gradient is still not formed.
    max_update_ratio: clip each kernel's step (after the learning rate and momentum) to at
      most this share of the kernel's norm (:func:`clip_by_weight_ratio`; leaves of two or more
      dimensions), or ``None`` (the default here and in :func:`kfac`, :func:`skfac`,
      :func:`spngd`) for no clip. :func:`kaisa` takes 0.1 by default. In ``thor`` 0.1 binds at
      the tuned rate: the MNIST CNN reached 95 / 96% in more steps (6 seeds) and, at damping
      1e-4 on seeds 3-5 of init and batch order, three runs of 12 diverged instead of one (with
      the collapse rule at 1% then; benchmarks/README.md, "Robustness").
    min_relative_damping: floor ``rho`` on each factor block's damping relative to its mean
      eigenvalue (see :func:`scale_by_thor`); 0 for the paper's damping alone. Default 1 (the
      other aliases: 0.1). With the pi rule, ``G`` gets as little as ``sqrt(lambda) / 5``,
      and at ``rho = 0.1`` one setting of the CNN's learning-rate x damping grid of
      ``benchmarks/robustness.py`` diverged (lr 0.1, damping 1e-4: final loss 11.2); at 1 both
      grids train in every setting (0 non-finite, 0 diverged of 20 each). The floor binds at
      the tuned damping only where a block's mean eigenvalue is above its damping: the
      convolutions' ``A`` (mean eigenvalue 157 on the MNIST CNN). It does not cover every
      seed: at damping 1e-4 and learning rates 0.01-0.3, over seeds 3-5 of init and batch
      order (12 runs), one run diverged (final training loss 2.51 against 2.30 at the first
      step) and one ended at 0.56 (with ``max_kl=1e-2``: 2.18, and three at 0.48-0.65), where
      the equal split with the clip at 1e-2 ended every run below 0.11 (README, "Which of
      THOR's approximations costs steps").
    skip_not_finite: a step whose gradient or update has a NaN or an Inf returns zero updates
      and leaves the whole state (momentum, curvature) unchanged, counted in the state's
      ``optax.ApplyIfFiniteState`` (:func:`thor_optax.skip_not_finite`); ``False``: no check.

  Returns:
    an ``optax.GradientTransformationExtraArgs``; pass ``curvature_stats=`` to ``update`` on
    check steps, and optionally ``gradient_stats=`` on every step whose statistics are those of
    the gradient's batch (dense layers narrower in rows than in dimensions are then
    preconditioned from their rows; :func:`scale_by_thor`).

  Raises:
    TypeError: as :func:`scale_by_thor`, or for a learning rate, damping, momentum or weight
      decay that is no number nor schedule (a string, ``None``, a bool).
    ValueError: as :func:`scale_by_thor`, or for a learning rate, damping, momentum or weight
      decay that is a number (Python or numpy scalar, 0-d array) and cannot train (not
      finite, negative, momentum >= 1).
  """
  _check_settings("thor", learning_rate, damping, momentum, weight_decay)
  if pi_damping is None:  # eigh damps A (x) G exactly: no split
    pi_damping = inverses.damps_factors_separately(inverse_method)
  return _guarded(skip_not_finite, optax.chain(
      _preconditioner(transform.scale_by_thor(
          damping, block_size=block_size, trace_thresholds=trace_thresholds,
          max_stale_checks=max_stale_checks, ema_decay=ema_decay,
          ema_rows_ratio=ema_rows_ratio, pi_damping=pi_damping, max_pi=max_pi,
          min_relative_damping=min_relative_damping, inverse_method=inverse_method,
          inverse_power=inverse_power, block_sharding=block_sharding,
          axis_name=axis_name, layers=layers), learning_rate, max_kl, precondition_mask),
      *_first_order_tail(learning_rate, momentum, nesterov, debias_momentum, weight_decay,
                         weight_decay_mask, max_update_ratio, layers)))


def kfac(
    learning_rate: ScalarOrSchedule,
    damping: ScalarOrSchedule = 0.03,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    debias_momentum: bool = False,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    ema_decay: Optional[float] = 0.95,
    block_size: Optional[int] = None,
    pi_damping: bool = False,
    max_pi: Optional[float] = None,
    inverse_method: str = "cholesky",
    inverse_power: Optional[float] = None,
    inverse_period: transform.Period = 1,
    block_sharding: Optional[Any] = None,
    axis_name: Optional[Union[str, tuple[str, ...]]] = None,
    precondition_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    layers: Optional[Any] = None,
    max_kl: Optional[float] = 1e-2,
    max_update_ratio: Optional[float] = None,
    min_relative_damping: float = 0.1,
    skip_not_finite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC: :func:`scale_by_kfac`, then weight decay, then momentum SGD.

  Args:
    learning_rate: float or optax schedule.
    damping: float or schedule of the step.
    momentum, nesterov, weight_decay, weight_decay_mask: as :func:`thor`.
    debias_momentum: as :func:`thor`; default ``False``, the paper's momentum.
    ema_decay, block_size, pi_damping, max_pi, inverse_method, inverse_power, inverse_period:
      see :func:`scale_by_kfac` (``kfac(..., inverse_method='eigh')`` is KAISA without KL
      clip).
    block_sharding, axis_name, precondition_mask, layers, max_kl, max_update_ratio,
      min_relative_damping, skip_not_finite: as :func:`thor`.

  Returns:
    an ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError, ValueError: as :func:`scale_by_kfac`, and for the settings as :func:`thor`.
  """
  _check_settings("kfac", learning_rate, damping, momentum, weight_decay)
  return _guarded(skip_not_finite, optax.chain(
      _preconditioner(transform.scale_by_kfac(
          damping, ema_decay=ema_decay, block_size=block_size, pi_damping=pi_damping,
          max_pi=max_pi, min_relative_damping=min_relative_damping,
          inverse_method=inverse_method, inverse_power=inverse_power,
          inverse_period=inverse_period, block_sharding=block_sharding, axis_name=axis_name,
          layers=layers), learning_rate, max_kl, precondition_mask),
      *_first_order_tail(learning_rate, momentum, nesterov, debias_momentum, weight_decay,
                         weight_decay_mask, max_update_ratio, layers)))


def skfac(
    learning_rate: ScalarOrSchedule,
    damping: ScalarOrSchedule = 0.03,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    debias_momentum: bool = False,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    inverse_method: str = "auto",
    conv_statistics: str = "reduce_sum",
    spatial_samples: Optional[int] = None,
    subsample_key: Optional[Any] = None,
    block_size: Optional[int] = None,
    woodbury_rows: Optional[int] = None,
    block_sharding: Optional[Any] = None,
    axis_name: Optional[Union[str, tuple[str, ...]]] = None,
    precondition_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    layers: Optional[Any] = None,
    max_kl: Optional[float] = 1e-2,
    max_update_ratio: Optional[float] = None,
    min_relative_damping: float = 0.1,
    skip_not_finite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """SKFAC: current-batch factors inverted by Woodbury where they are low-rank, then momentum SGD.

  :func:`scale_by_kfac` with ``ema_decay=None``, ``inverse_method='auto'`` (an ``m x m`` solve
  for every factor with fewer rows ``m`` than dimensions: the dense layers' factors when the
  batch is smaller than the width, and the conv factors after the reduction) and
  ``conv_statistics='reduce_sum'``; then weight decay and momentum SGD as in :func:`thor`.

  Args:
    learning_rate: float or optax schedule (SKFAC: ``lr_0 0.87^epoch``, e.g.
      ``optax.exponential_decay``).
    damping: ``lambda`` (float or schedule); ``sqrt(lambda)`` per factor.
    momentum, nesterov, weight_decay, weight_decay_mask: as :func:`thor`.
    debias_momentum: as :func:`thor`; default ``False``, the paper's momentum.
    inverse_method: ``'auto'`` or ``'woodbury'`` (every factor by Woodbury).
    conv_statistics, spatial_samples, subsample_key, block_size: see :func:`scale_by_thor`.
    woodbury_rows: the batch size (rows behind a factor; with ``axis_name``, the batch of all
      replicas together), to keep the low-rank factors in Woodbury form in the state: less
      memory than dense inverses, and cheaper steps (see :func:`scale_by_thor`); ``None``
      stores dense inverses.
    block_sharding, axis_name, precondition_mask, layers, max_kl, max_update_ratio,
      min_relative_damping, skip_not_finite: as :func:`thor`.

  Returns:
    an ``optax.GradientTransformationExtraArgs``; pass ``curvature_stats=`` on check steps,
    and optionally ``gradient_stats=`` on every step (see :func:`thor`).

  Raises:
    TypeError, ValueError: as :func:`scale_by_kfac`, and for the settings as :func:`thor`.
  """
  _check_settings("skfac", learning_rate, damping, momentum, weight_decay)
  return _guarded(skip_not_finite, optax.chain(
      _preconditioner(transform.scale_by_kfac(
          damping, ema_decay=None, block_size=block_size,
          min_relative_damping=min_relative_damping, inverse_method=inverse_method,
          conv_statistics=conv_statistics, spatial_samples=spatial_samples,
          subsample_key=subsample_key, woodbury_rows=woodbury_rows,
          block_sharding=block_sharding, axis_name=axis_name, layers=layers),
          learning_rate, max_kl, precondition_mask),
      *_first_order_tail(learning_rate, momentum, nesterov, debias_momentum, weight_decay,
                         weight_decay_mask, max_update_ratio, layers)))


def kaisa(
    learning_rate: ScalarOrSchedule,
    damping: ScalarOrSchedule = 0.001,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    debias_momentum: bool = False,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    ema_decay: float = 0.95,
    inverse_period: transform.Period = 10,
    inverse_power: Optional[float] = None,
    max_kl: Optional[float] = 0.001,
    max_update_ratio: Optional[float] = 0.1,
    block_size: Optional[int] = None,
    block_sharding: Optional[Any] = None,
    axis_name: Optional[Union[str, tuple[str, ...]]] = None,
    precondition_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    layers: Optional[Any] = None,
    min_relative_damping: float = 0.1,
    skip_not_finite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """KAISA: running-average factors, eigendecompositions every ``inverse_period`` steps, KL clip.

  :func:`scale_by_kfac` with ``inverse_method='eigh'`` (exact damping of ``A (x) G``), wrapped
  in :func:`scale_by_kl_clip`, then weight decay and momentum SGD. Check steps (the factor
  period) are the training loop's, e.g. ``CheckSchedule(1)``; the eigendecompositions run at
  the first check step at least ``inverse_period`` steps after the last.

  Args:
    learning_rate: float or optax schedule (also used by the KL clip).
    damping: ``lambda`` added to the eigenvalue products (kfac-pytorch: 0.001).
    momentum, nesterov, weight_decay, weight_decay_mask: as :func:`thor`.
    debias_momentum: as :func:`thor`; default ``False``, the paper's momentum.
    ema_decay: running-average decay of the factors (kfac-pytorch ``factor_decay``: 0.95).
    inverse_period: steps between eigendecompositions (int or schedule).
    inverse_power: ``p`` in ``(A (x) G + lambda I)^-p`` (default ``None``: 1); see
      :func:`scale_by_thor`.
    max_kl: KL-clip bound ``kappa``, or ``None`` for no clipping.
    max_update_ratio: clip each kernel's step to at most this share of the kernel's norm
      (:func:`clip_by_weight_ratio`), or ``None``. Default 0.1 (not in kfac-pytorch): the KL
      clip bounds ``lr^2 <u, g>``, not the step's length along directions where the damped
      eigenvalues are tiny, and on the MNIST CNN's learning-rate x damping grid of
      ``benchmarks/robustness.py`` the run at lr 0.003 and damping 1e-4 took steps of 20-30% of
      its kernels' norms and diverged (last-10 loss 320 against 2.30 at the first step);
      with the clip it trains (2e-6), and at the tuned settings the clip never acts (the same
      steps to every target on 6 seeds of both MNIST models; benchmarks/README.md, "Robustness").
    block_sharding, axis_name, precondition_mask, layers, min_relative_damping,
      skip_not_finite: as :func:`thor`.

  Returns:
    an ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError, ValueError: as :func:`scale_by_kfac`, and for the settings as :func:`thor`.
  """
  _check_settings("kaisa", learning_rate, damping, momentum, weight_decay)
  pre = transform.scale_by_kfac(damping, ema_decay=ema_decay, block_size=block_size,
                                min_relative_damping=min_relative_damping,
                                inverse_method="eigh", inverse_power=inverse_power,
                                inverse_period=inverse_period, block_sharding=block_sharding,
                                axis_name=axis_name, layers=layers)
  return _guarded(skip_not_finite, optax.chain(
      _preconditioner(pre, learning_rate, max_kl, precondition_mask),
      *_first_order_tail(learning_rate, momentum, nesterov, debias_momentum, weight_decay,
                         weight_decay_mask, max_update_ratio, layers)))


def spngd(
    learning_rate: ScalarOrSchedule,
    damping: ScalarOrSchedule = 0.001,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    debias_momentum: bool = False,
    adaptive_refresh: Optional[float] = 0.1,
    max_refresh_interval: int = 64,
    ema_decay: Optional[float] = None,
    rescale_weights: bool = True,
    block_size: Optional[int] = None,
    block_sharding: Optional[Any] = None,
    axis_name: Optional[Union[str, tuple[str, ...]]] = None,
    precondition_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    layers: Optional[Any] = None,
    max_kl: Optional[float] = 1e-2,
    max_update_ratio: Optional[float] = None,
    min_relative_damping: float = 0.1,
    max_pi: Optional[float] = 5.0,
    skip_not_finite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """SP-NGD: pi-damped K-FAC with adaptive refresh, unit-wise normalization layers, rescaling.

  :func:`scale_by_kfac` with ``pi_damping=True``, the newest statistics only
  (``cov_ema_decay = 1`` in chainerkfac, i.e. ``ema_decay=None`` here) and
  ``adaptive_refresh``; normalization layers get the unit-wise 2x2 Fisher whenever their
  statistics are captured; then momentum SGD and, instead of weight decay, SP-NGD's weight
  rescaling (:func:`rescale_weight_norms`). Capture with ``fisher_type='empirical'`` (the
  default of ``value_and_grad_with_stats``), as SP-NGD does.

  Args:
    learning_rate: float or optax schedule (SP-NGD: constant, then polynomial decay).
    damping: ``lambda`` (chainerkfac ImageNet: 2.5e-4 to 1e-4 at batch 4K-131K).
    momentum, nesterov: momentum SGD.
    debias_momentum: as :func:`thor`; default ``False``, SP-NGD's momentum.
    adaptive_refresh: tolerance of the adaptive refresh (see :func:`scale_by_kfac`), or
      ``None`` to refresh every block at every check step.
    max_refresh_interval: cap on a block's interval, in steps.
    ema_decay: running average of the factors (SP-NGD: ``None``).
    rescale_weights: cap kernel norms at ``sqrt(2 d_out)`` after each step.
    block_size: ``None`` or THOR's split size.
    block_sharding, axis_name, precondition_mask, layers, max_kl, max_update_ratio,
      min_relative_damping, skip_not_finite: as :func:`thor`.
    max_pi: ``pi`` of the pi rule clipped to ``[1 / max_pi, max_pi]`` (``None``: SP-NGD's
      unclipped rule). Default 5, as :func:`thor`'s: unclipped, ``pi`` reaches the thousands
      on a convolution, whose ``G`` then gets as little as ``sqrt(lambda) / pi``, and three
      settings of the CNN's learning-rate x damping grid of ``benchmarks/robustness.py`` ended
      in loss spikes above the first step's loss (lr 0.03 and damping 1e-3 / 1e-4, lr 0.3 and
      damping 1e-3: last-10 losses 3.08, 3.72, 3.96 against 2.30; benchmarks/README.md,
      "Robustness").

  Returns:
    an ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError, ValueError: as :func:`scale_by_kfac`, and for the settings as :func:`thor`.
  """
  _check_settings("spngd", learning_rate, damping, momentum)
  tail = [*_momentum_sgd(learning_rate, momentum, nesterov, debias_momentum),
          *_step_clip(max_update_ratio, layers)]
  if rescale_weights:
    tail.append(weight_rescaling.rescale_weight_norms(layers=layers))
  return _guarded(skip_not_finite, optax.chain(
      _preconditioner(transform.scale_by_kfac(
          damping, ema_decay=ema_decay, block_size=block_size, pi_damping=True, max_pi=max_pi,
          min_relative_damping=min_relative_damping, adaptive_refresh=adaptive_refresh,
          max_refresh_interval=max_refresh_interval, block_sharding=block_sharding,
          axis_name=axis_name, layers=layers), learning_rate, max_kl, precondition_mask),
      *tail))


def _check_steps(where: str, name: str, value: Any) -> None:
  """A number of steps: an int (Python or numpy) ``>= 1``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"thor_optax.{where}: {name} must be an int >= 1 (steps), got "
                    f"{type(value).__name__} {value!r}.")
  if value < 1:
    raise ValueError(f"thor_optax.{where}: {name} must be >= 1 (steps), got {value!r}; with 0 "
                     f"the schedule would be constant.")


def thor_learning_rate_schedule(init_value: float, decay_steps: int, power: float,
                                end_value: float = 0.0) -> optax.Schedule:
  """THOR's polynomial learning-rate decay ``lr(s) = (lr_0 - lr_end)(1 - s/S)^p + lr_end``.

  Args:
    init_value: ``lr_0``, finite and ``>= 0``.
    decay_steps: ``S``, an int ``>= 1``: steps until ``end_value`` (MindSpore:
      ``lr_end_epoch * steps/epoch``).
    power: ``p``, finite and ``>= 0`` (MindSpore ResNet-50: ``lr_decay`` = 4.08 to 6).
    end_value: ``lr_end``, finite and ``>= 0``.

  Returns:
    an optax schedule (``optax.polynomial_schedule``).

  Raises:
    TypeError: if a value is not a number (a string, ``None``), or ``decay_steps`` not an int.
    ValueError: if a number is out of its range above (negative, NaN, infinite; ``decay_steps
      < 1``, which would make the schedule constant).

  Source: Chen et al., "THOR", AAAI 2021, its ResNet-50 recipe as MindSpore publishes it
  (``models: official/cv/ResNet/src/lr_generator.py``, ``get_thor_lr``: ``lr_init (1 -
  epoch / lr_end_epoch)^lr_decay``; the recipe's two late halvings are left out).
  """
  where = "thor_learning_rate_schedule"
  finite_non_negative = lambda v: 0 <= v < math.inf
  static_args.check_number(where, "init_value", init_value, finite_non_negative,
                           "finite and >= 0")
  _check_steps(where, "decay_steps", decay_steps)
  static_args.check_number(where, "power", power, finite_non_negative, "finite and >= 0")
  static_args.check_number(where, "end_value", end_value, finite_non_negative,
                           "finite and >= 0")
  return optax.polynomial_schedule(init_value, end_value, power, int(decay_steps))


def thor_damping_schedule(init_value: float, decay_rate: float,
                          decay_steps: int) -> optax.Schedule:
  """THOR's exponential damping decay ``lambda(s) = lambda_0 * decay_rate^(s / decay_steps)``.

  Args:
    init_value: ``lambda_0``, finite and ``> 0`` (MindSpore ResNet-50: 0.03).
    decay_rate: factor per ``decay_steps``, finite and ``> 0`` (MindSpore: 0.87 or 0.5 per
      10 epochs).
    decay_steps: steps per decay period, an int ``>= 1`` (MindSpore: 10 epochs).

  Returns:
    an optax schedule (``optax.exponential_decay``, not staircased).

  Raises:
    TypeError: if a value is not a number (a string, ``None``), or ``decay_steps`` not an int.
    ValueError: if a number is out of its range above (zero or negative, NaN, infinite;
      ``decay_steps < 1``, which would make the schedule constant).

  Source: Chen et al., "THOR", AAAI 2021, its ResNet-50 recipe as MindSpore publishes it
  (``models: official/cv/ResNet/src/lr_generator.py``, ``get_thor_damping``:
  ``damping_init * damping_decay^(epoch / 10)``).
  """
  where = "thor_damping_schedule"
  finite_positive = lambda v: 0 < v < math.inf
  static_args.check_number(where, "init_value", init_value, finite_positive, "finite and > 0")
  static_args.check_number(where, "decay_rate", decay_rate, finite_positive, "finite and > 0")
  _check_steps(where, "decay_steps", decay_steps)
  return optax.exponential_decay(init_value, int(decay_steps), decay_rate)

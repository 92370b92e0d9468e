"""THOR and K-FAC (expand / reduce) against SGD, AdamW and Muon on a character-level LM.

A decoder-only transformer in Flax linen learns to predict the next character of real text: the
Python source files of a fixed list of standard-library packages, read from this interpreter's
own ``sysconfig.get_paths()['stdlib']`` (nothing downloads). Every optimizer starts from the
same initialization and sees the same batches; the benchmark measures, per optimizer:

* speed: tokens/s, ms per step (median of the check steps and of the plain steps, and the mean
  = training time / steps), and the compile time of each step function;
* progress: steps and seconds of training to each validation-loss target (bits per
  character), the final validation loss, and the steps and seconds to AdamW's final validation
  loss, with the ratios of step times and of those seconds against SGD, AdamW and Muon;
* for the second-order optimizers the fraction of the model's parameters preconditioned: the
  scalars of the layers the capture takes (``thor_optax.captured_mask`` of the statistics),
  over all scalars; the statistics' ``unhandled`` list names the rest.

Setup:

* corpus: every ``.py`` file under the packages ``PACKAGES`` (``asyncio collections concurrent
  email html http importlib json logging multiprocessing urllib wsgiref xml``) of the running
  interpreter's standard library, in sorted order of their paths relative to the stdlib
  directory, decoded as UTF-8. A file belongs to the validation split when the SHA-256 of its
  relative path is 0 modulo 10 (a fixed subset of about a tenth of the files, independent of
  which other files exist); the rest is the training text. The output records the SHA-256 of
  the concatenated corpus (training files, then validation files, UTF-8), its byte count and
  the Python version: another interpreter version has other files and another fingerprint;
* vocabulary: every character that occurs in the corpus, sorted by code point (99 characters
  on CPython 3.11.7; a uniform prediction costs log2(99) = 6.63 bits per character);
* model: token and position embeddings (``nn.Embed`` each; untied output head), then
  ``--layers`` pre-LayerNorm blocks stacked by ``nn.scan`` (``variable_axes={'params': 0}``,
  ``split_rngs={'params': True}``): causal ``nn.MultiHeadDotProductAttention`` (4 heads,
  ``use_bias=True``, its default) and a GELU MLP of 4x the width; a final LayerNorm and a
  ``nn.Dense`` head. Width 128, context 128, 2 layers: 0.44M parameters;
* loss: softmax cross-entropy averaged over all ``N * T`` positions of a batch (reported in
  bits per character: nats / ln 2);
* batches: ``--batch-size`` windows of ``--context + 1`` characters at offsets drawn uniformly
  from the training text by ``np.random.default_rng(seed)``, the same for every optimizer;
  validation: ``--val-windows`` windows evenly spaced over the validation text, the same at
  every evaluation;
* optimizers: ``thor`` (``thor_optax.thor``: 128-blocks, trace rule, the blocks formed from fewer
  than 4 rows per dimension averaged across their refreshes, Nesterov momentum, the damping
  split by the pi rule with ``pi`` clipped at 5, checks at ``growing_interval(2, 20, 200)``),
  ``thor-paper`` (the same with the paper's current-batch factors, heavy-ball momentum and
  equal damping split, with the other aliases' damping floor and KL clip: ``ema_decay=None,
  nesterov=False, pi_damping=False, min_relative_damping=0.1, max_kl=1e-2``), ``kfac-expand`` and
  ``kfac-reduce`` (``thor_optax.kfac``: whole factors, running averages, a check every 10 steps;
  their statistics captured with ``value_and_grad_with_stats(..., weight_sharing='expand' /
  'reduce')``, K-FAC-expand and K-FAC-reduce of Eschenhagen et al. 2023), ``sgd``
  (``optax.sgd``, momentum 0.9), ``adamw`` (``optax.adamw``, its default weight decay 1e-4) and
  ``muon`` (``optax.contrib.muon``: Muon on
  the matrices of the scanned blocks -- the attention projections with their head axes as matrix
  axes, the MLP kernels -- with the stack axis as a batch axis; AdamW at AdamW's learning rate on
  the embeddings, the head, the biases and the LayerNorms, as Muon is meant to be used). Every
  learning rate follows the same schedule: linear warm-up from 0 over the first 5% of the steps,
  then cosine decay to 10% of the peak at the last step. The second-order optimizers precondition
  only the layers the capture takes (``precondition_mask=captured_mask(stats)``); the others take
  their momentum-SGD steps unpreconditioned;
* the second-order optimizers use two jitted steps like ``benchmarks/mnist.py``: a *check step*
  (``value_and_grad_with_stats`` and ``tx.update(..., curvature_stats=stats)``) and a *plain
  step* (``jax.value_and_grad`` and ``tx.update`` with the stored inverses); a host-side
  ``thor_optax.CheckSchedule`` picks one at every step. SGD, AdamW and Muon only have plain
  steps;
* timing: every step function is compiled ahead of time (``jax.jit(step, donate_argnums=(0,
  1)).lower(...).compile()``, timed: the compile columns; parameters and optimizer state
  donated, as in a training loop), called once untimed (an executable's first call is 50-100
  ms slower than the next ones), and then each step is timed up to ``jax.block_until_ready`` of
  its result. The validation loss is measured every ``--eval-every`` steps outside the timed
  region; seconds to a target count training time only. The tables print the highest 1-minute
  load average seen during the runs (the benchmark alone keeps a 2-core machine near 2; more
  means other processes competed and the times are inflated).

``weight_sharing`` is the capture option of ``thor_optax.flax.value_and_grad_with_stats`` that
selects K-FAC-expand or K-FAC-reduce for layers applied over a shared sequence axis (the default,
``'auto'``, is expand here: the loss has a term per position). The table's ``capture`` column
says which each run used.

Run (all defaults: 7 optimizers, 300 steps of 8 x 128 characters; the first command took 2 min
23 s of wall time, by ``time``, on a 2-core CPU with no other job running)::

  python3 benchmarks/lm.py --out results.json --plot lm.png
  python3 benchmarks/lm.py --optimizers thor adamw --steps 600
  python3 benchmarks/lm.py --checks thor=1,20,300 kfac-expand=1 --thor-damping 0.1

Learning rates and damping (``DEFAULT_LEARNING_RATE``, ``DEFAULT_DAMPING``) are what

  python3 benchmarks/lm.py --tune

selected (adamw and muon: 75 minutes on a 2-core CPU shared with other jobs, load average 5-10,
run as ``--tune --optimizers adamw muon``; sgd: 77 s, ``--tune --optimizers sgd``; thor: 18
minutes, ``--tune --optimizers thor``, the joint search below; kfac-expand, kfac-reduce and
thor-paper: the earlier, coordinate-wise search of 59 minutes, ``--tune --optimizers thor
kfac-expand kfac-reduce``, once the capture preconditioned the attention projections and had the
``weight_sharing`` option). For every
optimizer it trains, from the same init and on the same batches, each learning rate of the grid
``centre * 10 ** linspace(-1, 1, 7)`` (7 rates over a factor of 100, centres ``TUNE_CENTRE``; a
grid whose best rate is on its edge is extended on that side) for ``--tune-steps`` steps
(default: the benchmark's 300, with the same schedule), and scores it by the validation loss
averaged over the evaluations every ``--eval-every`` steps (the area under the loss-vs-steps
curve, which rewards a low loss early and is less noisy than the last evaluation). The
second-order optimizers search that grid at each damping of ``TUNE_DAMPING_GRID`` (1e-4, 1e-3,
0.01, 0.1), then half a decade either side of the best damping at the best rate. (The earlier
search tuned the rate at damping 0.03, then the damping at that rate, over 0.003-0.3; it chose
thor's 0.0139 and 0.03, and missed the joint optimum: a smaller damping takes larger steps and
wants a smaller rate.) Muon's AdamW part uses AdamW's learning rate (tuned first). There is no
test split: the learning rates are chosen on the validation files whose loss the benchmark
reports, as the benchmark compares optimizers rather than estimating generalization (at 300
steps no run sees the training text twice). Selected (mean validation bits per character in
brackets, over the 15 evaluations of 300 steps; "final" is the last; "diverged": a mean above
5):

  sgd    lr 0.0646  (3.9550, final 3.7134)   grid 0.03: 4.0628, 0.0646: 3.9550, 0.139: 4.0694,
                                             0.3: 4.0913, 0.646: diverged, 1.39: diverged,
                                             3: diverged
  adamw  lr 0.003   (3.6695, final 3.4205)   grid 0.0003: 4.0378, 0.000646: 3.8628,
                                             0.00139: 3.7482, 0.00646: 3.6777, 0.0139: 3.8029,
                                             0.03: 3.9888
  muon   lr 0.03    (3.4605, final 3.1634)   grid 0.003: 3.6774, 0.00646: 3.5788,
         (AdamW part at lr 0.003)            0.0139: 3.4909, 0.0646: 3.6004, 0.139: 3.7150,
                                             0.3: 3.9218
  thor   lr 0.00215, damping 3.16e-5         damping 1e-4: lr 0.001: 3.5277, 0.00215: 3.4634,
         (3.4370, final 3.1606)              0.00464: 3.5503, 0.01: 3.8823, 0.0215: 4.2190,
                                             0.0464: 4.2442, 0.1: 4.4123;
                                             damping 1e-3: 0.001: 3.6120, 0.00215: 3.4987,
                                             0.00464: 3.4634, 0.01: 3.7511, 0.0215: 3.9960,
                                             0.0464: 3.9045, 0.1: 4.2507;
                                             damping 0.01: 0.001: 3.7939, 0.00215: 3.6310,
                                             0.00464: 3.5331, 0.01: 3.5381, 0.0215: 3.5912,
                                             0.0464: 3.7015, 0.1: 3.7777;
                                             damping 0.1: 0.001: 4.2094, 0.00215: 3.9765,
                                             0.00464: 3.7994, 0.01: 3.6645, 0.0215: 3.5909,
                                             0.0464: 3.5902, 0.1: 3.5943;
                                             at lr 0.00215: damping 3.16e-5: 3.4370,
                                             3.16e-4: 3.4658 (none diverged)
  kfac-expand lr 0.03, damping 0.1           lr grid (damping 0.03) 0.003: 4.0364,
         (3.8599, final 3.6367)              0.00646: 4.0993, 0.0139: 4.0100, 0.03: 3.8830,
                                             0.0646: 4.5809, 0.139 and above: diverged;
                                             damping grid 0.003 and 0.01: diverged, 0.03: 3.8830,
                                             0.3: 3.9541
  kfac-reduce lr 0.00646, damping 0.03       lr grid 0.003: 3.7532, 0.0139: 3.9811,
         (3.7480, final 3.5842)              0.03: 5.1807, 0.0646 and above: diverged;
                                             damping grid 0.003 and 0.01: diverged, 0.1: 3.7935,
                                             0.3: 4.0108
  thor-paper lr 0.0139, damping 0.03         thor's values of the earlier search (not tuned
                                             apart)

thor's damping 3.16e-5 is below the grid. There each factor gets ``sqrt(lambda) = 0.0056`` times
``pi`` or ``1 / pi`` (``pi`` within [1/5, 5]), and the floor (``min_relative_damping=1``: each
block damped by at least its mean eigenvalue; about 1 for the ``A`` of a layer fed by a
LayerNorm) does the damping of ``A``. Smaller still was not better in a one-seed check (lr
0.003: damping 1e-4 ended at 3.138 bits per character, 1e-6 at 3.309).

The coordinate search's choices sat next to divergence (kfac-expand and kfac-reduce still do:
a third of their damping diverges; the robustness issue's subject). Its rerun for thor once thor
had the pi rule, the damping floor at 1 and the KL clip at 3e-2 (402 s): lr grid at damping 0.03
0.003: 3.6970, 0.00646: 3.5867, 0.0139: 3.5459, 0.03: 3.7000, 0.0646: 3.6568, 0.139: 3.7018,
0.3: 3.7512; damping grid at 0.0139: 0.003: 3.6593, 0.01: 3.5325, 0.03: 3.5459, 0.1: 3.6201,
0.3: 3.7790. The joint search's optimum (3.4370) is lower than every point of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
import warnings
from typing import Any, Callable, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optax.contrib  # noqa: E402
from tqdm import tqdm  # noqa: E402

import thor_optax  # noqa: E402
import thor_optax.flax  # noqa: E402

import options  # noqa: E402  (benchmarks/options.py, beside this script)

# The standard-library packages whose .py files (recursively) make up the corpus.
PACKAGES = ("asyncio", "collections", "concurrent", "email", "html", "http", "importlib", "json",
            "logging", "multiprocessing", "urllib", "wsgiref", "xml")
VALIDATION_MODULUS = 10  # a file is in the validation split if sha256(path) % 10 == 0

# thor-paper: THOR as in its paper, current-batch factors, heavy-ball momentum and the equal
# damping split (thor_optax.thor(..., ema_decay=None, nesterov=False, pi_damping=False,
# min_relative_damping=0.1, max_kl=1e-2)), at thor's settings: the LM rows of the ablation's
# choices (benchmarks/ablation.py; thor's default ema_rows_ratio averages no dense block here,
# only the embedding's diagonal and the LayerNorms' 2x2 blocks).
SECOND_ORDER = ("thor", "thor-paper", "kfac-expand", "kfac-reduce")
OPTIMIZERS = SECOND_ORDER + ("sgd", "adamw", "muon")
# The capture's weight-sharing option of each second-order optimizer (None: the default).
WEIGHT_SHARING = {"thor": None, "thor-paper": None, "kfac-expand": "expand",
                  "kfac-reduce": "reduce"}

DEFAULT_STEPS = 300
# Validation-loss targets, bits per character.
DEFAULT_TARGETS = (3.8, 3.6, 3.4)

# Check steps: an int N is a check every N steps, a triple THOR's growing_interval(start, end,
# transition_steps).
DEFAULT_CHECKS = {"thor": (2, 20, 200), "thor-paper": (2, 20, 200), "kfac-expand": 10,
                  "kfac-reduce": 10}

# Peak learning rates and damping selected by `--tune` (see the module docstring).
DEFAULT_LEARNING_RATE = {"thor": 0.00215, "thor-paper": 0.0139, "kfac-expand": 0.03,
                         "kfac-reduce": 0.00646, "sgd": 0.0646, "adamw": 3e-3, "muon": 0.03}
DEFAULT_DAMPING = {"thor": 3.16e-5, "thor-paper": 0.03, "kfac-expand": 0.1, "kfac-reduce": 0.03}

# `--tune`: centre of each optimizer's learning-rate grid centre * 10 ** linspace(-1, 1, 7).
TUNE_CENTRE = {"thor": 0.01, "thor-paper": 0.01, "kfac-expand": 0.01, "kfac-reduce": 0.01,
               "sgd": 0.3, "adamw": 3e-3, "muon": 0.03}
TUNE_BASE_DAMPING = 0.03
TUNE_DAMPING_GRID = (1e-4, 1e-3, 0.01, 0.1)


# ------------------------------------------------------------------------------------------------
# Data.


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The training and validation text as character ids, and where they came from.

  Attributes:
    train: ``(num_train_chars,)`` int32 ids of the training files, concatenated.
    val: ``(num_val_chars,)`` int32 ids of the validation files, concatenated.
    vocab: the characters, ``vocab[i]`` is id ``i``.
    train_files / val_files: paths relative to the stdlib directory, in order.
    sha256 / num_bytes: fingerprint of the UTF-8 corpus (training files then validation files).
    stdlib: the stdlib directory read.
  """

  train: np.ndarray
  val: np.ndarray
  vocab: str
  train_files: tuple[str, ...]
  val_files: tuple[str, ...]
  sha256: str
  num_bytes: int
  stdlib: str


def is_validation_file(relpath: str) -> bool:
  """Whether a file (path relative to the stdlib directory, ``/``-separated) is validation."""
  return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % VALIDATION_MODULUS == 0


def load_corpus(packages: tuple[str, ...] = PACKAGES) -> Corpus:
  """Reads the ``.py`` files of ``packages`` from this interpreter's standard library.

  Args:
    packages: names of stdlib packages (directories under ``sysconfig.get_paths()['stdlib']``).

  Returns:
    the :class:`Corpus`, split by file, with a vocabulary of every character in it.

  Raises:
    FileNotFoundError: if a package is not a directory of this standard library.
  """
  stdlib = sysconfig.get_paths()["stdlib"]
  files = []
  for package in packages:
    root = os.path.join(stdlib, package)
    if not os.path.isdir(root):
      raise FileNotFoundError(f"stdlib package {package!r} not found under {stdlib}")
    for dirpath, _, names in os.walk(root):
      files.extend(os.path.relpath(os.path.join(dirpath, n), stdlib).replace(os.sep, "/")
                   for n in names if n.endswith(".py"))
  files.sort()
  val_files = tuple(f for f in files if is_validation_file(f))
  train_files = tuple(f for f in files if not is_validation_file(f))

  def read(names):
    """The files' texts, concatenated."""
    texts = []
    for name in names:
      with open(os.path.join(stdlib, name), encoding="utf-8") as f:
        texts.append(f.read())
    return "".join(texts)

  train_text, val_text = read(train_files), read(val_files)
  data = (train_text + val_text).encode("utf-8")
  vocab = "".join(sorted(set(train_text + val_text)))
  index = {c: i for i, c in enumerate(vocab)}
  ids = lambda text: np.fromiter((index[c] for c in text), np.int32, len(text))
  return Corpus(train=ids(train_text), val=ids(val_text), vocab=vocab, train_files=train_files,
                val_files=val_files, sha256=hashlib.sha256(data).hexdigest(),
                num_bytes=len(data), stdlib=stdlib)


def batch_offsets(num_chars: int, context: int, batch_size: int, num_steps: int,
                  seed: int) -> np.ndarray:
  """``(num_steps, batch_size)`` start offsets of the training windows (uniform, seeded).

  Every optimizer gets the same array for the same seed, so all see the same batches.
  """
  rng = np.random.default_rng(seed)
  return rng.integers(0, num_chars - context - 1, size=(num_steps, batch_size))


def windows(ids: np.ndarray, offsets: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-character targets, ``(len(offsets), context)`` each."""
  rows = ids[offsets[:, None] + np.arange(context + 1)]
  return rows[:, :-1], rows[:, 1:]


def validation_windows(ids: np.ndarray, context: int,
                       num_windows: int) -> tuple[np.ndarray, np.ndarray]:
  """``num_windows`` windows evenly spaced over the validation text (inputs, targets)."""
  offsets = np.linspace(0, len(ids) - context - 1, num_windows).astype(np.int64)
  return windows(ids, offsets, context)


# ------------------------------------------------------------------------------------------------
# Model (plain Flax linen; nothing in it knows about THOR).


class DecoderBlock(nn.Module):
  """Pre-LayerNorm decoder block: causal self-attention, then a GELU MLP, both residual.

  ``(x, _) -> (x, None)`` so that ``nn.scan`` can stack it.
  """

  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x, _):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
    y = nn.LayerNorm(name="ln_attn")(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, deterministic=True,
                                        name="attn")(y, mask=mask)
    x = x + y
    y = nn.LayerNorm(name="ln_mlp")(x)
    y = nn.gelu(nn.Dense(self.mlp_dim, name="mlp_in")(y))
    return x + nn.Dense(x.shape[-1], name="mlp_out")(y), None


class CharTransformer(nn.Module):
  """Decoder-only character LM: ``(N, T)`` ids -> ``(N, T, vocab_size)`` logits.

  Token and learned position embeddings (both ``nn.Embed``), ``num_layers`` :class:`DecoderBlock`
  stacked by ``nn.scan``, a final LayerNorm and an untied ``nn.Dense`` head.
  """

  vocab_size: int
  width: int = 128
  num_heads: int = 4
  num_layers: int = 2
  context: int = 128

  @nn.compact
  def __call__(self, tokens):
    n, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (n, t))
    x = (nn.Embed(self.vocab_size, self.width, name="tok_embed")(tokens)
         + nn.Embed(self.context, self.width, name="pos_embed")(positions))
    stack = nn.scan(DecoderBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=self.num_layers)
    x, _ = stack(self.num_heads, 4 * self.width, name="blocks")(x, None)
    x = nn.LayerNorm(name="ln_f")(x)
    return nn.Dense(self.vocab_size, name="head")(x)


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Softmax cross-entropy averaged over all ``N * T`` positions, in nats."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_capture(model: nn.Module, weight_sharing: Optional[str]) -> tuple[Callable, str]:
  """``value_and_grad_with_stats`` of ``model`` with the weight-sharing option, and its label.

  ``weight_sharing`` is ``'expand'``, ``'reduce'`` or ``None`` for the capture's default
  (``'auto'``: expand here, as the loss has a term per position).
  """
  capture_fn = thor_optax.flax.value_and_grad_with_stats
  if weight_sharing is None:
    return capture_fn(model, loss_fn), "auto"
  return capture_fn(model, loss_fn, weight_sharing=weight_sharing), weight_sharing


# ------------------------------------------------------------------------------------------------
# Optimizers.


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters of one run."""

  optimizer: str
  learning_rate: float  # peak of the warm-up + cosine schedule
  damping: Optional[float] = None  # second-order optimizers only
  checks: Union[int, tuple[int, int, int], None] = None
  adam_learning_rate: Optional[float] = None  # Muon's AdamW part
  thor_block_size: Optional[int] = 128


def lr_schedule(peak: float, num_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 over the first 5% of the steps, cosine decay to ``peak / 10``."""
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, num_steps // 20), num_steps,
                                            end_value=peak / 10)


def muon_dimension_numbers(params: Any) -> Any:
  """Muon's matrix axes of each parameter: the kernels of the scanned blocks, else ``None``.

  The block stack's leading axis is a batch axis (each layer's matrix is orthogonalized on its
  own); the attention projections' head axes belong to the matrix (``query/key/value``: input
  axis 1 to the ``(heads, head_dim)`` axes, ``out``: ``(heads, head_dim)`` to the width). The
  embeddings, head, biases and LayerNorms (``None``) take Muon's AdamW steps.
  """
  dims = optax.contrib.MuonDimensionNumbers

  def spec(path, leaf):
    """The dimension numbers of one leaf."""
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[0] != "blocks" or keys[-1] != "kernel":
      return None
    if keys[-2] == "out":
      return dims(reduction_axis=(1, 2), output_axis=3)
    if leaf.ndim == 4:  # query, key, value: (L, d, heads, head_dim)
      return dims(reduction_axis=1, output_axis=(2, 3))
    return dims(reduction_axis=1, output_axis=2)  # MLP: (L, d_in, d_out)

  return jax.tree_util.tree_map_with_path(spec, params)


def make_optimizer(cfg: Config, num_steps: int, precondition_mask: Any = None
                   ) -> tuple[optax.GradientTransformation, Optional[thor_optax.CheckSchedule]]:
  """The optax optimizer of ``cfg`` and, for the second-order ones, the schedule of checks.

  Args:
    cfg: the run's configuration.
    num_steps: length of the learning-rate schedule.
    precondition_mask: the second-order optimizers' ``precondition_mask`` (the layers the
      capture takes).
  """
  lr = lr_schedule(cfg.learning_rate, num_steps)
  if cfg.optimizer in ("thor", "thor-paper"):
    extra = (dict(ema_decay=None, nesterov=False, pi_damping=False, min_relative_damping=0.1,
                  max_kl=1e-2) if cfg.optimizer == "thor-paper" else {})
    tx = thor_optax.thor(lr, cfg.damping, block_size=cfg.thor_block_size,
                         precondition_mask=precondition_mask, **extra)
    return tx, options.check_schedule(cfg.checks)
  if cfg.optimizer.startswith("kfac"):
    return (thor_optax.kfac(lr, cfg.damping, precondition_mask=precondition_mask),
            options.check_schedule(cfg.checks))
  if cfg.optimizer == "sgd":
    return optax.sgd(lr, momentum=0.9), None
  if cfg.optimizer == "adamw":
    return optax.adamw(lr), None
  if cfg.optimizer == "muon":
    adam_lr = lr_schedule(cfg.adam_learning_rate, num_steps)
    return optax.contrib.muon(lr, adam_learning_rate=adam_lr,
                              muon_weight_dimension_numbers=muon_dimension_numbers), None
  raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def make_steps(model: nn.Module, tx: optax.GradientTransformation,
               capture: Callable) -> tuple[Callable, Callable]:
  """The check and plain steps ``(params, opt_state, x, y) -> (params, opt_state, loss)``.

  ``check_step`` captures the layers' statistics with ``capture`` and passes them to
  ``tx.update``; ``plain_step`` is an ordinary optax step. Neither is jitted here (the caller
  compiles them ahead of time).
  """

  def check_step(params, opt_state, x, y):
    (loss, grads), stats = capture(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss

  def plain_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return check_step, plain_step


def preconditioned_fraction(params: Any, stats: thor_optax.CurvatureStats) -> float:
  """Share of the scalar parameters in the layers the capture takes (``captured_mask``)."""
  mask = thor_optax.captured_mask(stats)(params)
  sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]
  taken = [s for s, m in zip(sizes, jax.tree.leaves(mask)) if m]
  return sum(taken) / sum(sizes)


# ------------------------------------------------------------------------------------------------
# The training loop, shared by every optimizer.


@dataclasses.dataclass
class History:
  """What one run recorded.

  Attributes:
    step_ms: wall-clock milliseconds of every step (compilation excluded).
    is_check: whether each step was a check step.
    curve: ``(steps done, training seconds so far, validation bits per character)`` at every
      evaluation.
    loss: training loss of every step, bits per character on its batch.
    compile_s: ``{"check": s, "plain": s}`` compile time of each step function used.
    capture: which capture the check steps used (see :func:`make_capture`).
    preconditioned: share of parameters preconditioned (second-order optimizers).
    unhandled: the statistics' ``unhandled`` list.
  """

  step_ms: list = dataclasses.field(default_factory=list)
  is_check: list = dataclasses.field(default_factory=list)
  curve: list = dataclasses.field(default_factory=list)
  loss: list = dataclasses.field(default_factory=list)
  compile_s: dict = dataclasses.field(default_factory=dict)
  capture: Optional[str] = None
  preconditioned: Optional[float] = None
  unhandled: tuple = ()


def make_eval(model: nn.Module) -> Callable:
  """Jitted ``(params, x, y) -> mean cross-entropy`` in bits per character."""

  @jax.jit
  def val_bpc(params, x, y):
    """Mean cross-entropy of ``params`` on ``(x, y)``, bits per character."""
    return loss_fn(model.apply({"params": params}, x), y) / math.log(2)

  return val_bpc


def train(model: nn.Module, params: Any, cfg: Config, corpus: Corpus, offsets: np.ndarray,
          val: tuple[np.ndarray, np.ndarray], context: int, eval_every: int,
          desc: str = "", optimizer: Optional[Callable] = None) -> History:
  """Trains ``model`` from ``params`` with ``cfg``'s optimizer on the batches at ``offsets``.

  Each step function is compiled ahead of time (timed) and called once untimed; each step is
  timed up to ``jax.block_until_ready`` of its result. The validation loss (bits per character
  on ``val``) is measured every ``eval_every`` steps and at the start and end, outside the
  timed region.

  Args:
    model: the Flax model.
    params: initial parameters (the same for every optimizer).
    cfg: optimizer and hyperparameters.
    corpus: the text; batches are read from ``corpus.train``.
    offsets: ``(num_steps, batch_size)`` window offsets (:func:`batch_offsets`).
    val: validation inputs and targets.
    context: characters per window.
    eval_every: steps between evaluations.
    desc: label of the progress bar.
    optimizer: ``optimizer(precondition_mask) -> (tx, check schedule or None)`` to train with
      instead of ``make_optimizer(cfg, ...)`` (``benchmarks/ablation.py``: aliases with other
      settings); the statistics are captured as for ``cfg.optimizer``.

  Returns:
    the run's :class:`History`.
  """
  num_steps = len(offsets)
  history = History()
  x0, y0 = (jnp.asarray(a) for a in windows(corpus.train, offsets[0], context))
  precondition_mask = None
  capture = None
  if cfg.optimizer in SECOND_ORDER:
    capture, history.capture = make_capture(model, WEIGHT_SHARING[cfg.optimizer])
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # the unhandled layers are reported in the table
      _, stats = jax.eval_shape(capture, params, x0, y0)
    history.unhandled = tuple(stats.unhandled)
    history.preconditioned = preconditioned_fraction(params, stats)
    precondition_mask = thor_optax.captured_mask(stats)
  if optimizer is None:
    tx, schedule = make_optimizer(cfg, num_steps, precondition_mask)
  else:
    tx, schedule = optimizer(precondition_mask)
  check_step, plain_step = make_steps(model, tx, capture)
  is_check = [schedule is not None and schedule(s) for s in range(num_steps)]
  params = jax.tree.map(jnp.copy, params)  # the steps donate theirs; the caller's stay valid
  opt_state = tx.init(params)

  compiled = {}
  for kind, fn, used in (("check", check_step, any(is_check)),
                         ("plain", plain_step, not all(is_check))):
    if used:
      jax.clear_caches()  # each step function from cold caches (as in mnist.py)
      start = time.perf_counter()
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Donated state, as a training loop keeping only the new state should: the
        # outputs reuse the inputs' buffers, and unchanged state is not copied.
        compiled[kind] = jax.jit(fn, donate_argnums=(0, 1)).lower(
            params, opt_state, x0, y0).compile()
      history.compile_s[kind] = time.perf_counter() - start
      # One untimed call on copies (donated, consumed): an executable's first call costs
      # 50-100 ms more than the next ones (as in mnist.py).
      warm = jax.block_until_ready(jax.tree.map(jnp.copy, (params, opt_state)))
      jax.block_until_ready(compiled[kind](*warm, x0, y0))
  val_bpc = make_eval(model)
  val_x, val_y = jnp.asarray(val[0]), jnp.asarray(val[1])

  seconds = 0.0
  history.curve.append((0, 0.0, float(val_bpc(params, val_x, val_y))))
  bar = tqdm(range(num_steps), desc=desc, leave=False, dynamic_ncols=True)
  for step in bar:
    x, y = (jnp.asarray(a) for a in windows(corpus.train, offsets[step], context))
    step_fn = compiled["check" if is_check[step] else "plain"]
    jax.block_until_ready((x, y))
    start = time.perf_counter()
    params, opt_state, loss = jax.block_until_ready(step_fn(params, opt_state, x, y))
    elapsed = time.perf_counter() - start
    # ---- untimed from here on: bookkeeping and evaluation ----
    seconds += elapsed
    history.step_ms.append(1e3 * elapsed)
    history.is_check.append(is_check[step])
    history.loss.append(float(loss) / math.log(2))
    done = step + 1
    if done % eval_every == 0 or done == num_steps:
      bpc = float(val_bpc(params, val_x, val_y))
      history.curve.append((done, seconds, bpc))
      bar.set_postfix(loss=f"{history.loss[-1]:.3f}", val_bpc=f"{bpc:.3f}")
      if not math.isfinite(bpc):
        break  # diverged: the rest of the run would be NaN
  bar.close()
  return history


# ------------------------------------------------------------------------------------------------
# Summaries.


def _median(values: list) -> Optional[float]:
  """Median of a list, ``None`` for an empty one."""
  return float(np.median(values)) if values else None


def first_reached(curve: list, target: float) -> tuple[Optional[int], Optional[float]]:
  """``(steps, seconds)`` of the first evaluation at or below ``target`` bits per character."""
  return next(((s, t) for s, t, bpc in curve if bpc <= target), (None, None))


def summarize(cfg: Config, history: History, targets: tuple[float, ...]) -> dict:
  """One JSON-ready record of a run (speed, steps / seconds to each target, final loss)."""
  steps_to, seconds_to = {}, {}
  for target in targets:
    steps_to[str(target)], seconds_to[str(target)] = first_reached(history.curve, target)
  check_ms = [ms for ms, c in zip(history.step_ms, history.is_check) if c]
  plain_ms = [ms for ms, c in zip(history.step_ms, history.is_check) if not c]
  return {
      "optimizer": cfg.optimizer,
      "learning_rate": cfg.learning_rate,
      "damping": cfg.damping,
      "checks": list(cfg.checks) if isinstance(cfg.checks, tuple) else cfg.checks,
      "adam_learning_rate": cfg.adam_learning_rate,
      "capture": history.capture,
      "preconditioned_fraction": history.preconditioned,
      "unhandled": list(history.unhandled),
      "num_steps": len(history.step_ms),
      "num_checks": len(check_ms),
      "mean_ms_per_step": float(np.mean(history.step_ms)),
      "median_ms_per_step": _median(history.step_ms),
      "check_ms": _median(check_ms),
      "plain_ms": _median(plain_ms),
      "compile_s": history.compile_s,
      "train_seconds": float(np.sum(history.step_ms) / 1e3),
      "targets": list(targets),
      "steps_to": steps_to,
      "seconds_to": seconds_to,
      "final_val_bpc": history.curve[-1][2],
      "best_val_bpc": min(bpc for _, _, bpc in history.curve),
      "curve": [list(point) for point in history.curve],
      "train_bpc": history.loss,
  }


def add_ratios(records: list, tokens_per_step: int) -> None:
  """Adds tokens/s, and ratios against SGD, AdamW and Muon, to every record (in place).

  * ``x_sgd_ms`` / ``x_adamw_ms`` / ``x_muon_ms``: mean ms/step over SGD's / AdamW's / Muon's;
  * ``plain_x_sgd`` / ``plain_x_adamw``: median plain step over SGD's / AdamW's median step;
  * ``steps_to_adamw_final`` / ``seconds_to_adamw_final``: first evaluation at or below AdamW's
    final validation loss; ``time_x_sgd`` / ``time_x_adamw`` / ``time_x_muon``: those seconds
    over SGD's / AdamW's / Muon's seconds to the same loss (``None`` where either did not reach
    it).
  """
  by_name = {r["optimizer"]: r for r in records}
  references = {name: by_name.get(name) for name in ("sgd", "adamw", "muon")}
  adamw = references["adamw"]
  reference = adamw["final_val_bpc"] if adamw else None
  for r in records:
    r["tokens_per_s"] = tokens_per_step / (r["mean_ms_per_step"] / 1e3)
    for name, ref in references.items():
      r[f"x_{name}_ms"] = r["mean_ms_per_step"] / ref["mean_ms_per_step"] if ref else None
    for name in ("sgd", "adamw"):
      ref = references[name]
      r[f"plain_x_{name}"] = (r["plain_ms"] / ref["median_ms_per_step"]
                              if ref and r["plain_ms"] else None)
    r["adamw_final_bpc"] = reference
    r["steps_to_adamw_final"], r["seconds_to_adamw_final"] = (
        first_reached(r["curve"], reference) if reference is not None else (None, None))
  for r in records:
    mine = r["seconds_to_adamw_final"]
    for name, ref in references.items():
      theirs = ref["seconds_to_adamw_final"] if ref else None
      r[f"time_x_{name}"] = mine / theirs if mine is not None and theirs else None


def _fmt(value, spec: str) -> str:
  """``format(value, spec)``, ``'-'`` for ``None``."""
  return "-" if value is None else format(value, spec)


def _print_rows(header: list, rows: list) -> None:
  """Prints a right-aligned fixed-width table."""
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
  print(line(header))
  print(line(["-" * w for w in widths]))
  for row in rows:
    print(line(row))


def print_tables(records: list, meta: dict) -> None:
  """Prints the speed table and the progress table."""
  first = records[0]
  targets = first["targets"]
  print(f"\n== char LM on {meta['corpus_chars_train']:,} / {meta['corpus_chars_val']:,} "
        f"training / validation characters of the Python {meta['python']} stdlib "
        f"(sha256 {meta['corpus_sha256'][:16]}..., {meta['corpus_bytes']:,} bytes); "
        f"{meta['params']:,} parameters; {first['num_steps']} steps of {meta['batch_size']} x "
        f"{meta['context']} characters; jax {meta['jax']}, {meta['device']}, max load average "
        f"{meta['max_load_average']:.2f} ==")
  header = ["optimizer", "lr", "damping", "capture", "precond.", "tokens/s", "ms/step",
            "x SGD", "x AdamW", "x Muon", "check ms", "plain ms", "plain x SGD",
            "plain x AdamW", "checks", "check comp s", "plain comp s"]
  rows = []
  for r in records:
    rows.append([
        r["optimizer"], f"{r['learning_rate']:g}", _fmt(r["damping"], "g"),
        r["capture"] or "-",
        _fmt(r["preconditioned_fraction"], ".1%"),
        f"{r['tokens_per_s']:,.0f}", f"{r['mean_ms_per_step']:.1f}",
        _fmt(r["x_sgd_ms"], ".2f"), _fmt(r["x_adamw_ms"], ".2f"), _fmt(r["x_muon_ms"], ".2f"),
        _fmt(r["check_ms"], ".1f"), _fmt(r["plain_ms"], ".1f"), _fmt(r["plain_x_sgd"], ".2f"),
        _fmt(r["plain_x_adamw"], ".2f"),
        str(r["num_checks"]),
        _fmt(r["compile_s"].get("check"), ".1f"), _fmt(r["compile_s"].get("plain"), ".1f")])
  _print_rows(header, rows)
  print("ms/step: training time / steps (check and plain); x SGD / AdamW / Muon: its ratio to "
        "SGD's / AdamW's / Muon's; check / plain ms:\nmedians of each kind (SGD, AdamW and "
        "Muon: their steps); plain x SGD / AdamW: median plain step / their median step; "
        "precond.:\nshare of the parameters in layers the capture takes.")

  header = (["optimizer"] + [f"steps<={t:g}" for t in targets]
            + [f"s<={t:g}" for t in targets]
            + ["final bpc", "steps<=AdamW", "s<=AdamW", "time x SGD", "time x AdamW",
               "time x Muon"])
  rows = []
  for r in records:
    rows.append(
        [r["optimizer"]] + [_fmt(r["steps_to"][str(t)], "d") for t in targets]
        + [_fmt(r["seconds_to"][str(t)], ".1f") for t in targets]
        + [f"{r['final_val_bpc']:.3f}", _fmt(r["steps_to_adamw_final"], "d"),
           _fmt(r["seconds_to_adamw_final"], ".1f"), _fmt(r["time_x_sgd"], ".2f"),
           _fmt(r["time_x_adamw"], ".2f"), _fmt(r["time_x_muon"], ".2f")])
  print()
  _print_rows(header, rows)
  reference = first.get("adamw_final_bpc")
  print(f"validation bits per character (uniform: {math.log2(meta['vocab_size']):.2f}), "
        f"evaluated every {meta['eval_every']} steps; steps / s <= x: first evaluation at or "
        f"below x\n(training seconds); AdamW: its final validation loss"
        + (f" ({reference:.3f})" if reference is not None else "")
        + "; time x SGD / AdamW / Muon: seconds to that loss over theirs.")
  unhandled = next((r["unhandled"] for r in records if r["unhandled"]), [])
  if unhandled:
    print("not preconditioned (the capture's unhandled list): " + "; ".join(unhandled))


def plot(records: list, path: str) -> None:
  """Validation bits per character against steps and against training seconds."""
  fig, (ax_steps, ax_time) = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
  for r in records:
    steps, seconds, bpc = np.asarray(r["curve"]).T
    label = f"{r['optimizer']} (lr {r['learning_rate']:g})"
    ax_steps.plot(steps, bpc, marker=".", label=label)
    ax_time.plot(seconds, bpc, marker=".", label=label)
  for ax in (ax_steps, ax_time):
    for target in records[0]["targets"]:
      ax.axhline(target, color="grey", lw=0.8, ls="--")
    finite = [v for r in records for _, _, v in r["curve"][1:] if math.isfinite(v)]
    ax.set_ylim(min(finite) - 0.1, min(max(finite), 5.0) + 0.1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
  ax_steps.set_ylabel("validation bits per character")
  ax_steps.set_xlabel("steps")
  ax_time.set_xlabel("training wall time (s; compilation and evaluation excluded)")
  ax_steps.set_title("char LM: validation loss vs steps")
  ax_time.set_title("char LM: validation loss vs wall time")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Learning-rate (and damping) tuning on the validation split.


def tune(args: argparse.Namespace, model: nn.Module, params: Any, corpus: Corpus,
         val: tuple[np.ndarray, np.ndarray]) -> dict:
  """Grid-searches learning rates (and, jointly, damping); prints every score.

  For every optimizer (AdamW first when it is tuned, as Muon's AdamW part uses its rate): the
  peak learning rates ``TUNE_CENTRE[opt] * 10 ** linspace(-1, 1, 7)``, each trained from the
  same init on the same batches for ``--tune-steps`` steps and scored by the mean validation
  bits per character over the evaluations every ``--eval-every`` steps (lower is better; a
  diverged run scores infinity). A best rate on the edge of the grid is extended on that side
  by the grid's factor, up to 3 times. The second-order optimizers search that grid at every
  damping of ``TUNE_DAMPING_GRID`` (a decade apart), then try half a decade either side of the
  best damping at the best rate, and keep the best pair; with ``--no-tune-damping`` they search
  the rates at ``TUNE_BASE_DAMPING`` only.

  Returns:
    ``{optimizer: {"learning_rate": ..., ["damping": ...]}}``.
  """
  num_steps = args.tune_steps or args.steps
  offsets = batch_offsets(len(corpus.train), args.context, args.batch_size, num_steps, args.seed)
  chosen = {}
  start = time.perf_counter()
  names = sorted(args.optimizers, key=lambda n: n != "adamw")

  def score(cfg: Config) -> float:
    """Mean validation bits per character of one candidate (infinity if it diverged)."""
    history = train(model, params, cfg, corpus, offsets, val, args.context, args.eval_every,
                    desc=f"tune {cfg.optimizer} lr={cfg.learning_rate:g}")
    bpc = [b for _, _, b in history.curve[1:]]
    finished = history.curve[-1][0] == num_steps and all(map(math.isfinite, bpc))
    mean = float(np.mean(bpc)) if finished else math.inf
    print(f"[tune] {cfg.optimizer:11s} lr={cfg.learning_rate:<8g} damping={cfg.damping!s:6s} "
          f"mean val bpc {mean:.4f}  final {bpc[-1]:.4f}", flush=True)
    return mean

  def best(name: str, what: str, scores: dict) -> float:
    """The key of the lowest score; prints the grid."""
    value = min(scores, key=lambda k: scores[k])
    edge = "  (at the edge of the grid)" if value in (min(scores), max(scores)) else ""
    print(f"[tune] {name} {what} grid: "
          + ", ".join(f"{k:g}: {scores[k]:.4f}" for k in sorted(scores))
          + f"  -> {what} {value:g}{edge}", flush=True)
    return value

  for name in names:
    base = base_config(args, name)
    if name == "muon" and "adamw" in chosen:
      base = dataclasses.replace(base, adam_learning_rate=chosen["adamw"]["learning_rate"])
    if name not in SECOND_ORDER or not args.tune_damping:
      if name in SECOND_ORDER:
        base = dataclasses.replace(base, damping=TUNE_BASE_DAMPING)
      chosen[name] = {"learning_rate": best(name, "lr", options.search_rates(
          score, base, TUNE_CENTRE[name], key=float))}
      continue
    lr, d, grid = options.search_rate_and_damping(
        score, base, TUNE_CENTRE[name], TUNE_DAMPING_GRID, key=float,
        report=lambda damping, scores, name=name: best(name, f"lr (damping {damping:g})",
                                                       scores))
    print(f"[tune] {name} lr x damping -> lr {lr:g}, damping {d:g} (mean {grid[lr, d]:.4f})",
          flush=True)
    chosen[name] = {"learning_rate": lr, "damping": d}
  print(f"\n[tune] chosen ({time.perf_counter() - start:.0f} s):")
  for name, values in chosen.items():
    print(f"  {name:11s} " + "  ".join(f"{k}={v:g}" for k, v in values.items()))
  return chosen


# ------------------------------------------------------------------------------------------------
# Command line.


def base_config(args: argparse.Namespace, name: str) -> Config:
  """The run configuration of ``name``: tuned defaults unless overridden on the command line."""
  key = name.replace("-", "_")
  lr = getattr(args, f"lr_{key}")
  damping = getattr(args, f"{key}_damping", None)
  if name in DEFAULT_DAMPING and damping is None:
    damping = DEFAULT_DAMPING[name]
  adam_lr = args.lr_adamw if args.lr_adamw is not None else DEFAULT_LEARNING_RATE["adamw"]
  return Config(
      optimizer=name,
      learning_rate=DEFAULT_LEARNING_RATE[name] if lr is None else lr,
      damping=damping,
      checks=args.checks.get(name),
      adam_learning_rate=adam_lr if name == "muon" else None,
      thor_block_size=args.thor_block_size or None)


def parse_args(argv=None) -> argparse.Namespace:
  """Command-line options (see the module docstring)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
  p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="(default: %(default)s)")
  p.add_argument("--batch-size", type=int, default=8, help="(default: %(default)s)")
  p.add_argument("--context", type=int, default=128, help="(default: %(default)s)")
  p.add_argument("--width", type=int, default=128, help="(default: %(default)s)")
  p.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
  p.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the init and of the batches (default: %(default)s)")
  p.add_argument("--eval-every", type=int, default=20,
                 help="steps between validation evaluations (default: %(default)s)")
  p.add_argument("--val-windows", type=int, default=32,
                 help="validation windows of --context characters (default: %(default)s)")
  p.add_argument("--targets", type=float, nargs="+", default=list(DEFAULT_TARGETS),
                 help="validation bits-per-character targets (default: %(default)s)")
  p.add_argument("--out", default=None, help="write the results to this JSON file")
  p.add_argument("--plot", default="lm.png",
                 help="write the curves to this PNG; '' for none (default: %(default)s)")
  options.add_optimizer_options(
      p, OPTIMIZERS, SECOND_ORDER, lambda name: DEFAULT_LEARNING_RATE[name],
      lambda name: DEFAULT_DAMPING[name], "thor=1,20,300 kfac-expand=1", DEFAULT_CHECKS,
      "the validation split", "--steps")
  options.add_lapack_threads_option(p)
  args = p.parse_args(argv)
  args.checks = options.parse_checks(p, args.checks, DEFAULT_CHECKS, SECOND_ORDER)
  return args


def main(argv=None) -> None:
  """Runs the benchmark (or ``--tune``) and prints the tables."""
  args = parse_args(argv)
  options.apply_lapack_threads(args)
  corpus = load_corpus()
  model = CharTransformer(vocab_size=len(corpus.vocab), width=args.width, num_heads=args.heads,
                          num_layers=args.layers, context=args.context)
  x0, _ = windows(corpus.train, np.zeros(1, np.int64), args.context)
  params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), x0)["params"]
  val = validation_windows(corpus.val, args.context, args.val_windows)
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  print(f"corpus: {len(corpus.train_files)} training / {len(corpus.val_files)} validation files "
        f"of {', '.join(PACKAGES)} under {corpus.stdlib}; {corpus.num_bytes:,} bytes, sha256 "
        f"{corpus.sha256}; vocabulary of {len(corpus.vocab)} characters; model: "
        f"{num_params:,} parameters", flush=True)
  if args.tune:
    tune(args, model, params, corpus, val)
    return

  offsets = batch_offsets(len(corpus.train), args.context, args.batch_size, args.steps,
                          args.seed)
  targets = tuple(args.targets)
  records = []
  max_load = os.getloadavg()[0]
  for name in args.optimizers:
    cfg = base_config(args, name)
    history = train(model, params, cfg, corpus, offsets, val, args.context, args.eval_every,
                    desc=name)
    max_load = max(max_load, os.getloadavg()[0])
    records.append(summarize(cfg, history, targets))
  add_ratios(records, args.batch_size * args.context)
  meta = {
      "python": platform.python_version(), "jax": jax.__version__,
      "device": f"{jax.devices()[0].platform}, {os.cpu_count()} CPU cores",
      "thor_optax_path": os.path.dirname(thor_optax.__file__),
      "packages": list(PACKAGES), "stdlib": corpus.stdlib,
      "corpus_sha256": corpus.sha256, "corpus_bytes": corpus.num_bytes,
      "corpus_chars_train": int(len(corpus.train)), "corpus_chars_val": int(len(corpus.val)),
      "train_files": list(corpus.train_files), "val_files": list(corpus.val_files),
      "vocab_size": len(corpus.vocab), "params": num_params, "batch_size": args.batch_size,
      "context": args.context, "width": args.width, "layers": args.layers, "heads": args.heads,
      "seed": args.seed, "eval_every": args.eval_every, "val_windows": args.val_windows,
      "max_load_average": max_load, "argv": sys.argv[1:],
  }
  print_tables(records, meta)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"meta": meta, "runs": records}, f, indent=1)
    print(f"\nwrote {args.out}")
  if args.plot:
    plot(records, args.plot)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()

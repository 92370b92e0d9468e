"""thor_optax: THOR / K-FAC natural-gradient preconditioners as optax gradient transformations.

Public API (import from here, ``thor_optax.flax`` or ``thor_optax.nnx``; never from
``thor_optax._src``):

* ``scale_by_thor``, ``scale_by_kfac``: the preconditioners (``GradientTransformationExtraArgs``;
  statistics go in as ``update(..., curvature_stats=stats)``); the inversion methods, conv
  statistics and refresh policies of THOR, SKFAC, KAISA and SP-NGD are their options.
* ``thor``, ``kfac``, ``skfac``, ``kaisa``, ``spngd``: full optimizers (preconditioner, then
  weight decay and momentum SGD, or SP-NGD's weight rescaling), each inside
  ``skip_not_finite``.
* ``skip_not_finite``: a step whose gradient or update is not finite changes nothing (counted
  in an ``optax.ApplyIfFiniteState``).
* ``scale_by_kl_clip``: KAISA's KL clip around a preconditioner.
* ``clip_by_weight_ratio``: each kernel's step at most a share of its norm (``kaisa``'s
  ``max_update_ratio``).
* ``rescale_weight_norms``: SP-NGD's cap of kernel norms at ``sqrt(2 d_out)``.
* ``scale_by_momentum_bias_correction``: full-size first steps for momentum SGD (the aliases'
  ``debias_momentum``).
* ``kronecker_state_sharding``: shardings of the curvature state on a device mesh (replicated,
  or block stacks sharded: KAISA's COMM-OPT / MEM-OPT / HYBRID-OPT).
* ``concatenate_stats``: the statistics of a batch from those of its micro-batches (gradient
  accumulation with ``optax.MultiSteps``).
* ``limit_lapack_threads``: on CPU, one thread for the LAPACK library jaxlib calls, so that its
  idle workers do not spin on the cores the next steps need (``threadpoolctl``).
* ``thor_learning_rate_schedule``, ``thor_damping_schedule``: the paper's schedule shapes.
* ``CheckSchedule``, ``growing_interval``, ``curvature_budget``: which steps are check steps.
* ``captured_layers``, ``CapturedLayers``: the ``layers=`` of the preconditioners and aliases,
  from a capture's statistics (the layers it takes, laid out as it takes them: attention
  projections without bias, einsums); ``captured_mask``: the ``precondition_mask`` of the
  aliases, from the same statistics (no curvature state for layers the capture never takes).
* ``KroneckerState``, ``Diagnostics``, ``LayerDiagnostics``: the transform state, its per-layer
  record (a mapping from layer path to ``LayerDiagnostics``) and one layer's record.
* ``DenseStats``, ``DenseGeneralStats``, ``EinsumStats``, ``ConvStats``, ``EmbedStats``,
  ``NormStats``, ``MatmulStats``, ``ChannelAffineStats``, ``LookupStats``, ``CurvatureStats``:
  raw per-layer statistics.
* ``LayerKind``, ``register_layer_kind``, ``unregister_layer_kind``: layer kinds of one's own
  (``thor_optax.layers`` has the pieces a kind is built from and the built-in kinds).
* ``thor_optax.flax.value_and_grad_with_stats``: capture from an unchanged Flax linen model;
  ``thor_optax.flax.TrainState``: Flax's ``TrainState`` whose ``apply_gradients`` takes the
  statistics.
* ``thor_optax.nnx.value_and_grad_with_stats``: the same capture from an unchanged Flax NNX
  model (gradients as ``nnx.grad`` gives them, for ``nnx.Optimizer.update``).
"""

from thor_optax._src.alias import kaisa
from thor_optax._src.alias import kfac
from thor_optax._src.alias import skfac
from thor_optax._src.alias import spngd
from thor_optax._src.alias import thor
from thor_optax._src.alias import thor_damping_schedule
from thor_optax._src.alias import thor_learning_rate_schedule
from thor_optax._src.schedule import CheckSchedule
from thor_optax._src.schedule import CurvatureBudget
from thor_optax._src.schedule import curvature_budget
from thor_optax._src.sharding import kronecker_state_sharding
from thor_optax._src.schedule import growing_interval
from thor_optax._src.stats import ConvStats
from thor_optax._src.stats import captured_layers
from thor_optax._src.stats import captured_mask
from thor_optax._src.stats import CapturedLayers
from thor_optax._src.stats import CurvatureStats
from thor_optax._src.kl_clip import KLClipState
from thor_optax._src.layers import register_layer_kind
from thor_optax._src.layers import unregister_layer_kind
from thor_optax._src.layers.base import LayerKind
from thor_optax._src.micro_batches import concatenate_stats
from thor_optax._src.kl_clip import scale_by_kl_clip
from thor_optax._src.weight_ratio import clip_by_weight_ratio
from thor_optax._src.momentum import scale_by_momentum_bias_correction
from thor_optax._src.finite import skip_not_finite
from thor_optax._src.lapack_threads import limit_lapack_threads
from thor_optax._src.stats import DenseGeneralStats
from thor_optax._src.stats import DenseStats
from thor_optax._src.stats import EinsumStats
from thor_optax._src.stats import MatmulStats
from thor_optax._src.stats import ChannelAffineStats
from thor_optax._src.stats import LookupStats
from thor_optax._src.stats import EmbedStats
from thor_optax._src.stats import NormStats
from thor_optax._src.transform import Diagnostics
from thor_optax._src.transform import KroneckerState
from thor_optax._src.transform import LayerDiagnostics
from thor_optax._src.transform import scale_by_kfac
from thor_optax._src.transform import scale_by_thor
from thor_optax._src.weight_rescaling import rescale_weight_norms
# The integrations load with the package: `import thor_optax` alone gives thor_optax.flax,
# thor_optax.nnx and thor_optax.layers, as the README's snippets use them.
from thor_optax import flax  # pylint: disable=g-bad-import-order
from thor_optax import layers
from thor_optax import nnx

__version__ = "0.2.0"

__all__ = (
    "CheckSchedule",
    "CurvatureBudget",
    "ConvStats",
    "CurvatureStats",
    "DenseGeneralStats",
    "DenseStats",
    "Diagnostics",
    "EinsumStats",
    "MatmulStats",
    "ChannelAffineStats",
    "LookupStats",
    "EmbedStats",
    "KLClipState",
    "KroneckerState",
    "LayerDiagnostics",
    "LayerKind",
    "NormStats",
    "CapturedLayers",
    "captured_layers",
    "captured_mask",
    "curvature_budget",
    "growing_interval",
    "concatenate_stats",
    "kaisa",
    "kfac",
    "kronecker_state_sharding",
    "register_layer_kind",
    "rescale_weight_norms",
    "scale_by_kfac",
    "scale_by_kl_clip",
    "clip_by_weight_ratio",
    "scale_by_momentum_bias_correction",
    "scale_by_thor",
    "skfac",
    "skip_not_finite",
    "limit_lapack_threads",
    "spngd",
    "thor",
    "thor_damping_schedule",
    "thor_learning_rate_schedule",
    "unregister_layer_kind",
    "flax",
    "layers",
    "nnx",
)

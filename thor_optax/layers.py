"""Layer kinds: what the package knows about each kind of layer, and how to add one.

A kind is a :class:`LayerKind` subclass instance registered with :func:`register_layer_kind` (tried
before the built-in kinds). The built-in kinds are instances of ``Dense``, ``Conv``,
``ConvTranspose``, ``DenseGeneral``, ``Einsum``, ``Embed``, ``Norm``, ``Matmul`` (any other
linen or NNX module whose call is a product by its own weight), ``ChannelAffine`` (any other
module whose call scales and shifts a function of its input by its own arrays: norms and
position embeddings of one's own) and ``Lookup`` (any other module whose call looks rows of its
own table up); ``registered()`` lists them in the order they are tried.
Subclass one of these classes to reuse its factors (see the README's "Layer kinds of your
own").
"""

from thor_optax._src.layers import register_layer_kind
from thor_optax._src.layers import registered
from thor_optax._src.layers import unregister_layer_kind
from thor_optax._src.layers.base import Claim
from thor_optax._src.layers.base import FactorRows
from thor_optax._src.layers.base import LayerKind
from thor_optax._src.layers.base import LayerSpec
from thor_optax._src.layers.base import Plan
from thor_optax._src.layers.channel_affine import ChannelAffine
from thor_optax._src.layers.channel_affine import ChannelAffineStats
from thor_optax._src.layers.conv import Conv
from thor_optax._src.layers.conv import ConvSampling
from thor_optax._src.layers.conv_transpose import ConvTranspose
from thor_optax._src.layers.dense import Dense
from thor_optax._src.layers.dense_general import DenseGeneral
from thor_optax._src.layers.einsum import Einsum
from thor_optax._src.layers.embed import Embed
from thor_optax._src.layers.lookup import Lookup
from thor_optax._src.layers.lookup import LookupStats
from thor_optax._src.layers.matmul import Matmul
from thor_optax._src.layers.matmul import MatmulStats
from thor_optax._src.layers.norm import Norm

__all__ = (
    "ChannelAffine",
    "ChannelAffineStats",
    "Claim",
    "Conv",
    "ConvSampling",
    "ConvTranspose",
    "Dense",
    "DenseGeneral",
    "Einsum",
    "Embed",
    "FactorRows",
    "LayerKind",
    "LayerSpec",
    "Lookup",
    "LookupStats",
    "Matmul",
    "MatmulStats",
    "Norm",
    "Plan",
    "register_layer_kind",
    "registered",
    "unregister_layer_kind",
)

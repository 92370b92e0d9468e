"""Tiny models written the way public Flax code writes them, for ``test_public_models.py``.

Each definition follows the style of a well-known public source (not its code): the Flax
``imagenet`` ResNet (``partial``-bound ``conv`` / ``norm`` module factories, BatchNorm with
``use_running_average=not train``, zero-initialised last scale of a residual block), the Flax
``lm1b`` / ``wmt`` decoder (``nn.scan`` over an ``nn.remat``-ed block with ``variable_axes=
{'params': 0}``, pre-LayerNorm, ``MlpBlock``), ``nn.RNN(nn.LSTMCell)`` classifiers, HuggingFace
Flax models (a tied LM head applied with ``.apply({'params': {'kernel': embedding.T}})``, outputs
as tuples, dicts and ``flax.struct.dataclass`` output classes, a BERT classifier whose attention
is written by hand, a GPT-2 whose ``Conv1D`` layers hold their kernels ``(d_out, d_in)``),
Gemma's linen code (an ``Einsum`` module given its equation at call time, ``layer(eqn, x)``,
multi-query attention, a gated MLP, an RMS norm and a tied embedder of its own), MaxText's
decoder (an ``Embed``, ``RMSNorm`` and ``DenseGeneral`` of its own, logically partitioned, in an
``nn.scan`` whose layer axis is named by ``metadata_params``), BiT /
ViT-hybrid weight-standardized convolutions (``class StdConv(nn.Conv)`` overriding ``param``),
``nn.remat``-ed layers, and the Flax NNX "scan over layers" pattern (``nnx.vmap`` to create a
stack of layers, ``nnx.scan`` to run it, ``nnx.remat`` around a layer), and Flax's NNX Gemma
example (its embedder with ``encode`` / ``decode``, einsum and RMS-norm modules of its own).

Sizes are tiny (widths 8-32, two or three layers, a few pixels or tokens) so that every model
compiles and trains in about a second on a CPU. :data:`LINEN_MODELS` lists the linen models with
a synthetic batch, a loss and what the capture is expected to do with them; the test file and
``benchmarks/public_models.py`` both read it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import flax
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

ModuleDef = Any


# ------------------------------------------------------------------ (1) ResNet with BatchNorm


class ResNetBlock(nn.Module):
  """A basic residual block: conv-norm-act-conv-norm, projection shortcut on a shape change."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable = nn.relu
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.norm()(y)
    y = self.act(y)
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  """ResNet v1 in the style of the Flax ImageNet example, two stages of one block."""

  stage_sizes: Sequence[int] = (1, 1)
  num_filters: int = 8
  num_classes: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5)
    x = conv(self.num_filters, (3, 3), name="conv_init")(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResNetBlock(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="head")(x)


# ------------------------------------------------ (2) decoder-only transformer, scan over remat


class MlpBlock(nn.Module):
  """Transformer MLP: Dense -> gelu -> Dense back to the model width."""

  mlp_dim: int

  @nn.compact
  def __call__(self, inputs):
    x = nn.Dense(self.mlp_dim)(inputs)
    x = nn.gelu(x)
    return nn.Dense(inputs.shape[-1])(x)


class DecoderBlock(nn.Module):
  """Pre-LayerNorm decoder block with causal self-attention; ``(carry, _) -> (carry, None)``
  so that ``nn.scan`` can stack it."""

  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x, _):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, deterministic=True)(
        y, mask=mask)
    x = x + y
    y = nn.LayerNorm()(x)
    y = MlpBlock(self.mlp_dim)(y)
    return x + y, None


class AddPositionEmbs(nn.Module):
  """Learned position embeddings added to the token embeddings (the ``'channel_affine'``
  kind: a shift per position and feature)."""

  max_len: int

  @nn.compact
  def __call__(self, inputs):
    pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                    (1, self.max_len, inputs.shape[-1]))
    return inputs + pe[:, :inputs.shape[1]]


class DecoderLM(nn.Module):
  """Decoder-only LM: ``nn.scan(nn.remat(DecoderBlock))`` over ``num_layers`` layers; returns
  logits ``(N, T, vocab_size)``."""

  vocab_size: int = 16
  emb_dim: int = 16
  num_heads: int = 2
  mlp_dim: int = 32
  num_layers: int = 2
  max_len: int = 8

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab_size, self.emb_dim, name="embed")(tokens)
    x = AddPositionEmbs(self.max_len, name="posembed")(x)
    stack = nn.scan(nn.remat(DecoderBlock), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=self.num_layers)
    x, _ = stack(self.num_heads, self.mlp_dim, name="decoder")(x, None)
    x = nn.LayerNorm(name="ln_f")(x)
    return nn.Dense(self.vocab_size, name="logits")(x)


class UnrolledMlpStack(nn.Module):
  """``num_layers`` residual ``LayerNorm -> MlpBlock`` layers, unrolled (the reference for the
  same layers under ``nn.scan``)."""

  mlp_dim: int = 16
  num_layers: int = 2
  num_classes: int = 4

  @nn.compact
  def __call__(self, x):
    for i in range(self.num_layers):
      x = x + MlpBlock(self.mlp_dim, name=f"mlp_{i}")(nn.LayerNorm(name=f"ln_{i}")(x))
    return nn.Dense(self.num_classes, name="head")(x)


class MlpLayer(nn.Module):
  """One residual ``LayerNorm -> MlpBlock`` layer as an ``nn.scan`` body."""

  mlp_dim: int

  @nn.compact
  def __call__(self, x, _):
    return x + MlpBlock(self.mlp_dim, name="mlp")(nn.LayerNorm(name="ln")(x)), None


class ScannedMlpStack(nn.Module):
  """The layers of :class:`UnrolledMlpStack` as ``nn.scan(nn.remat(MlpLayer))``."""

  mlp_dim: int = 16
  num_layers: int = 2
  num_classes: int = 4

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(nn.remat(MlpLayer), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=self.num_layers)
    x, _ = stack(self.mlp_dim, name="layers")(x, None)
    return nn.Dense(self.num_classes, name="head")(x)


def scanned_from_unrolled(params: dict, num_layers: int) -> dict:
  """The parameters of :class:`ScannedMlpStack` holding those of :class:`UnrolledMlpStack`."""
  layers = [{"ln": params[f"ln_{i}"], "mlp": params[f"mlp_{i}"]} for i in range(num_layers)]
  return {"layers": jax.tree.map(lambda *v: np.stack(v), *layers), "head": params["head"]}


# ------------------------------------------------------------------------ (3) LSTM classifier


class LSTMClassifier(nn.Module):
  """``nn.RNN(nn.LSTMCell)`` over ``(N, T, F)`` sequences, the last state through a Dense."""

  hidden_size: int = 8
  num_classes: int = 3

  @nn.compact
  def __call__(self, x):
    h = nn.RNN(nn.LSTMCell(self.hidden_size), name="rnn")(x)
    return nn.Dense(self.num_classes, name="head")(h[:, -1])


class BareLSTM(nn.Module):
  """Only Flax's fused LSTM cell (``nn.OptimizedLSTMCell``: its gates are bare ``DenseParams``
  applied by its own matrix products): the logits are the last hidden state, and no layer is
  of a kind the capture can take."""

  num_classes: int = 3

  @nn.compact
  def __call__(self, x):
    return nn.RNN(nn.OptimizedLSTMCell(self.num_classes), name="rnn")(x)[:, -1]


# ---------------------------------------------------------------- (4, 5) outputs as pytrees


class MLPWithAux(nn.Module):
  """An MLP returning ``(logits, aux)``, aux a dict of intermediate values."""

  features: Sequence[int] = (16, 16)
  num_classes: int = 4

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(self.features):
      x = nn.relu(nn.Dense(f, name=f"dense_{i}")(x))
    logits = nn.Dense(self.num_classes, name="head")(x)
    return logits, {"features": x, "feature_norm": jnp.sqrt(jnp.sum(x * x, axis=-1))}


class MLPDictOutput(nn.Module):
  """An MLP returning ``{'logits': ..., 'hidden_states': ...}``."""

  features: int = 16
  num_classes: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(self.features, name="dense")(x))
    return {"logits": nn.Dense(self.num_classes, name="head")(h), "hidden_states": (x, h)}


@flax.struct.dataclass
class ClassifierOutput:
  """A HuggingFace-style model output: logits and optional hidden states."""

  logits: jax.Array
  hidden_states: Optional[tuple] = None


class MLPDataclassOutput(nn.Module):
  """An MLP returning a :class:`ClassifierOutput`."""

  features: int = 16
  num_classes: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(self.features, name="dense")(x))
    return ClassifierOutput(logits=nn.Dense(self.num_classes, name="head")(h),
                            hidden_states=(x, h))


# ------------------------------------------------------------------ (6) tied-embedding LM


class TiedLM(nn.Module):
  """A token LM whose output projection is the input embedding's table, applied through
  ``nn.Dense(V, use_bias=False).apply({'params': {'kernel': embedding.T}}, h)`` (Hugging
  Face's Flax LM heads: the embedding's ``attend``, ``tied_outputs.py``)."""

  vocab_size: int = 16
  hidden_size: int = 16

  def setup(self):
    self.embed = nn.Embed(self.vocab_size, self.hidden_size)
    self.dense = nn.Dense(self.hidden_size)
    self.ln = nn.LayerNorm()
    self.lm_head = nn.Dense(self.vocab_size, use_bias=False)

  def __call__(self, tokens):
    h = self.embed(tokens)
    h = self.ln(h + nn.gelu(self.dense(h)))
    return self.lm_head.apply({"params": {"kernel": self.embed.embedding.T}}, h)


# ------------------------------------------------------------ (7) a bare Dense as the model


def bare_dense(num_classes: int = 4) -> nn.Module:
  """``nn.Dense`` itself given as the model: its parameters are at the root (``'(root)'``)."""
  return nn.Dense(num_classes)


# -------------------------------------------------------- (8) weight-standardized convolution


class StdConv(nn.Conv):
  """Convolution with weight standardization (BiT): the kernel is standardized in ``param``."""

  def param(self, name: str, *args, **kwargs):
    """The parameter ``name``; the kernel comes back standardized over its fan-in."""
    param = super().param(name, *args, **kwargs)
    if name == "kernel":
      param = param - jnp.mean(param, axis=(0, 1, 2), keepdims=True)
      param = param / (jnp.std(param, axis=(0, 1, 2), keepdims=True) + 1e-5)
    return param


class StdConvNet(nn.Module):
  """``StdConv`` root, then a plain conv and a Dense head."""

  width: int = 8
  num_classes: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.relu(StdConv(self.width, (3, 3), use_bias=False, name="conv_root")(x))
    x = nn.relu(nn.Conv(self.width, (3, 3), strides=(2, 2), name="conv_1")(x))
    return nn.Dense(self.num_classes, name="head")(jnp.mean(x, axis=(1, 2)))


# ------------------------------------------------------------------- (9) rank-1 regression


class Regressor(nn.Module):
  """An MLP regressor returning ``nn.Dense(1)(x)[..., 0]`` (rank 1), or ``(N, 1)`` with
  ``squeeze=False``."""

  features: Sequence[int] = (16, 16)
  squeeze: bool = True

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(self.features):
      x = nn.tanh(nn.Dense(f, name=f"dense_{i}")(x))
    out = nn.Dense(1, name="out")(x)
    return out[..., 0] if self.squeeze else out


# ---------------------------------------------------------------------- (10) nn.remat layers


class RematMLP(nn.Module):
  """An MLP whose Dense layers are ``nn.remat(nn.Dense)`` (plain ``nn.Dense`` with
  ``remat=False``; the layers are named, so both have the same parameter tree)."""

  features: Sequence[int] = (16, 16)
  num_classes: int = 4
  remat: bool = True

  @nn.compact
  def __call__(self, x):
    dense = nn.remat(nn.Dense) if self.remat else nn.Dense
    for i, f in enumerate(self.features):
      x = nn.tanh(dense(f, name=f"dense_{i}")(x))
    return dense(self.num_classes, name="head")(x)


# ------------------------------------------------- (12) BERT-style classifier, attention by hand


class BertStyleClassifier(nn.Module):
  """A Hugging Face Flax BERT written small: word embeddings and a LayerNorm, one encoder layer
  whose self-attention is written by hand (``nn.Dense`` query, key and value, Flax's
  ``dot_product_attention_weights`` with the padding mask as an additive ``finfo.min`` bias),
  post-LayerNorm residuals, a GELU MLP, the first token pooled by a tanh ``Dense``, a
  classifier. Its input is one dict, ``{'input_ids', 'attention_mask'}``."""

  vocab: int = 16
  width: int = 16
  heads: int = 2
  num_classes: int = 3

  @nn.compact
  def __call__(self, batch):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    h = nn.LayerNorm(name="embeddings_ln")(nn.Embed(self.vocab, self.width,
                                                    name="word_embeddings")(ids))
    q, k, v = (nn.Dense(self.width, name=n)(h).reshape(h.shape[:2] + (self.heads, -1))
               for n in ("query", "key", "value"))
    shape = mask[:, None, None, :].shape
    bias = jax.lax.select(mask[:, None, None, :] > 0, jnp.zeros(shape, h.dtype),
                          jnp.full(shape, jnp.finfo(h.dtype).min, h.dtype))
    weights = nn.attention.dot_product_attention_weights(q, k, bias=bias)
    context = jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(h.shape)
    h = nn.LayerNorm(name="attention_ln")(h + nn.Dense(self.width, name="attention_out")(context))
    mlp = nn.Dense(self.width, name="output")(
        nn.gelu(nn.Dense(2 * self.width, name="intermediate")(h)))
    h = nn.LayerNorm(name="output_ln")(h + mlp)
    pooled = jnp.tanh(nn.Dense(self.width, name="pooler")(h[:, 0]))
    return nn.Dense(self.num_classes, name="classifier")(pooled)


# -------------------------------- (13) GPT-2-style LM: Conv1D layers holding (d_out, d_in)


class Conv1D(nn.Module):
  """Hugging Face's Flax GPT-2 dense layer, written small: the ``kernel`` is stored
  ``(features, d_in)`` (the PyTorch layout), cast and transposed before ``lax.dot_general``."""

  features: int
  use_bias: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, inputs):
    inputs = jnp.asarray(inputs, self.dtype)
    kernel = self.param("kernel", nn.initializers.normal(0.02),
                        (self.features, inputs.shape[-1]))
    kernel = jnp.asarray(kernel.transpose(), self.dtype)
    y = jax.lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))
    if self.use_bias:
      y = y + jnp.asarray(self.param("bias", nn.initializers.zeros, (self.features,)),
                          self.dtype)
    return y


class GPT2Block(nn.Module):
  """Pre-LayerNorm block: a fused ``c_attn`` Conv1D split into query, key and value, causal
  attention written by hand (a ``finfo.min`` fill), ``c_proj``; an MLP of two Conv1D."""

  width: int = 16
  heads: int = 2

  @nn.compact
  def __call__(self, h):
    n, t, _ = h.shape
    qkv = Conv1D(3 * self.width, name="c_attn")(nn.LayerNorm(name="ln_1")(h))
    q, k, v = (a.reshape(n, t, self.heads, -1) for a in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v).reshape(n, t, -1)
    h = h + Conv1D(self.width, name="attn_c_proj")(context)
    mlp = Conv1D(4 * self.width, name="c_fc")(nn.LayerNorm(name="ln_2")(h))
    return h + Conv1D(self.width, name="mlp_c_proj")(nn.gelu(mlp, approximate=True))


class GPT2LM(nn.Module):
  """Token and position embeddings (``nn.Embed``, positions broadcast to the batch), one
  :class:`GPT2Block`, a final LayerNorm and logits tied to the token embedding
  (``wte.attend``)."""

  vocab: int = 16
  width: int = 16

  @nn.compact
  def __call__(self, ids):
    wte = nn.Embed(self.vocab, self.width, name="wte")
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    h = wte(ids) + nn.Embed(ids.shape[1], self.width, name="wpe")(positions)
    h = GPT2Block(self.width, name="h_0")(h)
    return wte.attend(nn.LayerNorm(name="ln_f")(h))


# ------------------------------ (14) Gemma-style LM: einsum modules given the equation at call


class GemmaEinsum(nn.Module):
  """Gemma's linen ``Einsum``, written small: a weight of any rank, the equation given first at
  call time, ``layer(eqn, x)``."""

  shape: tuple
  weight_name: str = "w"

  @nn.compact
  def __call__(self, eqn: str, x):
    return jnp.einsum(eqn, x, self.param(self.weight_name, nn.initializers.normal(0.2),
                                         self.shape))


class GemmaRMSNorm(nn.Module):
  """Gemma's RMS norm: ``x / rms(x) * (1 + scale)`` (no Flax class: the ``'channel_affine'``
  kind)."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6) * (1 + scale)


class GemmaEmbedder(nn.Module):
  """Gemma's embedder: ``encode`` looks tokens up (scaled by ``sqrt(d)``), ``decode`` is the
  tied output ``x @ table.T``; no ``__call__`` (the ``'lookup'`` kind, tied)."""

  vocab: int
  width: int

  def setup(self):
    self.table = self.param("input_embedding", nn.initializers.normal(), (self.vocab,
                                                                          self.width))

  def encode(self, ids):
    return self.table[(ids,)] * jnp.sqrt(self.width).astype(self.table.dtype)

  def decode(self, x):
    return jnp.dot(x, self.table.T)


class GemmaBlock(nn.Module):
  """Multi-query attention (one key-value head: ``q_einsum`` ``'BTD,NDH->BTNH'``, the fused
  ``kv_einsum`` ``'BSD,CKDH->CBSKH'``, ``attn_vec_einsum`` ``'BTNH,NHD->BTD'``) with a causal
  mask, and a gated MLP (``gating_einsum`` ``'...F,NFH->...NH'``, ``linear``
  ``'...H,HF->...F'``), each after a :class:`GemmaRMSNorm`."""

  width: int = 16
  heads: int = 2
  head_dim: int = 8
  hidden: int = 32

  @nn.compact
  def __call__(self, x):
    t = x.shape[1]
    h = GemmaRMSNorm(name="pre_attention_norm")(x)
    q = GemmaEinsum((self.heads, self.width, self.head_dim), name="q_einsum")("BTD,NDH->BTNH", h)
    k, v = GemmaEinsum((2, 1, self.width, self.head_dim), name="kv_einsum")("BSD,CKDH->CBSKH",
                                                                          h)
    logits = jnp.einsum("BTNH,BSKH->BTNS", q * self.head_dim ** -0.5, k)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool))[:, None], logits, -2.3819763e38)
    encoded = jnp.einsum("BTNS,BSKH->BTNH", jax.nn.softmax(logits), v)
    x = x + GemmaEinsum((self.heads, self.head_dim, self.width),
                        name="attn_vec_einsum")("BTNH,NHD->BTD", encoded)
    h = GemmaRMSNorm(name="pre_ffw_norm")(x)
    gate = GemmaEinsum((2, self.width, self.hidden), "gating_einsum",
                       name="gating")("...F,NFH->...NH", h)
    activations = nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
    return x + GemmaEinsum((self.hidden, self.width), "linear", name="linear")(
        "...H,HF->...F", activations)


class GemmaLM(nn.Module):
  """:class:`GemmaEmbedder`'s ``encode``, one :class:`GemmaBlock`, a final norm and the tied
  ``decode``."""

  vocab: int = 16
  width: int = 16

  @nn.compact
  def __call__(self, ids):
    embedder = GemmaEmbedder(self.vocab, self.width, name="embedder")
    x = GemmaBlock(self.width, name="layer_0")(embedder.encode(ids))
    return embedder.decode(GemmaRMSNorm(name="final_norm")(x))



# ------------------------------ (15) MaxText-style LM: modules of its own, logically partitioned


def _partitioned(init, names):
  return nn.with_logical_partitioning(init, names)


class MaxTextEmbed(nn.Module):
  """MaxText's ``Embed``: a partitioned table ``embedding``, cast and indexed in ``__call__``
  (the ``'lookup'`` kind); its ``attend`` is unused here (logits from their own dense layer,
  MaxText's default)."""

  vocab: int
  width: int

  def setup(self):
    self.embedding = self.param("embedding", _partitioned(nn.initializers.normal(1.0),
                                                          ("vocab", "embed")),
                                (self.vocab, self.width))

  def __call__(self, inputs):
    return jnp.asarray(self.embedding, jnp.float32)[inputs]

  def attend(self, query):
    return jnp.dot(query, jnp.asarray(self.embedding, jnp.float32).T)


class MaxTextRMSNorm(nn.Module):
  """MaxText's ``RMSNorm``: ``y * scale``, a partitioned scale (the ``'channel_affine'``
  kind)."""

  @nn.compact
  def __call__(self, x):
    y = x * jax.lax.rsqrt(jnp.mean(jax.lax.square(x), -1, keepdims=True) + 1e-6)
    scale = self.param("scale", _partitioned(nn.initializers.ones, ("norm",)), (x.shape[-1],))
    return y * jnp.asarray(scale, jnp.float32)


class MaxTextDenseGeneral(nn.Module):
  """MaxText's ``DenseGeneral``: ``lax.dot_general`` of the input's last ``axes`` with a
  partitioned kernel ``(in..., features...)``, no bias (the ``'matmul'`` kind)."""

  features: tuple
  axes: int = 1

  @nn.compact
  def __call__(self, x):
    in_shape = x.shape[x.ndim - self.axes:]
    kernel = self.param("kernel", _partitioned(nn.initializers.lecun_normal(),
                                               ("embed",) * len(in_shape) + ("mlp",)
                                               * len(self.features)),
                        in_shape + tuple(self.features))
    contract = tuple(range(x.ndim - self.axes, x.ndim))
    return jax.lax.dot_general(x, kernel, ((contract, tuple(range(self.axes))), ((), ())))


class MaxTextDecoderLayer(nn.Module):
  """Pre-norm causal attention (``query``/``key``/``value`` ``(D, H, h)``, ``out`` ``(H, h,
  D)``) and an MLP (``wi``, ``wo``); ``(carry, _) -> (carry, None)`` for ``nn.scan``."""

  width: int = 16
  heads: int = 2

  @nn.compact
  def __call__(self, x, _):
    hd = self.width // self.heads
    h = MaxTextRMSNorm(name="pre_self_attention_norm")(x)
    q, k, v = (MaxTextDenseGeneral((self.heads, hd), name=n)(h)
               for n in ("query", "key", "value"))
    t = x.shape[1]
    logits = jnp.einsum("btnh,bsnh->bnts", q * hd ** -0.5, k)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    attn = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits), v)
    x = x + MaxTextDenseGeneral((self.width,), axes=2, name="out")(attn)
    h = MaxTextRMSNorm(name="post_self_attention_norm")(x)
    h = nn.gelu(MaxTextDenseGeneral((2 * self.width,), name="wi")(h))
    return x + MaxTextDenseGeneral((self.width,), name="wo")(h), None


class MaxTextLM(nn.Module):
  """MaxText's decoder, small: ``token_embedder``, two :class:`MaxTextDecoderLayer` scanned over
  ``nn.remat`` with the layer axis named (``metadata_params``), ``decoder_norm`` and
  ``logits_dense``."""

  vocab: int = 16
  width: int = 16

  @nn.compact
  def __call__(self, ids):
    x = MaxTextEmbed(self.vocab, self.width, name="token_embedder")(ids)
    stack = nn.scan(nn.remat(MaxTextDecoderLayer), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=2,
                    metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = stack(self.width, name="layers")(x, None)
    x = MaxTextRMSNorm(name="decoder_norm")(x)
    return MaxTextDenseGeneral((self.vocab,), name="logits_dense")(x)

# ------------------------------------------------------------ (11) NNX: nnx.scan / nnx.remat


class NNXBlock(nnx.Module):
  """A residual ``Linear -> tanh`` block."""

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.linear(x))


class NNXScanMLP(nnx.Module):
  """NNX MLP: a stack of :class:`NNXBlock` made by ``nnx.vmap`` and run by ``nnx.scan``, one
  layer run under ``nnx.remat``, and plain input and output layers."""

  def __init__(self, din: int, width: int, depth: int, num_classes: int, rngs: nnx.Rngs):
    self.proj = nnx.Linear(din, width, rngs=rngs)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return NNXBlock(width, rngs)

    self.blocks = make_blocks(rngs)
    self.mid = nnx.Linear(width, width, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = jnp.tanh(self.proj(x))

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    x = forward(x, self.blocks)
    x = jnp.tanh(nnx.remat(lambda layer, h: layer(h))(self.mid, x))
    return self.head(x)


# ------------------------------------------ (16) NNX Gemma: Flax's own NNX example, written small


class NNXGemmaEmbedder(nnx.Module):
  """The NNX Gemma example's embedder: a table ``input_embedding``, ``encode`` (rows times
  ``sqrt(d)``) and the tied ``decode``; no ``__call__``."""

  def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
    self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, width)))

  def encode(self, ids):
    rows = self.input_embedding[(ids,)]
    return rows * jnp.sqrt(rows.shape[-1]).astype(rows.dtype)

  def decode(self, x):
    return x @ self.input_embedding[...].T


class NNXGemmaEinsum(nnx.Module):
  """An einsum module holding its equation and a weight ``w`` (the example's ``layers.Einsum``)."""

  def __init__(self, eqn: str, shape: tuple, rngs: nnx.Rngs):
    self.eqn = eqn
    self.w = nnx.Param(0.3 * jax.random.normal(rngs.params(), shape))

  def __call__(self, x):
    return jnp.einsum(self.eqn, x, self.w[...])


class NNXGemmaRMSNorm(nnx.Module):
  """``x / rms(x) * (1 + scale)`` with a zero-initialised ``scale``."""

  def __init__(self, width: int, rngs: nnx.Rngs):
    del rngs
    self.scale = nnx.Param(jnp.zeros((width,)))

  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (
        1 + self.scale[...])


class NNXGemmaBlock(nnx.Module):
  """Pre-norm multi-head attention (a fused ``qkv_einsum`` ``'BTD,SNDH->SBTNH'``, a causal mask,
  ``attn_vec_einsum``) and a gated MLP of three bias-free ``nnx.Linear`` layers."""

  def __init__(self, width: int, heads: int, head_dim: int, hidden: int, rngs: nnx.Rngs):
    self.pre_attention_norm = NNXGemmaRMSNorm(width, rngs)
    self.qkv_einsum = NNXGemmaEinsum("BTD,SNDH->SBTNH", (3, heads, width, head_dim), rngs)
    self.attn_vec_einsum = NNXGemmaEinsum("BTNH,NHD->BTD", (heads, head_dim, width), rngs)
    self.pre_ffw_norm = NNXGemmaRMSNorm(width, rngs)
    self.gate_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

  def __call__(self, x):
    q, k, v = self.qkv_einsum(self.pre_attention_norm(x))
    t = x.shape[1]
    logits = jnp.einsum("BTNH,BSNH->BTNS", q * q.shape[-1] ** -0.5, k)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool))[:, None], logits, -2.3819763e38)
    x = x + self.attn_vec_einsum(jnp.einsum("BTNS,BSNH->BTNH", jax.nn.softmax(logits), v))
    h = self.pre_ffw_norm(x)
    return x + self.down_proj(nnx.gelu(self.gate_proj(h)) * self.up_proj(h))


class NNXGemma(nnx.Module):
  """``encode``, two :class:`NNXGemmaBlock` s in a Python list, a final norm and the tied
  ``decode``."""

  def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
    self.embedder = NNXGemmaEmbedder(vocab, width, rngs)
    self.layers = nnx.List([NNXGemmaBlock(width, 2, 4, 2 * width, rngs) for _ in range(2)])
    self.final_norm = NNXGemmaRMSNorm(width, rngs)

  def __call__(self, ids):
    x = self.embedder.encode(ids)
    for layer in self.layers:
      x = layer(x)
    return self.embedder.decode(self.final_norm(x))


# ------------------------------------------------------------------------ data and losses


def softmax_ce(logits, labels):
  """Softmax cross-entropy with integer labels, averaged over every position."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def squared_error(pred, y):
  """``0.5 (pred - y)^2`` averaged over examples (any matching shapes)."""
  return 0.5 * jnp.mean(jnp.sum(jnp.reshape((pred - y) ** 2, (pred.shape[0], -1)), axis=-1))


def classification_batch(seed: int, shape: Sequence[int], num_classes: int, label_shape=None):
  """A fixed synthetic batch: normal inputs of ``shape`` and labels that depend on them."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  n = shape[0]
  w = rng.standard_normal((int(np.prod(shape[1:])), num_classes))
  y = np.argmax(x.reshape(n, -1) @ w, axis=-1)
  if label_shape is not None:
    y = rng.integers(0, num_classes, label_shape)
  return jnp.asarray(x), jnp.asarray(y)


def token_batch(seed: int, n: int, t: int, vocab: int):
  """Token sequences and next-token targets (a fixed random permutation of the inputs)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (n, t))
  perm = rng.permutation(vocab)
  return jnp.asarray(tokens), jnp.asarray(perm[tokens])


def regression_batch(seed: int, n: int, d: int):
  """Inputs ``(n, d)`` and a smooth scalar target ``(n,)``."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)).astype(np.float32)
  y = np.sin(x @ rng.standard_normal(d)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y)


def bert_batch(seed: int, n: int, t: int, vocab: int, num_classes: int):
  """``({'input_ids', 'attention_mask'}, labels)``: sequences padded at the end (every one keeps
  its first two tokens), labels from the unpadded tokens."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (n, t))
  mask = (np.arange(t)[None] < rng.integers(2, t + 1, (n, 1))).astype(np.int32)
  labels = (ids * mask).sum(1) % num_classes
  return ({"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)},
          jnp.asarray(labels))


@dataclasses.dataclass(frozen=True)
class Case:
  """A linen model with its batch, loss and expected capture.

  Attributes:
    name: short name.
    model: the linen module.
    make_batch: ``() -> (inputs, targets)``.
    loss_fn: ``loss_fn(outputs, targets)`` on the model's outputs as it returns them.
    preconditioned: layer names expected to be preconditioned.
    unhandled: ``{layer name: words its reason must contain}``.
    capture_kwargs: keywords of ``value_and_grad_with_stats`` (``num_loss_terms``).
    batch_stats: whether the model has a ``batch_stats`` collection (``train=True`` then).
    learning_rate: the optimizer's learning rate.
    captured_layout: whether the optimizer needs the capture's layout,
      ``layers=thor_optax.captured_layers(stats)`` (:func:`captured_layout`).
  """

  name: str
  model: nn.Module
  make_batch: Callable[[], tuple]
  loss_fn: Callable
  preconditioned: frozenset
  unhandled: dict
  capture_kwargs: dict = dataclasses.field(default_factory=dict)
  batch_stats: bool = False
  learning_rate: float = 0.05
  captured_layout: bool = False


_ATTN = ("query", "key", "value", "out")
_LSTM_GATES = ("ii", "if", "ig", "io", "hi", "hf", "hg", "ho")

LINEN_MODELS: dict[str, Case] = {c.name: c for c in [
    Case("resnet", ResNet(), lambda: classification_batch(0, (8, 6, 6, 3), 4), softmax_ce,
         frozenset({"conv_init", "bn_init", "head"}
                   | {f"ResNetBlock_0/{m}" for m in ("Conv_0", "Conv_1", "BatchNorm_0",
                                                     "BatchNorm_1")}
                   | {f"ResNetBlock_1/{m}" for m in ("Conv_0", "Conv_1", "BatchNorm_0",
                                                     "BatchNorm_1", "conv_proj", "norm_proj")}),
         {}, batch_stats=True, learning_rate=0.1),
    Case("transformer", DecoderLM(), lambda: token_batch(1, 4, 8, 16), softmax_ce,
         frozenset({"embed", "posembed", "ln_f", "logits", "decoder/LayerNorm_0",
                    "decoder/LayerNorm_1", "decoder/MlpBlock_0/Dense_0",
                    "decoder/MlpBlock_0/Dense_1"}
                   | {f"decoder/MultiHeadDotProductAttention_0/{p}" for p in _ATTN}), {}),
    Case("lstm", LSTMClassifier(), lambda: classification_batch(2, (8, 5, 3), 3), softmax_ce,
         frozenset({"head"} | {f"LSTMCell_0/{g}" for g in _LSTM_GATES}), {}),
    Case("mlp_aux", MLPWithAux(), lambda: classification_batch(3, (16, 6), 4),
         lambda out, y: softmax_ce(out[0], y),
         frozenset({"dense_0", "dense_1", "head"}), {}, dict(num_loss_terms=16)),
    Case("dict_output", MLPDictOutput(), lambda: classification_batch(4, (16, 6), 4),
         lambda out, y: softmax_ce(out["logits"], y),
         frozenset({"dense", "head"}), {}, dict(num_loss_terms=16)),
    Case("dataclass_output", MLPDataclassOutput(), lambda: classification_batch(5, (16, 6), 4),
         lambda out, y: softmax_ce(out.logits, y),
         frozenset({"dense", "head"}), {}, dict(num_loss_terms=16)),
    Case("tied_lm", TiedLM(), lambda: token_batch(6, 4, 6, 16), softmax_ce,
         frozenset({"embed", "dense", "ln"}), {}),
    Case("bare_dense", bare_dense(), lambda: classification_batch(7, (16, 6), 4), softmax_ce,
         frozenset({"(root)"}), {}, learning_rate=0.2),
    Case("std_conv", StdConvNet(), lambda: classification_batch(8, (8, 6, 6, 3), 4),
         softmax_ce, frozenset({"conv_1", "head"}), {"conv_root": "overrides param"}),
    Case("regression", Regressor(), lambda: regression_batch(9, 16, 4), squared_error,
         frozenset({"dense_0", "dense_1", "out"}), {}, dict(num_loss_terms=16)),
    Case("remat", RematMLP(), lambda: classification_batch(10, (16, 6), 4), softmax_ce,
         frozenset({"dense_0", "dense_1", "head"}), {}),
    Case("bert_classifier", BertStyleClassifier(), lambda: bert_batch(11, 8, 6, 16, 3),
         softmax_ce,
         frozenset({"word_embeddings", "embeddings_ln", "query", "key", "value",
                    "attention_out", "attention_ln", "intermediate", "output", "output_ln",
                    "pooler", "classifier"}), {}),
    Case("gpt2_lm", GPT2LM(), lambda: token_batch(12, 4, 8, 16), softmax_ce,
         frozenset({"wte", "wpe", "ln_f"}
                   | {f"h_0/{m}" for m in ("ln_1", "c_attn", "attn_c_proj", "ln_2", "c_fc",
                                           "mlp_c_proj")}), {}, captured_layout=True),
    Case("gemma_lm", GemmaLM(), lambda: token_batch(13, 4, 8, 16), softmax_ce,
         frozenset({"embedder", "final_norm"} | {f"layer_0/{m}" for m in (
             "pre_attention_norm", "q_einsum", "kv_einsum", "attn_vec_einsum", "pre_ffw_norm",
             "gating", "linear")}),
         {}, captured_layout=True),
    Case("maxtext_lm", MaxTextLM(), lambda: token_batch(14, 4, 8, 16), softmax_ce,
         frozenset({"token_embedder", "decoder_norm", "logits_dense"}
                   | {f"layers/{m}" for m in ("pre_self_attention_norm", "query", "key", "value",
                                              "out", "post_self_attention_norm", "wi", "wo")}),
         {}, captured_layout=True),
]}


# ------------------------------------------------------------------ the README's training steps

# ``jax.jit(..., compiler_options=FAST_COMPILE)`` compiles 2-3x faster on CPU: XLA's backend
# optimizations and CPU fusion emitters off. The tests use it (compiling is most of their run
# time); the benchmark times steps compiled with the defaults.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def init_case(case: Case, seed: int = 0) -> tuple[Any, dict, tuple]:
  """``(params, model_state, (inputs, targets))`` of a case: its initial parameters, its other
  collections (``{'batch_stats': ...}`` or ``{}``) and its fixed batch."""
  x, y = case.make_batch()
  # Compiled once with FAST_COMPILE: the random initializers compile about 15x faster so (from
  # seconds for the ResNet), and run once.
  init = jax.jit(lambda x: case.model.init(jax.random.PRNGKey(seed), x),
                 compiler_options=FAST_COMPILE)
  variables = init(x)
  state = {k: v for k, v in variables.items() if k != "params"}
  return variables["params"], state, (x, y)


def captured_layout(case: Case, params: Any, model_state: dict, batch: tuple) -> Any:
  """``thor_optax.captured_layers`` of one abstract capture of the case (no FLOPs) when the
  case needs it (:attr:`Case.captured_layout`: kernels applied transposed), else ``None``."""
  if not case.captured_layout:
    return None
  from thor_optax.flax import value_and_grad_with_stats  # pylint: disable=import-outside-toplevel
  import thor_optax  # pylint: disable=import-outside-toplevel

  capture = value_and_grad_with_stats(case.model, case.loss_fn, **case.capture_kwargs)
  _, stats = jax.eval_shape(lambda p: capture(p, *batch, model_state=model_state), params)
  return thor_optax.captured_layers(stats)


def make_steps(case: Case, tx: optax.GradientTransformation,
               on_stats: Optional[Callable[[Any], None]] = None) -> tuple[Callable, Callable]:
  """The README's ``(check_step, plain_step)`` for a case, not jitted.

  Both are ``step(params, model_state, opt_state, x, y) -> (params, model_state, opt_state,
  loss)``. The check step captures the statistics and passes them as ``curvature_stats``; the
  plain step differentiates ``loss_fn(model.apply(...))`` and calls ``tx.update`` without them
  (with ``optax.sgd`` as ``tx`` it is a plain SGD step). A model with ``batch_stats`` runs in
  training mode and its running averages are updated. ``on_stats``, if given, is called with
  the check step's ``CurvatureStats`` when the step is traced (its static ``unhandled`` is
  readable there).
  """
  from thor_optax.flax import value_and_grad_with_stats  # pylint: disable=import-outside-toplevel

  model, loss_fn = case.model, case.loss_fn
  capture = value_and_grad_with_stats(model, loss_fn, **case.capture_kwargs)
  mutable = ("batch_stats",) if case.batch_stats else False

  def check_step(params, model_state, opt_state, x, y):
    if mutable:
      (loss, grads), stats, model_state = capture(params, x, y, model_state=model_state,
                                                  mutable=mutable)
    else:
      (loss, grads), stats = capture(params, x, y, model_state=model_state)
    if on_stats is not None:
      on_stats(stats)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), model_state, opt_state, loss

  def plain_step(params, model_state, opt_state, x, y):
    def loss_of(p):
      variables = {"params": p, **model_state}
      if mutable:
        out, new_state = model.apply(variables, x, mutable=list(mutable))
        return loss_fn(out, y), new_state
      return loss_fn(model.apply(variables, x), y), model_state

    (loss, new_state), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, opt_state, loss

  return check_step, plain_step

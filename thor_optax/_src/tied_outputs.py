"""Tied output projections applied with ``.apply()``: Hugging Face's Flax language-model heads.

Hugging Face's Flax models tie the output projection to the input embedding by applying a
``nn.Dense`` to the embedding's table transposed, inside the model::

    shared = self.transformer.variables["params"]["wte"]["embedding"].T
    logits = self.lm_head.apply({"params": {"kernel": shared}}, hidden_states)

(``FlaxGPT2LMHeadModule``; ``FlaxBertLMPredictionHead`` applies its ``decoder`` so). The
``Dense`` runs on a variable tree of its own, so the linen capture sees it as a foreign call;
``h @ embedding.T`` is exactly the embedding's ``attend(h)``. When the kernel such a call is
given is a parameter of a captured embedding, transposed (up to float casts), the call is noted
as that embedding's ``attend`` use and joined with its lookups (weight sharing, as
``Embed.attend`` is: ``embed.py``); any other ``.apply()`` of a layer fed by a model parameter
keeps that parameter's module listed (``capture._shared_with_apply``; inside ``nn.remat`` or
``nn.scan``, where no kernel is linked, ``capture.used_outside_their_calls``).

Found on the discovery pass's jaxpr: the kernels of the foreign calls are extra outputs of the
pass, and each is followed back through casts and one ``transpose`` to the parameter it is.

References:
  Eschenhagen et al., "Kronecker-Factored Approximate Curvature for Modern Neural Network
  Architectures", NeurIPS 2023 (a shared weight's uses joined).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from thor_optax._src import stats as stats_lib
from thor_optax._src.layers import base as layer_base
from thor_optax._src.layers import traced


@dataclasses.dataclass(frozen=True)
class Applied:
  """One ``__call__`` of a registered kind's module applied with ``.apply()`` inside the model,
  in call order.

  Attributes:
    input_shape: the primary input's shape.
    out: the output's ``ShapeDtypeStruct`` (``None`` if it is not one array).
    kernel: the kernel it was given, when the call could be a tied output (:func:`of`), else
      ``None``.
  """

  input_shape: tuple[int, ...]
  out: Optional[jax.ShapeDtypeStruct]
  kernel: Optional[jax.Array]


def of(mod: nn.Module, kind: layer_base.LayerKind, args: tuple, kwargs: dict, out: Any,
       apart: bool) -> Applied:
  """The :class:`Applied` of a foreign call of ``mod`` (of the registered ``kind``); its
  kernel is kept when ``mod`` is a plain ``'dense'`` layer (no override, no bias) given only a
  rank-2 ``kernel``, called on one array under the forward pass's own trace (``apart``:
  ``False``)."""
  x = layer_base.primary_input(args, kwargs)
  params = mod.variables.get("params", {})
  plain = kind.name == "dense" and kind.overridden(mod) == ((), ())
  tied = (plain and not apart and set(params) == {"kernel"} and jnp.ndim(params["kernel"]) == 2
          and layer_base.one_array_input(args, kwargs))
  out_struct = jax.ShapeDtypeStruct(out.shape, out.dtype) if hasattr(out, "shape") else None
  return Applied(tuple(jnp.shape(x)), out_struct, params["kernel"] if tied else None)


def _source(jaxpr: Any, var: Any, n_params: int) -> Optional[int]:
  """The index among the jaxpr's first ``n_params`` inputs of the parameter that ``var`` is,
  transposed once, up to float casts; ``None`` otherwise."""
  producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  transposed = False
  while True:
    if var in jaxpr.invars[:n_params]:
      return jaxpr.invars.index(var) if transposed else None
    eqn = producer.get(var)
    if eqn is None:
      return None
    prim = eqn.primitive.name
    if traced.float_cast(eqn):
      var = eqn.invars[0]
    elif prim == "transpose" and not transposed and tuple(eqn.params["permutation"]) == (1, 0):
      transposed, var = True, eqn.invars[0]
    else:
      return None
    if not isinstance(var, jax.extend.core.Var):
      return None


def link(jaxpr: Any, applied: Sequence[Applied], params: Any,
         calls: Mapping[tuple[str, ...], list], call_type: type) -> dict[int, tuple]:
  """``{index of the foreign call: (path of the embedding, its use)}`` for the foreign calls
  whose kernel is a captured embedding's table transposed; the use is a ``call_type``
  (``capture.Call``) noted as that layer's ``attend``, with the plan its kind gives
  (:meth:`~layer_base.LayerKind.transposed_use`).

  ``jaxpr``: the discovery pass's, its first inputs the parameters' leaves and its last outputs
  the kernels of the calls of ``applied`` that have one, in order.
  """
  flat = [stats_lib.path_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  leaves = jax.tree.leaves(params)
  kernels = [i for i, a in enumerate(applied) if a.kernel is not None]
  outvars = jaxpr.outvars[len(jaxpr.outvars) - len(kernels):]
  linked = {}
  for k, var in zip(kernels, outvars):
    at = _source(jaxpr, var, len(flat)) if isinstance(var, jax.extend.core.Var) else None
    if at is None or flat[at][:-1] not in calls:
      continue
    path, first = flat[at][:-1], calls[flat[at][:-1]][0]
    use = first.kind.transposed_use(flat[at][-1], tuple(leaves[at].shape))
    if use is not None:
      linked[k] = (path, call_type(first.module, use[0], applied[k].input_shape, applied[k].out,
                                   kind=first.kind, plan=use[1]))
  return linked


def in_call_order(calls: dict, linked: Mapping[int, tuple],
                  sequence: Sequence[tuple[Optional[tuple[str, ...]], int]]) -> None:
  """Puts the foreign uses :func:`link` found among the calls of their embedding, in the
  order they ran: ``sequence`` holds ``(path, index in calls[path])`` of each noted call and
  ``(None, k)`` of each foreign call, as the discovery pass saw them (the forward pass joins
  the uses in that order)."""
  for path in {p for p, _ in linked.values()}:
    own = calls[path]
    calls[path] = [own[i] if where == path else linked[i][1] for where, i in sequence
                   if where == path or (where is None and linked.get(i, (None,))[0] == path)]

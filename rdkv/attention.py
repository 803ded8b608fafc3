"""The attention function rdkv registers with transformers.

During prefill it computes ordinary causal attention in query chunks (memory O(T * chunk), never T x T)
and, from the same probabilities, streams the sums the weight estimator needs: attention mass per key,
and its square, and squared query norms per channel. On a compressed cache
(``cache.update`` returns the :class:`~rdkv.trizone.TriZoneLayer` itself) it runs the TriZone decode.
"""
from __future__ import annotations

import torch

from .decode import trizone_decode
from .dense import AttentionSums, allowed_keys, attend
from .errors import RDKVError
from .record import LayerStats, RDKVState
from .trizone import TriZoneLayer


def _sdpa(q, k, v, q_pos, k_pos, scaling, window, mask) -> torch.Tensor:
    """Plain attention output through torch SDPA (no statistics): the fast prefill path."""
    ok = None
    if mask is not None:
        ok = mask
    elif window is not None or q.shape[2] != k.shape[2]:
        ok = allowed_keys(q_pos, k_pos, window)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=ok, is_causal=ok is None, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    if mask is not None:  # rows that may attend to nothing (left padding) come out NaN
        out = out.nan_to_num(0.0)
    return out


def _record(state: RDKVState, module: torch.nn.Module, query, key, value, mask, scaling, window, softcap):
    """Prefill/continuation on an ordinary cache: attend, and stream what the estimator needs into
    ``state`` (all-query sums only when the model was attached with ``all_queries=True``)."""
    layer = module.layer_idx
    L, Tk = query.shape[2], key.shape[2]
    prev = state.layers.get(layer)
    if prev is None and Tk != L:
        raise RDKVError(f"layer {layer}: the cache already held {Tk - L} tokens that rdkv did not see (it was filled "
                        "before rdkv.attach, or attach was called again since): prefill again from an empty cache")
    fresh = prev is None or Tk == L  # the cache held nothing before this call: a new prefill
    seen = L if fresh else prev.seen + L
    dev = query.device
    q_pos = torch.arange(seen - L, seen, device=dev)
    k_pos = torch.arange(seen - Tk, seen, device=dev)
    if mask is not None and mask.dtype != torch.bool:
        raise RDKVError(f"rdkv attention expects a boolean mask, got {mask.dtype}; attach the model with rdkv.attach")
    key, value, query = key.detach(), value.detach(), query.detach()
    B, H = key.shape[0], key.shape[1]
    if state.all_queries or softcap is not None:
        out, sums = attend(query, key, value, q_pos, k_pos, scaling, window, softcap, mask)
    else:
        out, sums = _sdpa(query, key, value, q_pos, k_pos, scaling, window, mask), None
    total = None
    if state.all_queries:
        sums = AttentionSums(*(x.detach() for x in (sums.mass, sums.mass2, sums.q2, sums.nq)))
        if fresh:
            z = sums.mass.new_zeros(B, H, seen)
            total = AttentionSums(z, z.clone(), sums.q2, sums.nq)
        else:
            old, z = prev.sums, sums.mass.new_zeros(B, H, L)
            total = AttentionSums(torch.cat([old.mass, z], -1), torch.cat([old.mass2, z], -1), old.q2 + sums.q2, old.nq + sums.nq)
        total.mass[..., seen - Tk :] += sums.mass
        total.mass2[..., seen - Tk :] += sums.mass2
    attended = mask[:, 0].any(1) if mask is not None else torch.ones(B, Tk, dtype=torch.bool, device=dev)
    if fresh:
        valid = torch.zeros(B, seen, dtype=torch.bool, device=dev)
        window_q = query[:, :, -state.window :]
    else:
        valid = torch.cat([prev.valid, prev.valid.new_zeros(B, L)], -1)
        window_q = torch.cat([prev.window_q, query], 2)[:, :, -state.window :]
    valid[:, seen - Tk :] |= attended
    state.layers[layer] = LayerStats(key, value, seen, total, valid, window_q, scaling, window, softcap)
    return out.to(query.dtype)


def rdkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (out [B, q, Hq, D], None)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(key, TriZoneLayer):
        return trizone_decode(query, key, scaling, sliding_window, softcap, attention_mask).transpose(1, 2), None
    state = getattr(module, "_rdkv_state", None)
    if state is None:
        raise RDKVError("this attention module has no rdkv state: call rdkv.attach(model) instead of selecting 'rdkv' by hand")
    if dropout and module.training:
        raise RDKVError("rdkv attention is for inference: call model.eval() (dropout is not supported)")
    out = _record(state, module, query, key, value, attention_mask, scaling, sliding_window, softcap)
    return out.transpose(1, 2), None

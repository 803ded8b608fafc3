"""The attention function rdkv registers with transformers.

During prefill it computes ordinary causal attention in query chunks (memory O(T * chunk), never T x T)
and, from the same probabilities, streams the sums the weight estimator needs: attention mass per key,
and its square, and squared query norms per channel. On a compressed cache
(``cache.update`` returns the :class:`~rdkv.trizone.TriZoneLayer` itself) it runs the TriZone decode.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .errors import RDKVError

CHUNK_ELEMENTS = 1 << 24  # score elements per query chunk (64 MB in fp32)


@dataclass
class AttentionSums:
    """Sums over a set of queries, per (batch, kv head): the statistics behind token and channel weights."""

    mass: torch.Tensor  # [B, H, T] sum over queries (and grouped heads) of the attention probability on each key
    mass2: torch.Tensor  # [B, H, T] the same sum of squared probabilities (second-order error weights)
    q2: torch.Tensor  # [B, H, D] sum of squared query components
    nq: torch.Tensor  # [B] number of (query, grouped-head) pairs that attended to something


@dataclass
class LayerStats:
    """What one layer's prefill leaves behind for :func:`rdkv.compress`."""

    key: torch.Tensor  # [B, H, Tk, D] the cache's own tensors (a reference, not a copy)
    value: torch.Tensor
    seen: int  # logical length: tokens this layer's cache has seen
    sums: AttentionSums | None  # over every prefill query (only if attached with all_queries=True)
    valid: torch.Tensor  # [B, seen] bool: attended by some query (False = padding)
    window_q: torch.Tensor  # [B, Hq, <=W, D] the last W queries, for the observation-window weights
    scaling: float
    sliding_window: int | None
    softcap: float | None

    @property
    def start(self) -> int:
        """Absolute position of ``key[..., 0, :]`` (sliding-window layers keep only their window)."""
        return self.seen - self.key.shape[-2]


@dataclass
class RDKVState:
    """Per-model state shared by every attention module of an attached model."""

    window: int = 256
    all_queries: bool = False
    layers: dict[int, LayerStats] = field(default_factory=dict)
    ids: torch.Tensor | None = None  # [B, seen] token ids of the prefill (for surprisal)
    hidden: torch.Tensor | None = None  # [B, seen, d_model] final hidden states of the prefill
    recording: bool = False  # the current forward runs on an ordinary cache
    surprisal: torch.Tensor | None = None  # computed from ids/hidden on first use

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Run forwards that re-prefill or extend the record (calibration, diagnostics), then put the
        user's record of their last prefill back, whatever happened."""
        saved = (dict(self.layers), self.ids, self.hidden, self.surprisal)
        try:
            yield
        finally:
            self.layers.clear()
            self.layers.update(saved[0])
            self.ids, self.hidden, self.surprisal = saved[1:]


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility [..., q, k] from absolute positions."""
    ok = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if window is not None:
        ok &= q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2) < window
    return ok


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, AttentionSums]:
    """Exact attention of q [B, Hq, q, D] over k, v [B, H, Tk, D] plus the weight statistics.

    Runs in query chunks so the score tensor never exceeds ``elements``. ``mask`` is an optional
    bool [B, 1, q, Tk] (True = may attend) combined with causality from the positions. Queries that may
    attend to nothing (left padding) get a zero output and contribute nothing to the sums.
    """
    B, Hq, L, D = q.shape
    H, Tk = k.shape[1], k.shape[2]
    G = Hq // H
    kf, vf = k.float(), v.float()
    out = q.new_empty(B, Hq, L, D)
    sums = AttentionSums(
        mass=kf.new_zeros(B, H, Tk), mass2=kf.new_zeros(B, H, Tk), q2=kf.new_zeros(B, H, D), nq=kf.new_zeros(B))
    chunk = max(1, elements // max(1, B * Hq * Tk))
    for a in range(0, L, chunk):
        qc = q[:, :, a : a + chunk].float().unflatten(1, (H, G))  # [B, H, G, c, D]
        s = torch.einsum("bhgqd,bhkd->bhgqk", qc, kf) * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        ok = allowed_keys(q_pos[a : a + chunk], k_pos, window)  # [c, Tk]
        ok = ok.expand(B, 1, 1, *ok.shape)
        if mask is not None:
            ok = ok & mask[:, None, :, a : a + chunk]
        s = s.masked_fill(~ok, float("-inf"))
        m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
        p = (s - m).exp()
        p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
        o = torch.einsum("bhgqk,bhkd->bhgqd", p, vf)
        out[:, :, a : a + chunk] = o.flatten(1, 2).to(out.dtype)
        live = ok.any(-1)  # [B, 1|H, 1|G, c] query attends to something
        live = live.expand(B, H, G, live.shape[-1])
        sums.mass += p.sum((2, 3))
        sums.mass2 += p.square().sum((2, 3))
        sums.q2 += (qc.square() * live.unsqueeze(-1)).sum((2, 3))
        sums.nq += live[:, 0].sum((1, 2))
    return out, sums


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
    from .trizone import TriZoneLayer

    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(key, TriZoneLayer):
        from .decode import trizone_decode

        out = trizone_decode(query, key, scaling, sliding_window, softcap, attention_mask)
        if key.fold is not None:
            from .fold import observe

            observe(key, query, scaling, softcap)
        return out.transpose(1, 2), None
    state = getattr(module, "_rdkv_state", None)
    if state is None:
        raise RDKVError("this attention module has no rdkv state: call rdkv.attach(model) instead of selecting 'rdkv' by hand")
    if dropout and module.training:
        raise RDKVError("rdkv attention is for inference: call model.eval() (dropout is not supported)")
    out = _record(state, module, query, key, value, attention_mask, scaling, sliding_window, softcap)
    return out.transpose(1, 2), None

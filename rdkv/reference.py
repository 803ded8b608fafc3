"""Pure-torch TriZone decode: the oracle the fused Triton kernel is tested against.

Attention over each packed segment (zones A+B, dequantized; folds likewise) and zone C (fresh 16-bit
tokens) is computed as partial softmaxes merged by log-sum-exp, exactly the structure of the split-K kernel.
"""
from __future__ import annotations

import torch

from . import layout, pages
from .dense import allowed_keys
from .trizone import TriZoneLayer


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, scaling: float,
                      softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, M, D], k/v [S, N, D], ok [S, M, N] -> (normalised output [S, M, D], lse [S, M]).

    A row with no visible key has lse = -inf and output 0, so it drops out of the merge.
    """
    s = torch.einsum("smd,snd->smn", q, k) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = (s - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).exp()
    return torch.einsum("smn,snd->smd", p, v), lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine normalised partial outputs by their log-sum-exp weights."""
    lse = torch.stack([p[1] for p in parts])  # [Z, S, M]
    w = torch.softmax(lse, 0).nan_to_num(0.0)  # all -inf -> zero output
    return sum(wi.unsqueeze(-1) * o for wi, (o, _) in zip(w, parts))


def queries(query: torch.Tensor, layer: TriZoneLayer, sliding_window: int | None, mask: torch.Tensor | None):
    """What every torch decode path needs from a call: (q [S, G*L, D] float32 with S = batch * kv heads,
    each query's absolute position [G*L] (head-major like q), the window in force, and the bool mask over
    absolute positions repeated per stream and query head [S, G*L, seq], or None)."""
    B, Hq, L, D = query.shape
    H = layer.heads
    G = Hq // H
    seq = layer.get_seq_length()
    q_pos = torch.arange(seq - L, seq, device=query.device).expand(G, L).reshape(-1)
    window = sliding_window if layer.sliding_window is None else layer.sliding_window
    m = None if mask is None else mask[:, 0, :, :seq].bool().repeat_interleave(H, 0).repeat(1, G, 1)
    return query.float().reshape(B * H, G * L, D), q_pos, window, m


def trizone_attention(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                      softcap: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, Hq, L, D] (the L newest tokens, already appended to zone C) -> out [B, Hq, L, D], in the basis V
    is stored in (:func:`rdkv.decode.trizone_decode` rotates it back under ``spec.v_rotate``).

    ``mask``, if given, is transformers' bool mask over absolute positions [B, 1, L, >=seq_len]; its
    columns are gathered at the positions of the kept tokens.
    """
    q, q_pos, window, m = queries(query, layer, sliding_window, mask)
    (S, _, D), seq = q.shape, layer.get_seq_length()
    c_pos = torch.arange(layer.c_start, seq, device=query.device)
    parts = []
    for seg in layer.segments():
        K, V, pos, valid = pages.dequantize_segment(seg)  # V in the stored basis, as zone C
        ok = allowed_keys(q_pos, pos, window) & valid.unsqueeze(1)  # [S, G*L, N]
        if m is not None:
            ok = ok & m.gather(2, pos.unsqueeze(1).expand_as(ok))
        parts.append(partial_attention(q, K, V, ok, scaling, softcap))
    kc, vc = (x.float().reshape(S, -1, D) for x in layout.zone_c(layer))
    ok_c = allowed_keys(q_pos, c_pos, window).expand(S, -1, -1)
    if m is not None:
        ok_c = ok_c & m[:, :, layer.c_start : seq]
    parts.append(partial_attention(q, kc, vc, ok_c, scaling, softcap))
    return merge(parts).reshape(query.shape).to(query.dtype)

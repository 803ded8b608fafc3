"""Folding zone C into packed segments, so a long generation grows at the budget's rate, not at fp16's.

Zone C keeps every token appended after compression in 16 bits. Under a :class:`FoldPolicy`, once a
layer's zone C holds ``every + keep`` tokens, its oldest ``every`` tokens are allocated and packed the
way ``compress`` treats a prefill, priced by the RDKV method the cache was compressed with
(:meth:`rdkv.methods.RDKV.fold`): weights from the last ``window`` queries (here decode queries, which the
layer keeps (:func:`rdkv.layout.decode_queries`) and counts in its bytes), one knapsack for the layer whose budget is ``budget`` x
the fp16 bytes of the folded tokens. The newest ``keep`` tokens stay in 16
bits. Each layer folds itself during the decode step that fills its zone C, so every layer folds on the same
step.

Segments of sliding-window layers that no future query can see are dropped: those layers stay bounded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from . import layout
from .dense import attend
from .errors import RDKVError
from .methods import RDKV, Eviction, Prior, Solve, Weights
from .layout import PackSpec, fixed_bytes, fp16_bytes, k_block_bytes
from .trizone import TriZoneLayer, pack_choice


@dataclass(frozen=True)
class FoldPolicy:
    """When and how zone C is folded (see module docstring)."""

    every: int  # tokens folded at once
    budget: float  # bytes of a fold as a fraction of the folded tokens' fp16 bytes
    keep: int = 32  # newest tokens that stay in 16 bits after a fold
    window: int = 16  # decode queries kept to weigh the next fold's tokens
    floor: float = 1.0  # the uniform prior of rdkv.distortion
    method: RDKV = field(default_factory=RDKV)  # what folds price with (compress sets the cache's own RDKV method)

    @classmethod
    def from_dict(cls, d: dict) -> FoldPolicy:
        """The policy ``dataclasses.asdict`` gave (``rdkv.io``)."""
        m = dict(d["method"])
        parts = {"weights": Weights, "prior": Prior, "eviction": Eviction, "solve": Solve, "spec": PackSpec}
        method = RDKV(**{k: parts[k](**v) if k in parts else v for k, v in m.items()})
        return cls(**{**d, "method": method})

    def check(self, layer: TriZoneLayer) -> None:
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise RDKVError(f"fold must be a positive int (fresh tokens per fold), got {self.every!r}")
        if not (isinstance(self.budget, (int, float)) and math.isfinite(self.budget) and 0 < self.budget <= 1):
            raise RDKVError(f"fold budget must be in (0, 1], got {self.budget!r}")
        if self.keep < 0 or self.window < 1 or self.floor < 0:
            raise RDKVError("fold keep must be >= 0, window >= 1 and floor >= 0")
        if not isinstance(self.method, RDKV):
            raise RDKVError(f"a fold prices with an RDKV method, got {type(self.method).__name__}")
        H, D, spec = layer.heads, layer.head_dim, layer.spec
        # counts and permutation, then K channel means only
        least = fixed_bytes(H, D, spec) + H * D // spec.k_block * int(k_block_bytes(spec, torch.zeros(()), spec.k_group)[0])
        room = self.budget * fp16_bytes(self.every, H * D)
        if room < least:
            need = math.ceil(least / (self.budget * fp16_bytes(1, H * D)))
            raise RDKVError(f"a fold of {self.every} tokens at budget {self.budget} has {room:.0f} B per layer, less "
                            f"than the {least} B any packed segment needs: fold at least {need} tokens at a time")


def observe(layer: TriZoneLayer, query: torch.Tensor, scaling: float, softcap: float | None) -> None:
    """After a decode step on ``layer``: remember ``query`` [B, Hq, L, D] and fold if zone C is full."""
    policy = layer.fold
    if policy is None:
        return
    q = query.detach().to(layer.dtype16)
    old = layout.decode_queries(layer)
    layout.set_decode_queries(layer, (q if old is None else torch.cat([old, q], 2))[:, :, -policy.window :])
    if layout.zone_c(layer)[0].shape[2] >= policy.every + policy.keep:
        fold_layer(layer, scaling, softcap)


@torch.no_grad()
def fold_layer(layer: TriZoneLayer, scaling: float, softcap: float | None) -> None:
    """Pack the oldest ``every`` tokens of zone C into a new segment (see module docstring)."""
    policy, spec = layer.fold, layer.spec
    m = replace(policy.method, spec=spec)  # priced as the layer packs
    R = policy.every
    (kc, vc), q = layout.zone_c(layer), layout.decode_queries(layer)
    B, H, n, D = kc.shape
    seq = layer.get_seq_length()
    start, window = layer.c_start, layer.sliding_window
    q_pos = torch.arange(seq - q.shape[2], seq, device=kc.device)
    k_pos = torch.arange(start, seq, device=kc.device)
    _, sums = attend(q, kc, vc, q_pos, k_pos, scaling, window, softcap)
    k, v = kc[:, :, :R].float(), vc[:, :, :R].float()
    alloc = m.fold(k, v, sums, scaling, start + R, policy.floor, [policy.budget * fp16_bytes(R, H * D)] * B)
    seg = pack_choice(k, v, start, alloc.v[0], alloc.k[0], alloc.perm[0], spec, layer.dtype16, window, start + R)
    layout.set_zone_c(seg, None, None)
    layer.folds.append(seg)
    layout.set_zone_c(layer, kc[:, :, R:].clone(), vc[:, :, R:].clone())
    layer.c_start = start + R
    if window is not None:  # positions <= seq - window are invisible to every query from here on
        layer.folds = [f for f in layer.folds if f.prefix_len - 1 > seq - window]

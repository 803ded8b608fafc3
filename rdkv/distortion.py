"""Distortion and byte tables for the allocator, one layer at a time.

Two distortion models:

* ``"output"`` (default): every option is priced as the expected squared error it causes in the
  attention output, summed over the weight queries, so V tokens and K channels share one unit and one
  multiplier means equal marginal returns. With independent errors, a V row error r_t adds
  sum_q p_qt^2 ||r_t||^2. Evicting the token is the same with r_t = v_t - u, where u is the value the
  head's mass moves to once t is gone (``evict_to``, below). A key error
  e_tc shifts score q_c e_tc * scale, which moves the output by p_qt ds_qt (v_t - o), so a K channel
  costs scale^2 * mean(q_c^2) * sum_t m_t ||v_t - o||^2 e_tc^2. Where the weight queries' sums carry each
  key's distance to the outputs that read it (:attr:`rdkv.dense.AttentionSums.drift`, the reconstruction pass's
  with ``k_price="readers"``), their part is sum_q p_qt^2 ||v_t - o_q||^2 instead: a query that copies token t
  already outputs ~v_t, so t's key error barely moves it, though v_t is far from o. Here m_t = sum_q p_qt^2 plus a prior
  per query: the chance that a future query, unlike the prefill's, concentrates on token t (a share
  ``surprisal`` proportional to the token's surprisal, since improbable text is what a later question
  is likely to ask about, plus an optional uniform ``floor / T``). Without it, tokens the prefill
  ignored (a needle, before its question) look free to evict; too much of it spends bytes on text no
  query reads (floor 1 + surprisal 3, the default until 2026-11-29, against floor 0 + surprisal 0.5 on
  SmolLM2: 8k agnostic needle KL at 10% 0.27 vs 0.064, perplexity KL at 25% up to 3.7x higher).
  Errors are measured by quantizing each unit at each width.

  Eviction is the one non-additive option: removing a set E of tokens moves a query's output to the
  mean of what is kept, an error of P_E * (mean kept - mean of E). For a single light token that is
  ~ v_t - o, but when a group of tokens holds most of a head's mass (secondary attention sinks, common
  in SmolLM2's early layers at 8k tokens), o is that group's own value, so ``evict_to="output"`` prices
  each member as free, and evicting the group together sends the output to the mean of the rest
  (one 8k probe at a 25% budget: KL 0.61 with 4% of tokens evicted, 0.0085 with eviction off;
  ``scripts/diag_eviction.py``).
  ``evict_to`` chooses u:

  - ``"heavy"`` (default): ``"max"`` for tokens holding more than ``HEAVY`` times the head's mean
    weight, the only ones that can make up a dominant group; ``"output"`` for the rest;
  - ``"output"``: o, the window queries' weighted mean value (the default until 2026-11-29);
  - ``"mean"``: the plain mean value of the layer, what a query falls back on;
  - ``"max"``: the larger error of the two;
  - ``"kept"``: o in the first allocation pass, then the weighted mean of the tokens the previous pass
    kept; costs only rise from pass to pass (:mod:`rdkv.solvers.allocate`); ``cache.distortion``
    still reports the first pass's prices.
  The additive price of any ``evict_to`` still misses the cross terms of evicting many tokens at once:
  the error of evicting a set E is ||sum_{s in E} p_qs (v_s - o_q)||^2 / (1 - P_q)^2, and the tokens a head
  ignores mostly sit on one side of what it reads, so their errors add up coherently. ``evict_jointly``
  (:func:`eviction_cross`, :func:`joint_reprice`) re-prices each token, pass by pass, at its exact
  marginal error given the set the previous pass evicted, over the window queries.
* ``"paper"``: RDKV's w * sigma * 2^-b for both, with w = sum_q p_qt for tokens and
  ||Q_c|| ||K_c|| / sqrt(d) for channels, each on its own scale.

Bytes are the exact bytes each option adds to the packed cache (see :mod:`rdkv.trizone`).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from . import quant
from .dense import CHUNK_ELEMENTS, AttentionSums, allowed_keys
from .errors import RDKVError
from .layout import PackSpec, fixed_bytes, k_block_bytes, v_row_bytes
from .pages import page_tokens
from .trizone import TriZoneCache
from .weights import channel_weights, token_weights

MODELS = ("output", "paper")
EVICT_TO = ("heavy", "output", "mean", "max", "kept")
HEAVY = 10.0  # weight, in multiples of the head's mean token weight, above which a token counts as heavy
W = torch.tensor(quant.WIDTHS, dtype=torch.float32)


@dataclass(frozen=True)
class LayerTables:
    """Allocation inputs for one layer, built once by :func:`layer_tables`: units are V tokens [B, H, T] and
    K channel blocks [B, H, nb]."""

    dv: torch.Tensor  # [B, H, T, 5] distortion of each V width
    rv: torch.Tensor  # [5] bytes of one V row (codes, scales, zeros, position) per width
    present: torch.Tensor  # [B, H, T] bool: tokens in the cache (not padding, inside the window)
    dk: torch.Tensor  # [B, H, nb, 5] distortion of each K width per block
    perm: torch.Tensor  # [B, H, D] channel order; block j = perm[..., j*kb:(j+1)*kb]
    spec: PackSpec
    page: int  # tokens per page (rdkv.pages.page_tokens): one K scale group, the unit V classes are stored in
    fixed: int  # bytes per sequence independent of the allocation (counts, permutation, block widths)
    nq: torch.Tensor  # [B] weight queries the distortion is summed over
    protect: torch.Tensor  # [B, H, T] bool: tokens that may not be evicted (sinks, the recent window)
    # eviction cost [H, T] of sequence b's tokens once a pass has kept ``kept`` [H, T]; each allocation
    # pass raises dv[..., 0] to it (evict_to="kept", evict_jointly); None = eviction is priced once
    reprice: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    # [B, H, T] the largest attention any reconstruction query paid each token (rdkv.reconstruct), None for
    # other weights: what split="peak" ranks the tokens of every layer by (rdkv.solvers.allocate.layer_budgets)
    peak: torch.Tensor | None = None
    # [B, H, T] the tokens protected as the end of a sliding window (rdkv.methods.Eviction.window_end), None where
    # the layer holds none: held with every K block at 2 bits or more where they fit (rdkv.solvers.allocate.ENDS_SHARE)
    ends: torch.Tensor | None = None

    @property
    def k_least(self) -> int:
        """The lowest K option every block keeps, which the solver charges each kept token for
        (:mod:`rdkv.solvers.allocate`): 1 (2 bits) while the layer holds its window's end, else 0 (channel means)."""
        return int(self.ends is not None)

    def rk(self, n: torch.Tensor) -> torch.Tensor:
        """Bytes of one K block at each width when its stream keeps ``n`` tokens: [..., 5]."""
        return k_block_bytes(self.spec, n, self.page)


def _v_errors(v: torch.Tensor, ref: torch.Tensor, spec: PackSpec) -> torch.Tensor:
    """||v_t - Q_b(v_t)||^2 per width [B, H, T, 5]; width 0 (eviction) is the distance to ``ref`` [B, H, 1, D]."""
    errs = [(v - ref).square().sum(-1)]
    for b in quant.PACKED:
        g = v.unflatten(-1, (-1, spec.v_group_of(b)))
        errs.append((g - quant.fake_quantize(g, b)).square().sum((-1, -2)))
    errs.append((v - v.half().float()).square().sum(-1))
    return torch.stack(errs, -1)


def _mean(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Mean value row [..., 1, D] of v [..., T, D] under token weights w [..., T]."""
    return (w.unsqueeze(-1) * v).sum(-2, keepdim=True) / w.sum(-1, keepdim=True).unsqueeze(-1).clamp_min(1e-30)


def _k_errors(k: torch.Tensor, m: torch.Tensor, present: torch.Tensor, group: int) -> torch.Tensor:
    """sum_t m_t e_tc(b)^2 per channel and width [B, H, D, 5] (groups of ``group`` tokens per channel)."""
    B, H, T, D = k.shape
    kc = k.transpose(-1, -2)  # [B, H, D, T]
    n = present.sum(-1, keepdim=True).clamp_min(1).unsqueeze(-2)
    mean = (kc * present.unsqueeze(-2)).sum(-1, keepdim=True) / n
    kc = torch.where(present.unsqueeze(-2), kc, mean)  # padding must not widen any group's range
    pad = (-T) % group
    kp = torch.cat([kc, kc[..., -1:].expand(B, H, D, pad)], -1) if pad else kc
    g = kp.unflatten(-1, (-1, group))
    errs = [(kc - mean).square()]
    for b in quant.PACKED:
        errs.append((g - quant.fake_quantize(g, b)).square().flatten(-2)[..., :T])
    errs.append((kc - kc.half().float()).square())
    return torch.stack([(e * m.unsqueeze(-2)).sum(-1) for e in errs], -1)


@dataclass(frozen=True)
class JointEviction:
    """The queries that price evicting a set of tokens together (``evict_jointly``, :func:`eviction_cross`):
    q [B, Hq, L, D] at ``q_pos``, over the keys as they saw them [B, H, T, D] at ``k_pos``."""

    q: torch.Tensor
    keys: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    window: int | None = None
    softcap: float | None = None


def layer_tables(k: torch.Tensor, v: torch.Tensor, present: torch.Tensor, sums: AttentionSums, scaling: float,
                 spec: PackSpec, end: int, model: str = "output", prior: torch.Tensor | float | None = None,
                 evict_to: str = "heavy", q_floor: float = 0.0, *, protect: torch.Tensor | None = None,
                 prerope: bool = False, gain: float = 1.0, joint: JointEviction | None = None) -> LayerTables:
    """Tables for one layer from its cached k, v [B, H, T, D] (any float dtype, absolute positions up to ``end``).

    ``prior`` [B, 1|H, T] is the squared attention a future query is expected to put on each token,
    per query, beyond what the prefill's queries did (the uniform ``floor`` plus optional surprisal).
    ``evict_to`` is the value an evicted token's error is measured from (:data:`EVICT_TO`).
    ``q_floor`` is the prior's twin for K channels: that fraction of each channel's squared query weight
    is replaced by the mean over channels, so a channel the weight queries barely used still costs
    something to quantize coarsely (a later query may use it).
    ``protect`` [B, H, T] marks tokens that may not be evicted (none by default); ``prerope``: the keys are
    packed before RoPE, with the layer's rotary table (:func:`rdkv.layout.fixed_bytes`); ``gain`` scales every
    distortion (a layer's weight in a global knapsack); ``joint`` re-prices eviction from the set a pass
    evicts (:func:`joint_reprice`).
    """
    if model not in MODELS:
        raise RDKVError(f"unknown distortion model {model!r}; choose one of {MODELS}")
    if evict_to not in EVICT_TO:
        raise RDKVError(f"unknown evict_to {evict_to!r}; choose one of {EVICT_TO}")
    B, H, T, D = k.shape
    page = page_tokens(D, spec, T)
    held_v = v  # what the re-pricing closures keep: the cache's own tensor, not a float32 copy of it
    k, v = k.float(), v.float()
    w = token_weights(sums) * present
    if model == "output":
        nq = sums.nq.clamp_min(1).view(B, 1, 1)
        m = (sums.mass2 + (0 if prior is None else nq * prior)) * present
        out = _mean(v, w)  # the weight queries' mean output
        drift = (v - out).square().sum(-1)  # ||v_t - o||^2, what evicting a light token and the prior's keys cost
        # a key error costs the weight queries their own distances where measured: sum_q p_qt^2 ||v_t - o_q||^2
        read = drift if sums.drift is None else torch.where(sums.drift.isnan(), drift, sums.drift)
        kw = (sums.mass2 * read + (0 if prior is None else nq * prior * drift)) * present
        ev = _v_errors(v, out if evict_to in ("output", "kept") else _mean(v, present.float()), spec)
        if evict_to in ("max", "heavy"):
            to_mean = torch.maximum(ev[..., 0], drift)
            if evict_to == "heavy":
                heavy = w > HEAVY * w.sum(-1, keepdim=True) / present.sum(-1, keepdim=True).clamp_min(1)
                to_mean = torch.where(heavy, to_mean, drift)
            ev[..., 0] = to_mean
        dv = m.unsqueeze(-1) * ev
        q2 = sums.q2 / nq
        if q_floor:
            q2 = (1 - q_floor) * q2 + q_floor * q2.mean(-1, keepdim=True)
        dkc = scaling**2 * q2.unsqueeze(-1) * _k_errors(k, kw, present, page)
    else:
        halving = 2.0 ** -W.clamp_min(0).to(k.device)
        halving[0] = 1.0
        dv = (w * v.std(-1, correction=0)).unsqueeze(-1) * halving
        kk = k * present.unsqueeze(-1)
        dkc = (channel_weights(sums, kk) * kk.std(-2, correction=0)).unsqueeze(-1) * halving
    perm = dkc[..., 1].argsort(-1, descending=True)  # group channels of similar 2-bit sensitivity
    dk = dkc.gather(2, perm.unsqueeze(-1).expand_as(dkc)).unflatten(2, (-1, spec.k_block)).sum(3)
    dv, dk = dv * gain, dk * gain
    reprice = None
    if model == "output" and evict_to == "kept":  # where a head's mass goes once the others are evicted
        def reprice(b: int, kept: torch.Tensor) -> torch.Tensor:
            vb = held_v[b].float()
            return gain * m[b] * (vb - _mean(vb, w[b] * kept)).square().sum(-1)
    elif joint is not None:
        reprice = joint_reprice(dv[..., 0], present, sums.nq, joint, held_v, scaling)
    protect = torch.zeros_like(present) if protect is None else protect & present
    return LayerTables(dv, v_row_bytes(spec, D, end), present, dk, perm, spec, page,
                       fixed_bytes(H, D, spec, prerope), sums.nq, protect, reprice, sums.peak)


def eviction_cross(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   scaling: float, window: int | None, softcap: float | None, present: torch.Tensor,
                   evicted: torch.Tensor) -> torch.Tensor:
    """What evicting each token costs on top of its additive price, given the others evicted [H, T].

    Evicting a set E moves query q's output by exactly e_q / (1 - P_q), with e_q = sum_{s in E} p_qs (v_s - o_q)
    and P_q the mass on E, so the error is ||e_q||^2 / (1 - P_q)^2; the additive price keeps only the
    diagonal sum_s p_qs^2 ||v_s - o_q||^2. Returned per token t: the exact change of that error between E
    with t and E without t, minus t's own diagonal term, summed over the queries q [Hq, L, D] (keys k and
    values v [H, T, D] at ``k_pos``; ``present`` and ``evicted`` [H, T]). When the evicted tokens' values
    lean the same way from the output (they are mostly the many tokens far from what a head attends to)
    this is many times the additive price: on Gemma 3 prose at a 25% budget, evicting the allocation's set
    together cost 6-19x the sum of its parts in layers 0, 1 and 3 (``scripts/diag_joint.py``).
    """
    H, T, _ = k.shape
    G, L = q.shape[0] // H, q.shape[1]
    kf, vf = k.float(), v.float()
    out = kf.new_zeros(H, T)
    ev = evicted.float()[:, None, None, :]
    # about ten [H, G, chunk, T] temporaries live at once: an eighth of attend's chunk keeps them near 80 MB
    chunk = max(1, CHUNK_ELEMENTS // 8 // max(1, q.shape[0] * T))
    for a in range(0, L, chunk):
        qc = q[:, a : a + chunk].float().unflatten(0, (H, G))  # [H, G, c, D]
        s = torch.einsum("hgqd,htd->hgqt", qc, kf) * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        ok = allowed_keys(q_pos[a : a + chunk], k_pos, window)[None, None] & present[:, None, None, :]
        p = s.masked_fill(~ok, float("-inf")).softmax(-1).nan_to_num(0.0)
        o = torch.einsum("hgqt,htd->hgqd", p, vf)
        mass = (p * ev).sum(-1, keepdim=True)  # P_q [H, G, c, 1]
        e = torch.einsum("hgqt,htd->hgqd", p * ev, vf) - mass * o
        dot = torch.einsum("hgqd,htd->hgqt", e, vf) - (e * o).sum(-1, keepdim=True)  # <e_q, v_t - o_q>
        drift = (vf.square().sum(-1)[:, None, None, :] - 2 * torch.einsum("hgqd,htd->hgqt", o, vf)
                 + o.square().sum(-1, keepdim=True))  # ||v_t - o_q||^2
        # E without t: remove t's own term where t is evicted
        e2 = e.square().sum(-1, keepdim=True) - ev * p * (2 * dot - p * drift)  # ||e'||^2
        dot = dot - ev * p * drift  # <e', v_t - o_q>
        rest = mass - ev * p  # P'
        with_t = (e2 + 2 * p * dot + p.square() * drift) / (1 - rest - p).clamp_min(1e-3).square()
        without = e2 / (1 - rest).clamp_min(1e-3).square()
        out += (with_t - without - p.square() * drift).sum((1, 2))
    return out


def joint_reprice(evict: torch.Tensor, present: torch.Tensor, nq: torch.Tensor, joint: JointEviction, v: torch.Tensor,
                  scaling: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """The re-pricing of ``evict_jointly``: once a pass has chosen what to keep, a token's eviction costs its
    own price ``evict`` [B, H, T] plus its share of the cross terms of evicting the rest together
    (:func:`eviction_cross`, never negative here) over the queries of ``joint``, scaled to ``nq`` weight
    queries."""
    j = joint
    scale = nq / (j.q.shape[1] * j.q.shape[2])

    def reprice(b: int, kept: torch.Tensor) -> torch.Tensor:
        cross = eviction_cross(j.q[b], j.keys[b], v[b], j.q_pos, j.k_pos, scaling, j.window, j.softcap, present[b],
                               present[b] & ~kept)
        return evict[b] + float(scale[b]) * cross.clamp_min(0)
    return reprice


# --- the solver objective of an allocation ------------------------------------------------------------
def layer_distortion(tables: list, v_opt: list[torch.Tensor], k_opt: list[torch.Tensor]) -> list[float]:
    """Each layer's solver distortion for the chosen widths, per weight query, averaged over sequences."""
    out = []
    for t, vo, ko in zip(tables, v_opt, k_opt):
        dv = t.dv.gather(-1, vo.unsqueeze(-1)).squeeze(-1).masked_fill(~t.present, 0.0)
        dk = t.dk.gather(-1, ko.unsqueeze(-1)).squeeze(-1)
        out.append(float((dv.sum((1, 2)) + dk.sum((1, 2))).div(t.nq.clamp_min(1)).mean()))
    return out


def modelled_distortion(tables: list, v_opt: list[torch.Tensor], k_opt: list[torch.Tensor]) -> float:
    """Sum over layers of the solver's distortion for the chosen widths, per weight query and sequence."""
    return sum(layer_distortion(tables, v_opt, k_opt))


def cache_options(cache: TriZoneCache, tables) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Option indices of a compressed cache's widths, in the tables' units (positions, channel blocks)."""
    v_opt, k_opt = [], []
    for i, (layer, t) in enumerate(zip(cache.layers, tables)):
        vw = layer.v_widths().to(t.dv.device)
        if vw.shape != t.present.shape:
            raise RDKVError(f"layer {i}: the cache holds {tuple(vw.shape)} positions, the last prefill "
                            f"{tuple(t.present.shape)}: pass a cache compressed from the model's last prefill")
        kw = layer.k_widths().to(t.dk.device).gather(-1, t.perm).unflatten(-1, (-1, t.spec.k_block))
        if (kw != kw[..., :1]).any():
            raise RDKVError(f"layer {i}: the cache's K blocks are not the allocator's blocks (a baseline, or another "
                            "prefill); its modelled distortion is not defined")
        v_opt.append(quant.option_of(vw))
        k_opt.append(quant.option_of(kw[..., 0]))
    return v_opt, k_opt


@dataclass(frozen=True)
class Calibration:
    """KL ~= a * D^p, fitted on (modelled distortion, measured KL) pairs of one model."""

    a: float
    p: float
    points: tuple[tuple[float, float], ...]  # (D, KL) the fit used
    method: str = "rdkv"  # the compress method it was fitted for
    key: object = None  # the method (rdkv.methods.Method) it was fitted for, options applied; compress(error=) must match it

    def predict(self, distortion: float) -> float:
        return self.a * distortion**self.p if distortion > 0 else 0.0

    def distortion_for(self, kl: float) -> float:
        """The largest modelled distortion whose predicted KL is ``kl``, but never beyond the most distorted
        calibration point: the fit is not extrapolated to allocations coarser than any it has seen."""
        return min((kl / self.a) ** (1 / self.p), max(d for d, _ in self.points))

"""Every method is an allocation: widths per V token and per K block, fed to the same packer.

So bytes are counted one way (what the TriZone tensors hold) and decode is shared. RDKV variants
are presets of :class:`~rdkv.api.CompressConfig`; baselines are small functions that pick widths:

* quantization: ``int8``/``int4`` (every token and channel at one width), ``kivi2``/``kivi4``
  (KIVI-style: K per channel and V per token in groups of 32, the last 128 tokens' V in fp16; the
  TriZone format has no per-token K precision, so those tokens' keys stay quantized -- a deviation
  from KIVI that can only hurt the baseline, recorded here and in the results);
* eviction (kept tokens in fp16, the rest dropped, ragged per head so savings are real):
  ``streaming`` (4 sinks + recent window), ``snapkv`` (last-64-query attention, pooled, same count per
  head, the observation window always kept), ``adakv`` (SnapKV scores, one top-k over all heads of a
  layer, each head keeping at least a fifth of the uniform share), ``knorm`` (lowest key norm).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import quant
from .solvers.mckp import Infeasible
from .trizone import fp16_token_bytes

RDKV_VARIANTS: dict[str, dict] = {
    "rdkv": {},
    "rdkv-all": {"weights": "all"},  # needs rdkv.record(model, all_queries=True)
    "rdkv-global": {"scope": "global"},
    "rdkv-pool": {"pool_weights": 7},  # SnapKV-style pooled weights: better when the question is in the prompt
    # the question is in the prompt (query-aware): weigh only what its window asked for, no reserve for
    # later questions (no floor, no surprisal prior)
    "rdkv-aware": {"pool_weights": 7, "floor": 0.0, "surprisal": 0.0},
    # weights from all 256 recorded queries instead of the last 64: better on Gemma 3 query-agnostic (1k), worse
    # on SmolLM2 at 2k-4k below 25% and on query-aware prompts (docs/experiments.md, 2026-11-29/30)
    "rdkv-w256": {"window": 256},
    "rdkv-wsl256": {"window_sliding": 256},  # all 256 queries for sliding-window layers only (Gemma 3's local ones)
    "rdkv-wgl256": {"window": 256, "window_sliding": 64},  # all 256 for global layers only (= rdkv-w256 without local layers)
    # window weights per window query that can see each token, so the prefill's last tokens are not under-weighted:
    # better at 25% and on Gemma 3's agnostic needle, worse at 5% (docs/experiments.md)
    "rdkv-visible": {"visible": 1.0},
    # both: on Gemma 3 at 10% every needle the full cache answers, at every depth, in both protocols (1k, 15 probes)
    "rdkv-visible-wgl256": {"visible": 1.0, "window": 256, "window_sliding": 64},
    # and sliding-layer tokens priced by how long a 512-token decode keeps them visible (rdkv.weights.lifetime)
    "rdkv-hybrid": {"visible": 1.0, "window": 256, "window_sliding": 64, "horizon": 512},
    "rdkv-1pass": {"passes": 1},
    "rdkv-v0": {"scope": "global", "passes": 1},  # the first default: one knapsack, K priced for every token
    "rdkv-noprotect": {"sinks": 0, "recent": 0},
    "rdkv-noevict": {"evict": False},
    "rdkv-noprior": {"surprisal": 0.0},  # no reserve for unseen questions at all
    "rdkv-qfloor": {"q_floor": 0.5},  # half of each K channel's query weight from the channel mean (worse on Gemma 3)
    "rdkv-floor": {"floor": 1.0, "surprisal": 3.0},  # the prior before 2026-11-29 (uniform floor, surprisal 3)
    "rdkv-prerope": {"prerope": True},  # KVQuant's pre-RoPE keys, rotated back at decode
    # where an evicted token's mass is assumed to go (rdkv.distortion.EVICT_TO; the default is "heavy")
    "rdkv-evict-output": {"evict_to": "output"},  # the default until the 8k regression was traced to it
    "rdkv-evict-mean": {"evict_to": "mean"},
    "rdkv-evict-max": {"evict_to": "max"},
    "rdkv-evict-kept": {"evict_to": "kept"},
    "rdkv-joint": {"evict_jointly": True},  # evicting a set costs its cross terms too (rdkv.distortion.eviction_cross)
    "rdkv-paper": {"distortion": "paper", "weights": "all", "floor": 0.0, "surprisal": 0.0, "sinks": 0, "recent": 0},
}


@dataclass
class LayerInput:
    """What a method may look at for one layer (positions start..end-1 of the held cache)."""

    k: torch.Tensor  # [B, H, T, D] float32
    present: torch.Tensor  # [B, H, T] bool
    window_mass: torch.Tensor  # [B, H, T] attention from the last SNAP_WINDOW prefill queries
    start: int
    end: int


Allocation = tuple[list[torch.Tensor], list[torch.Tensor]]
SNAP_WINDOW = 64  # SnapKV's observation window: the baselines' window_mass is over the last 64 prefill queries


def _uniform(v_width: int, k_width: int, recent: int = 0) -> Callable:
    def allocate(layers: list[LayerInput], budgets: list[float], fixed: list[int], kb: int) -> Allocation:
        v, k = [], []
        for L in layers:
            pos = torch.arange(L.start, L.end, device=L.k.device)
            w = torch.where(pos >= L.end - recent, quant.OPTION[16], quant.OPTION[v_width]).expand_as(L.present)
            v.append(torch.where(L.present, w, quant.OPTION[0]))
            k.append(torch.full((*L.present.shape[:2], L.k.shape[-1] // kb), quant.OPTION[k_width], device=L.k.device))
        return v, k
    return allocate


def _keep_count(layers: list[LayerInput], budgets: list[float], fixed: list[int], kb: int) -> list[int]:
    """Tokens each (layer, head) of sequence b may keep in fp16 (V row + position + K row)."""
    per_token = fp16_token_bytes(layers[0].k.shape[-1], layers[0].end)
    heads = sum(L.present.shape[1] for L in layers)
    if any(budget < f for budget, f in zip(budgets, fixed)):
        raise Infeasible(f"the per-head metadata alone takes {max(fixed)} bytes")
    return [int((budget - f) // (per_token * heads)) for budget, f in zip(budgets, fixed)]


def _evict(score_fn: Callable, adaptive: bool = False, window: int = 0) -> Callable:
    def allocate(layers: list[LayerInput], budgets: list[float], fixed: list[int], kb: int) -> Allocation:
        counts = _keep_count(layers, budgets, fixed, kb)
        v, k = [], []
        for L in layers:
            B, H, T = L.present.shape
            score = score_fn(L).masked_fill(~L.present, float("-inf"))
            if window:  # the observation window is always kept
                score[..., max(0, T - window) :] = float("inf")
            keep = torch.zeros(B, H, T, dtype=torch.bool, device=score.device)
            for b in range(B):
                c = min(counts[b], T)
                if adaptive:  # one top-k over the layer's heads, each head guaranteed a fifth of its share
                    floor = c // 5
                    keep[b].scatter_(-1, score[b].topk(floor, -1).indices, True)
                    rest = score[b].masked_fill(keep[b], float("-inf")).flatten()
                    n = min(c * H - floor * H, int((rest > float("-inf")).sum()))
                    keep[b].view(-1)[rest.topk(n).indices] = True
                else:
                    keep[b].scatter_(-1, score[b].topk(c, -1).indices, True)
            keep &= L.present
            v.append(torch.where(keep, quant.OPTION[16], quant.OPTION[0]))
            k.append(torch.full((B, H, L.k.shape[-1] // kb), quant.OPTION[16], device=score.device))
        return v, k
    return allocate


def _snap(L: LayerInput) -> torch.Tensor:
    return F.avg_pool1d(L.window_mass.flatten(0, 1).unsqueeze(1), 7, 1, 3, count_include_pad=False).view_as(L.window_mass)


def _recent(L: LayerInput) -> torch.Tensor:
    pos = torch.arange(L.start, L.end, device=L.k.device, dtype=torch.float32)
    rel = pos - (L.present.cumsum(-1) == 0).sum(-1, keepdim=True)  # sinks count from the first real token
    return torch.where(rel < 4, float(L.end), pos).expand_as(L.present).clone()


BASELINES: dict[str, Callable] = {
    "int8": _uniform(8, 8),
    "int4": _uniform(4, 4),
    "kivi4": _uniform(4, 4, recent=128),
    "kivi2": _uniform(2, 2, recent=128),
    "streaming": _evict(_recent),
    "snapkv": _evict(_snap, window=SNAP_WINDOW),
    "adakv": _evict(_snap, adaptive=True, window=SNAP_WINDOW),
    "knorm": _evict(lambda L: -L.k.norm(dim=-1)),
}
# group sizes the quantization baselines are defined with (KIVI: 32 tokens / 32 channels)
BASELINE_SPECS: dict[str, dict] = {"kivi2": {"v_group": 32, "k_group": 32}, "kivi4": {"v_group": 32, "k_group": 32}}
FIXED_RATE = {"int8", "int4", "kivi4", "kivi2"}
# compress's default: the RDKV preset for the model's attention layout (rdkv.api.resolve_method)
AUTO = "auto"
METHODS = (AUTO,) + tuple(RDKV_VARIANTS) + tuple(BASELINES)

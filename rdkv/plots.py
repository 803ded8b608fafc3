"""Figures of what a compressed cache decided, so a person can check RDKV before trusting it.

Every function returns a :class:`matplotlib.figure.Figure` built without pyplot, so nothing is shown
twice in a notebook and no global figure state leaks; display it, or call ``fig.savefig(path)``.
matplotlib is an optional dependency (``pip install .[notebooks]``) and is imported only here, lazily.

Width codes used throughout: 0 = evicted, 2/4/8/16 = bits per value, -1 (:data:`NOT_HELD`) = a position
the layer never held (outside a sliding window), shown blank.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

import torch

from . import layout, pages, pipeline, quant
from .distortion import cache_options, modelled_distortion as objective
from .errors import RDKVError
from .methods import Method
from .report import COMPONENTS, layer_components
from .solvers.mckp import Infeasible
from .trizone import TriZoneCache

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NOT_HELD = -1
WIDTH_COLORS = {NOT_HELD: "#ffffff", 0: "#b2182b", 2: "#c6dbef", 4: "#6baed6", 8: "#2171b5", 16: "#08306b"}
ZONE_COLORS = ("#6baed6", "#08306b", "#fdae6b")
COMPONENT_COLORS = dict(zip(COMPONENTS, ("#4292c6", "#9ecae1", "#c6dbef", "#08306b", "#969696", "#fdae6b")))


def _figure(**kwargs) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise RDKVError("rdkv.plots needs matplotlib: pip install .[notebooks]  (or pip install matplotlib)") from e
    return Figure(layout="constrained", **kwargs)


def _width_cmap():
    from matplotlib.colors import BoundaryNorm, ListedColormap

    codes = sorted(WIDTH_COLORS)  # -1, 0, 2, 4, 8, 16
    bounds = [codes[0] - 0.5] + [(a + b) / 2 for a, b in zip(codes, codes[1:])] + [codes[-1] + 0.5]
    return ListedColormap([WIDTH_COLORS[c] for c in codes]), BoundaryNorm(bounds, len(codes))


def _legend(ax, widths: Sequence[int] = (0, 2, 4, 8, 16), evicted: str = "evicted", **kwargs) -> None:
    from matplotlib.patches import Patch

    names = {0: evicted, 16: "16 bit (fp16)"}
    ax.legend(handles=[Patch(facecolor=WIDTH_COLORS[w], edgecolor="#444444", label=names.get(w, f"{w} bit"))
                       for w in widths], **kwargs)


def _check_index(name: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise RDKVError(f"{name}={value} is out of range: the cache has {size}")


# --- data behind the figures ------------------------------------------------------------------------

def v_width_grid(cache: TriZoneCache, seq: int = 0) -> torch.Tensor:
    """V width of every prefix position, per layer and KV head: [layers, heads, prefix_len].

    0 = evicted, -1 = never held by that layer (outside its sliding window).
    """
    _check_index("seq", seq, cache.layers[0].batch)
    T = max(layer.prefix_len for layer in cache.layers)
    H = max(layer.heads for layer in cache.layers)
    out = torch.full((len(cache.layers), H, T), NOT_HELD, dtype=torch.long)
    for i, layer in enumerate(cache.layers):
        out[i, : layer.heads, layer.start : layer.prefix_len] = layer.v_widths()[seq].cpu()
    return out


def k_width_grid(cache: TriZoneCache, seq: int = 0) -> torch.Tensor:
    """K width of every channel (model channel order), per layer and KV head: [layers, heads, head_dim]."""
    _check_index("seq", seq, cache.layers[0].batch)
    D = max(layer.head_dim for layer in cache.layers)
    H = max(layer.heads for layer in cache.layers)
    out = torch.full((len(cache.layers), H, D), NOT_HELD, dtype=torch.long)
    for i, layer in enumerate(cache.layers):
        out[i, : layer.heads, : layer.head_dim] = layer.k_widths()[seq].cpu()
    return out


# --- figures ------------------------------------------------------------------------------------------

def _heatmap(grid: torch.Tensor, head: int, xlabel: str, title: str, evicted: str, figsize) -> Figure:
    _check_index("head", head, grid.shape[1])
    cmap, norm = _width_cmap()
    fig = _figure(figsize=figsize)
    ax = fig.add_subplot()
    ax.imshow(grid[:, head].numpy(), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, origin="lower")
    ax.set(xlabel=xlabel, ylabel="layer", title=title)
    _legend(ax, evicted=evicted, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


def v_width_heatmap(cache: TriZoneCache, head: int = 0, seq: int = 0) -> Figure:
    """Layers x positions, colored by V width: shows where eviction and low precision land, e.g. whether
    the sinks and the recent window survive and which layers get the bytes."""
    return _heatmap(v_width_grid(cache, seq), head, "token position",
                    f"V width per token (KV head {head}, sequence {seq}; budget {cache.budget})", "evicted", (11, 4))


def k_width_heatmap(cache: TriZoneCache, head: int = 0, seq: int = 0) -> Figure:
    """Layers x channels, colored by K width: the outlier channels that get 8 or 16 bits (K is quantized
    per channel, so a few large channels decide most of the K error)."""
    return _heatmap(k_width_grid(cache, seq), head, "K channel (model order)",
                    f"K width per channel (KV head {head}, sequence {seq}; budget {cache.budget})",
                    "0 bit (channel mean)", (9, 4))


def _token_text(tokenizer: Any, token_id: int) -> str:
    text = tokenizer.decode([token_id])
    return text.replace("\n", "\\n").replace("\t", "\\t").replace("$", r"\$") or "\u2205"


def locate(tokenizer: Any, input_ids: torch.Tensor | Sequence[int], text: str) -> int:
    """Index of the token where ``text`` starts in the decoded ``input_ids`` (e.g. the needle), to pass
    as ``around`` to :func:`token_widths`."""
    ids = torch.as_tensor(input_ids).reshape(-1).tolist()
    ends, pos = [], 0
    for tid in ids:
        pos += len(tokenizer.decode([tid]))
        ends.append(pos)
    at = "".join(tokenizer.decode([tid]) for tid in ids).find(text)
    if at < 0:
        raise RDKVError(f"{text!r} does not occur in the decoded tokens")
    return next(i for i, end in enumerate(ends) if end > at)


def token_widths(cache: TriZoneCache, tokenizer: Any, input_ids: torch.Tensor | Sequence[int],
                 layer: int | None = None, head: int | None = None, around: int | None = None,
                 window: int = 40, seq: int = 0) -> Figure:
    """Which tokens (as text) were dropped, and which kept at 2/4/8/16 bits.

    With ``layer`` and ``head`` both given, one bar per token shows that stream's V width (evicted
    tokens are a red cross and a red label). Otherwise the bars stack, per token, the share of the
    selected (layer, head) streams holding it at each width (evicted at the bottom; a red label when
    most streams evicted it): such a token is one the model can no longer read well. ``around`` centres a
    ``window`` of tokens on a position (e.g. :func:`locate` of the needle; a dotted line marks where it
    starts and its label is bold); ``None`` shows every token.
    ``input_ids`` are the prefill's ids of sequence ``seq`` (or the whole [batch, T] tensor).
    """
    ids = torch.as_tensor(input_ids)
    ids = (ids[seq] if ids.ndim == 2 else ids).tolist()
    grid = v_width_grid(cache, seq)  # [L, H, T]
    if len(ids) != grid.shape[-1]:
        raise RDKVError(f"input_ids has {len(ids)} tokens, the cache's prefix {grid.shape[-1]}: pass the prefill's ids")
    if layer is not None:
        _check_index("layer", layer, grid.shape[0])
        grid = grid[layer : layer + 1]
    if head is not None:
        _check_index("head", head, grid.shape[1])
        grid = grid[:, head : head + 1]
    lo, hi = 0, len(ids)
    if around is not None:
        _check_index("around", around, len(ids))
        if window < 1:
            raise RDKVError(f"window={window} must be a positive number of tokens")
        lo = max(0, min(around - window // 2, len(ids) - window))
        hi = min(len(ids), lo + window)
    grid = grid[..., lo:hi].flatten(0, 1)  # [streams, n]
    x = list(range(lo, hi))
    labels = [_token_text(tokenizer, t) for t in ids[lo:hi]]
    fig = _figure(figsize=(max(6.0, 0.24 * len(x) + 2), 4))
    ax = fig.add_subplot()
    where = f"layer {layer}" if layer is not None else "all layers"
    where += f", KV head {head}" if head is not None else ", all KV heads"
    if grid.shape[0] == 1:
        w = grid[0]
        ax.bar(x, w.clamp_min(0).tolist(), width=0.85, color=[WIDTH_COLORS[int(v)] for v in w])
        gone = [i for i, v in zip(x, w.tolist()) if v == 0]
        ax.plot(gone, [0.5] * len(gone), "x", color=WIDTH_COLORS[0], markersize=6, label="evicted")
        ax.set(ylabel="V width (bits)", yticks=[0, 2, 4, 8, 16], ylim=(0, 17))
        red = [v == 0 for v in w.tolist()]
        title = f"V width per token ({where}; budget {cache.budget})"
    else:
        held = (grid >= 0).sum(0).clamp_min(1).float()
        bottom = torch.zeros(len(x))
        for wd in quant.WIDTHS:
            share = (grid == wd).sum(0) / held
            ax.bar(x, share.tolist(), width=0.85, bottom=bottom.tolist(), color=WIDTH_COLORS[wd])
            bottom += share
        mean = (grid.clamp_min(0).sum(0) / held)
        red = ((grid == 0).sum(0) / held > 0.5).tolist()
        ax.set(ylabel="share of streams", ylim=(0, 1))
        title = (f"V width per token, budget {cache.budget}: share of (layer, head) streams at each width "
                 f"({where}); mean {float(mean.mean()):.1f} bits over the window")
    ax.set_xticks(x, labels, rotation=90, fontsize="small", fontfamily="monospace")
    for i, tick, r in zip(x, ax.get_xticklabels(), red):
        if r:
            tick.set_color(WIDTH_COLORS[0])
        if i == around:
            tick.set_fontweight("bold")
    ax.set_xlim(lo - 0.6, hi - 0.4)
    if around is not None:
        ax.axvline(around - 0.5, color="#333333", linestyle=":", linewidth=1.2, zorder=3)
    ax.set_title(title, fontsize="medium")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


def zone_sizes(cache: TriZoneCache) -> Figure:
    """Per layer: rows and bytes of zone A (packed: 2/4/8-bit V rows, all K, indices), zone B (16-bit V
    rows) and zone C (tokens appended since compression), to see where each layer's bytes went."""
    names = ("zone A (packed)", "zone B (16-bit V)", "zone C (fresh)")
    rows, nbytes = [], []
    for layer in cache.layers:
        counts = layout.counts(layer).long().sum(0).tolist()  # per V class, over streams
        kc, _ = layout.zone_c(layer)
        rows.append((sum(counts[:3]), counts[3], kc.shape[0] * kc.shape[1] * kc.shape[2]))
        nbytes.append(pages.zone_bytes(layer))
    fig = _figure(figsize=(10, 5.5))
    axes = fig.subplots(2, 1, sharex=True)
    x = list(range(len(cache.layers)))
    for ax, data, ylabel in zip(axes, (rows, nbytes), ("V rows (all heads)", "bytes")):
        bottom = [0.0] * len(x)
        for z, (name, color) in enumerate(zip(names, ZONE_COLORS)):
            vals = [d[z] for d in data]
            ax.bar(x, vals, bottom=bottom, color=color, label=name)
            bottom = [a + v for a, v in zip(bottom, vals)]
        ax.set_ylabel(ylabel)
    axes[0].set_title(f"TriZone sizes per layer (budget {cache.budget})")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    axes[1].set_xlabel("layer")
    return fig


def bytes_per_token(cache: TriZoneCache) -> Figure:
    """Bytes per prefix token by component, stacked per layer, against the fp16 cost and the budget:
    shows how much of the budget metadata (scales, zeros, indices) eats rather than codes."""
    per_layer = []
    for layer in cache.layers:
        comp = layer_components(layer)
        tokens = layer.prefix_len * layer.batch
        per_layer.append({k: v / tokens for k, v in comp.items()})
    fig = _figure(figsize=(10, 4))
    ax = fig.add_subplot()
    x = list(range(len(cache.layers)))
    bottom = [0.0] * len(x)
    for name in COMPONENTS:
        vals = [p[name] for p in per_layer]
        ax.bar(x, vals, bottom=bottom, color=COMPONENT_COLORS[name], label=name)
        bottom = [a + v for a, v in zip(bottom, vals)]
    fp16 = [2 * 2 * layer.heads * layer.head_dim * (layer.prefix_len - layer.start) / layer.prefix_len
            for layer in cache.layers]  # K and V, 2 bytes each, of the positions the layer holds
    ax.step([i - 0.5 for i in x] + [x[-1] + 0.5], fp16 + fp16[-1:], where="post", color="#444444",
            linestyle="--", linewidth=1, label="fp16")
    if cache.budget is not None:
        ax.step([i - 0.5 for i in x] + [x[-1] + 0.5], [cache.budget * f for f in fp16 + fp16[-1:]], where="post",
                color="#d62728", linestyle=":", linewidth=1, label="budget x fp16")
    ax.set(xlabel="layer", ylabel="bytes per prefix token", yscale="log",
           title=f"Bytes per prefix token by component ({cache.nbytes / cache.fp16_bytes:.3f} of fp16 overall)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


# --- rate-distortion -----------------------------------------------------------------------------------

@torch.no_grad()
def modelled_distortion(rec: pipeline.Prefill, budgets: Sequence[float] = (), caches: Sequence[TriZoneCache] = (),
                        *, method: str | Method = "rdkv", **options) -> tuple[list[float], list[float]]:
    """The allocator's objective (modelled distortion per weight query, the unit of ``cache.distortion``
    and :func:`rdkv.calibrate`) at each budget, and for each given cache compressed from the prefill ``rec`` (a model, cache or record, as
    :func:`rdkv.compress` takes it).

    Budgets are solved as ``rdkv.compress`` solves them (its own tables, the same per-sequence byte
    budgets of budget x fp16 bytes), without packing; a budget too small to fit gives NaN. Only rdkv methods have
    a model of distortion; baselines raise.
    """
    budgets = [pipeline.check_budget(b) for b in budgets]
    m, tables, fp16 = pipeline.allocation_tables(rec, method, **options)
    at_budget = []
    for budget in budgets:
        try:
            at_budget.append(objective(tables, *m.solve(tables, [budget * f for f in fp16])))
        except Infeasible:  # not even the cheapest allowed options fit
            at_budget.append(math.nan)
    return at_budget, [objective(tables, *cache_options(c, tables)) for c in caches]


def rd_curve(rec: pipeline.Prefill, budgets: Sequence[float], chosen: TriZoneCache | float | None = None, *,
             method: str | Method = "rdkv", **options) -> Figure:
    """Modelled distortion against budget for a recorded prefill, with an operating point marked.

    The curve is the solver's own objective (see :func:`modelled_distortion`), so it shows what the
    allocator believes it trades: where extra bytes stop buying much, and how steep the cliff below the
    chosen budget is. ``chosen`` is a cache compressed from this prefill (its allocation is evaluated
    directly) or a budget. Pass the prefill (model, cache or record) and the same ``method`` and options that
    ``rdkv.compress`` got.
    """
    budgets = sorted(budgets)
    caches = [chosen] if isinstance(chosen, TriZoneCache) else []
    extra = [chosen] if isinstance(chosen, (int, float)) and not isinstance(chosen, bool) else []
    d, d_cache = modelled_distortion(rec, budgets + extra, caches, method=method, **options)
    m = pipeline.method_for(rec, method, options)
    fig = _figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ax.plot(budgets, d[: len(budgets)], "o-", color="#2171b5", label=f"{m.name} allocation")
    if chosen is not None:
        if caches:
            point = (chosen.budget if chosen.budget is not None else chosen.nbytes / chosen.fp16_bytes, d_cache[0])
        else:
            point = (extra[0], d[-1])
        ax.plot(*point, "*", color="#d62728", markersize=16, label=f"chosen: budget {point[0]}")
        ax.annotate(f"{point[1]:.3g}", point, textcoords="offset points", xytext=(8, 8), color="#d62728")
    ax.set(xlabel="budget (fraction of the fp16 cache bytes)", yscale="log",
           ylabel=f"modelled distortion ({m.distortion} model)",
           title="Rate-distortion: the allocator's objective at each budget")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig

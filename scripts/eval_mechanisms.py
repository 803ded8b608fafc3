"""Why keys and values want different quantization axes, measured where each tensor is consumed.

    python scripts/eval_mechanisms.py --quick
    python scripts/eval_mechanisms.py --model gemma3-270m --contexts 1024 2048 --domains prose code

Tensor MSE alone misleads (as KIVI observes): a key error matters only through the
score q·k/sqrt(D) it shifts, and a value error only through the probability-weighted sum it enters.
So this script prefills real text once, captures every layer's query, key and value (keys after RoPE
and any k-norm, exactly as the cache holds them), fake-quantizes K or V with ``rdkv.quant`` along
either axis, and measures the damage at the tensor and at the point of consumption:

1. keys, per-token vs per-channel (2 and 4 bits): key error, score error, attention-output error;
2. values, per-token vs per-channel: value error, attention-output error with the true probabilities;
3. KIVI 2-bit (keys per-channel, values per-token) with the last 0/32/128 tokens kept full precision,
   and the four axis pairings: attention-output error of the last queries (both K and V quantized)
   and next-token KL of the whole model over a teacher-forced continuation;
4. group size 32/64/128/whole along each axis (head_dim 64 on SmolLM2, 256 on Gemma 3);

and (1b) keys per channel quantized before RoPE, as KVQuant does, against after it.

"Per-token" groups run along the channels of one token (one scale per token and group), "per-channel"
groups run along ``group`` consecutive tokens of one channel, from the first token (a trailing partial
group gets its own scale). Every error is relative, ||x̂ - x||² / ||x||², per layer and head (scores
only over the positions a query may attend to), averaged over heads; tables give the mean over layers
and, as "median / max", the per-layer spread. The common options ``--methods``/``--budgets`` are unused.
"""
from __future__ import annotations

import argparse
import copy
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median
from typing import Any

import torch
from common import RESULTS, domain_text, forward, header, parser, publish, table
from rdkv.calibrate import kl
from rdkv.dense import attend
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import rdkv
from rdkv.quant import fake_quantize
from rdkv.rope import rope_table, rotate

CAPTURE = "rdkv-mechanisms-capture"
# The KIVI paper (Llama-2-13B, 2-bit, group 32), absolute errors as the paper reports them.
PAPER = {"key err": (13.67, 4.55), "score err": (47.00, 9.60), "value err": (4.57, 3.73), "output err (V)": (3.55, 49.89)}


# ---------------------------------------------------------------- quantization along an axis


def fake_quant(x: torch.Tensor, bits: int, axis: str, group: int | None = None) -> torch.Tensor:
    """Quantize-dequantize ``x`` [..., T, D] the way the library stores it, along ``axis``.

    ``"token"``: groups of ``group`` channels within each token (None: all D channels);
    ``"channel"``: groups of ``group`` consecutive tokens within each channel (None: all T tokens).
    """
    if axis == "channel":
        return fake_quant(x.transpose(-1, -2), bits, "token", group).transpose(-1, -2)
    if axis != "token":
        raise ValueError(f"axis must be 'token' or 'channel', not {axis!r}")
    n = x.shape[-1]
    if n == 0:
        return x.float()
    g = n if group is None else min(group, n)
    whole = n - n % g
    parts = [fake_quantize(x[..., :whole].unflatten(-1, (-1, g)), bits).flatten(-2)]
    if whole < n:
        parts.append(fake_quantize(x[..., whole:], bits))
    return torch.cat(parts, -1)


def with_window(x: torch.Tensor, bits: int, axis: str, group: int | None, window: int) -> torch.Tensor:
    """:func:`fake_quant` on all but the last ``window`` tokens of ``x`` [..., T, D], which stay exact."""
    cut = max(x.shape[-2] - window, 0)
    return torch.cat([fake_quant(x[..., :cut, :], bits, axis, group), x[..., cut:, :].float()], -2)


def rel(ref: torch.Tensor, got: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Relative squared error ||got - ref||² / ||ref||² over ``dims`` (one value per remaining index)."""
    return (got - ref).pow(2).sum(dims) / ref.pow(2).sum(dims).clamp_min(1e-30)


# ---------------------------------------------------------------- one layer's attention


@dataclass
class Layer:
    """One layer's prefill tensors for batch 0: q [Hq, L, D], k and v [Hkv, T, D] (as cached)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float
    window: int | None = None  # sliding window: query i sees keys j with 0 <= i - j < window
    out: torch.Tensor | None = None  # the model's own attention output [Hq, L, D], for a check

    def allowed(self, last: int | None = None) -> torch.Tensor:
        """Boolean [L, T] (or its last ``last`` query rows): which keys each query may attend to."""
        L, T = self.q.shape[1], self.k.shape[1]
        i = torch.arange(T - L, T)[:, None]
        d = i - torch.arange(T)[None, :]
        ok = d >= 0 if self.window is None else (d >= 0) & (d < self.window)
        return ok if last is None else ok[-last:]

    def logits(self, k: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """Scores q·k·scaling [Hq, L', T] of the (last) queries against keys ``k`` [Hkv, T, D]."""
        q = self.q if last is None else self.q[:, -last:]
        return q @ k.repeat_interleave(q.shape[0] // k.shape[0], 0).transpose(1, 2) * self.scaling

    def attend(self, k: torch.Tensor, v: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """Attention output [Hq, L', D] with keys ``k`` and values ``v`` (:func:`rdkv.dense.attend`)."""
        q = self.q if last is None else self.q[:, -last:]
        T = k.shape[1]
        out, _ = attend(q[None].float(), k[None], v[None], torch.arange(T - q.shape[1], T), torch.arange(T), self.scaling,
                        self.window)
        return out[0]


def key_errors(layer: Layer, k_hat: torch.Tensor, ref_scores: torch.Tensor, ref_out: torch.Tensor) -> dict[str, float]:
    """Key, score and attention-output error (values exact) of quantized keys, averaged over heads.

    ``ref_scores`` [Hq, L, T] are the exact scores with non-attendable positions zeroed, ``ref_out``
    the exact attention output [Hq, L, D].
    """
    s_hat = layer.logits(k_hat) * layer.allowed()
    return {"key err": float(rel(layer.k, k_hat, (1, 2)).mean()),
            "score err": float(rel(ref_scores, s_hat, (1, 2)).mean()),
            "output err": float(rel(ref_out, layer.attend(k_hat, layer.v), (1, 2)).mean())}


def value_errors(layer: Layer, v_hat: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
    """Value error and attention-output error with the true probabilities ``probs`` [Hq, L, T]."""
    rep = probs.shape[0] // v_hat.shape[0]
    ref, got = probs @ layer.v.repeat_interleave(rep, 0), probs @ v_hat.repeat_interleave(rep, 0)
    return {"value err": float(rel(layer.v, v_hat, (1, 2)).mean()), "output err": float(rel(ref, got, (1, 2)).mean())}


def joint_error(layer: Layer, k_hat: torch.Tensor, v_hat: torch.Tensor, last: int) -> float:
    """Attention-output error of the last ``last`` queries when both K and V are quantized."""
    return float(rel(layer.attend(layer.k, layer.v, last), layer.attend(k_hat, v_hat, last), (1, 2)).mean())


# ---------------------------------------------------------------- capturing q, k, v from the model


class Capture:
    """A transformers attention function that runs SDPA and, while ``on``, keeps each layer's tensors."""

    def __init__(self) -> None:
        self.on = False
        self.layers: dict[int, Layer] = {}

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("attention logit soft-capping is not modelled here")
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        if self.on:
            self.layers[module.layer_idx] = Layer(
                query[0].detach().float(), key[0].detach().float(), value[0].detach().float(),
                query.shape[-1] ** -0.5 if scaling is None else scaling, sliding_window,
                out[0].transpose(0, 1).detach().float())
        return out, None


def capture(model: torch.nn.Module) -> Capture:
    """Route the model's attention through a fresh :class:`Capture` (SDPA masks, same numbers); rdkv's
    attention is not involved here."""
    cap = Capture()
    AttentionInterface.register(CAPTURE, cap)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    model.set_attn_implementation(CAPTURE)
    return cap


def tokens(tok: Any, domain: str, n: int, seed: int) -> torch.Tensor:
    """``n`` tokens [1, n] of a domain's text, starting at a paragraph chosen by ``seed`` (0: the start)."""
    text = domain_text(domain)
    starts = [0] + [m.end() for m in re.finditer("\n\n", text)]
    start = starts[random.Random(seed).randrange(len(starts) // 2)] if seed else 0
    ids = tok(text[start : start + 12 * n], return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise ValueError(f"{domain} text has only {ids.shape[1]} tokens from there, fewer than {n}")
    return ids


# ---------------------------------------------------------------- the experiment


AXES = {"per-token": "token", "per-channel": "channel"}
PAIRS = [("channel", "token"), ("token", "token"), ("channel", "channel"), ("token", "channel")]


def configs(groups: list[int], head_dim: int) -> list[tuple[str, int, int | None]]:
    """(axis, bits, group) settings: 2 and 4 bits at group 32, then every group at 2 bits."""
    out = [(a, b, 32) for b in (2, 4) for a in AXES.values()]
    for a in AXES.values():
        seen = set()
        for g in [*groups, None]:
            eff = min(g, head_dim) if (a == "token" and g is not None) else g
            if eff in seen or (a == "token" and g is None and head_dim in seen):
                continue
            seen.add(eff)
            out.append((a, 2, g))
    return list(dict.fromkeys(out))


def glabel(axis: str, group: int | None, head_dim: int) -> str:
    """Table label of a group: its size, D (a whole head) or all (the whole context)."""
    if axis == "token":
        return "D" if group is None or group >= head_dim else str(group)
    return "all" if group is None else str(group)


def summarize(per_layer: dict[tuple, list[dict[str, float]]], key: tuple, metric: str) -> tuple[float, str]:
    """(mean over layers, "median / max" over layers) of one metric of one setting."""
    vals = [d[metric] for d in per_layer[key]]
    return mean(vals), f"{median(vals):.3g} / {max(vals):.3g}"


def run_domain(model: Any, tok: Any, cap: Capture, domain: str, n: int, args: argparse.Namespace) -> dict:
    """All measurements for one domain and context length."""
    ids = tokens(tok, domain, n + args.continuation, args.seed)
    ctx, tail = ids[:, :n], ids[:, n:]
    cap.on, cap.layers = True, {}
    cache = rdkv.compat.output_cache(model(ctx, use_cache=True, logits_to_keep=1))
    cap.on = False
    layers = [cap.layers[i] for i in sorted(cap.layers)]
    D = layers[0].q.shape[-1]
    check = max(float(rel(x.out, x.attend(x.k, x.v), (0, 1, 2))) for x in layers)
    keyed: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    valued: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    joint: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    settings = configs(args.groups, D)
    prerope: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    pos = torch.arange(n)
    for i, x in enumerate(tqdm(layers, desc=f"{domain} {n} layers", leave=False)):
        ok = x.allowed()
        scores = x.logits(x.k)
        probs = scores.masked_fill(~ok, float("-inf")).softmax(-1)
        scores *= ok
        ref_out = probs @ x.v.repeat_interleave(probs.shape[0] // x.v.shape[0], 0)
        for axis, bits, g in settings:
            keyed[axis, bits, g].append(key_errors(x, fake_quant(x.k, bits, axis, g), scores, ref_out))
            valued[axis, bits, g].append(value_errors(x, fake_quant(x.v, bits, axis, g), probs))
        table_i = rope_table(model, i, D, pos)  # KVQuant: per-channel groups on the keys before RoPE
        k_pre = rotate(x.k, pos, table_i, inverse=True)
        for bits in (2, 4):
            k_hat = rotate(fake_quant(k_pre, bits, "channel", 32), pos, table_i)
            prerope[bits].append(key_errors(x, k_hat, scores, ref_out))
        for ka, va in PAIRS:
            for w in args.windows if (ka, va) == PAIRS[0] else [0]:
                k_hat, v_hat = (with_window(t, 2, a, 32, w) for t, a in ((x.k, ka), (x.v, va)))
                joint[ka, va, w].append({"output err": joint_error(x, k_hat, v_hat, args.last_queries)})
        del scores, probs
    # Whole model: the quantized prefill cache, then the continuation teacher-forced through it.
    ref = forward(model, copy.deepcopy(cache), tail)
    kls = {}
    for (ka, va, w) in joint:
        c = copy.deepcopy(cache)
        for layer in c.layers:
            layer.keys = with_window(layer.keys, 2, ka, 32, w).to(layer.keys.dtype)
            layer.values = with_window(layer.values, 2, va, 32, w).to(layer.values.dtype)
        kls[ka, va, w] = kl(ref, forward(model, c, tail))
    return {"keyed": keyed, "valued": valued, "joint": joint, "kls": kls, "prerope": prerope, "check": check, "head_dim": D,
            "layers": len(layers)}


def rows_for(domain: str, n: int, r: dict) -> dict[str, list[dict]]:
    """Table rows of one run, by section: keys, values, groups, window."""
    D, out = r["head_dim"], defaultdict(list)
    name = {v: k for k, v in AXES.items()}
    for (axis, bits, g) in r["keyed"]:
        base = {"domain": domain, "T": n, "axis": name[axis], "bits": bits, "group": glabel(axis, g, D)}
        k_out, k_spread = summarize(r["keyed"], (axis, bits, g), "output err")
        s_mean, s_spread = summarize(r["keyed"], (axis, bits, g), "score err")
        v_out, v_spread = summarize(r["valued"], (axis, bits, g), "output err")
        krow = {**base, "key err": summarize(r["keyed"], (axis, bits, g), "key err")[0], "score err": s_mean,
                "score err median / max": s_spread, "output err": k_out, "output err median / max": k_spread}
        vrow = {**base, "value err": summarize(r["valued"], (axis, bits, g), "value err")[0], "output err": v_out,
                "output err median / max": v_spread}
        if g == 32:
            out["keys"].append(krow)
            out["values"].append(vrow)
        if bits == 2:
            size = min(g or 1 << 30, D if axis == "token" else n)  # values sharing one scale and zero
            out["groups"].append({**base, "values/scale": size, "key err": krow["key err"], "score err": s_mean, "K output err": k_out,
                                  "value err": vrow["value err"], "V output err": v_out})
    out["groups"].sort(key=lambda row: (row["axis"], row["values/scale"]))
    for bits, runs in r["prerope"].items():
        post = r["keyed"]["channel", bits, 32]
        row = {"domain": domain, "T": n, "bits": bits}
        for metric in ("key err", "score err", "output err"):
            row[f"{metric} after RoPE"] = mean(d[metric] for d in post)
            row[f"{metric} before RoPE"] = mean(d[metric] for d in runs)
        out["prerope"].append(row)
    for ka, va, w in r["joint"]:
        m, spread = summarize(r["joint"], (ka, va, w), "output err")
        out["window"].append({"domain": domain, "T": n, "keys": name[ka], "values": name[va], "fp16 window": w,
                              "last-query output err": m, "median / max": spread, "next-token KL": r["kls"][ka, va, w]})
    return out


def ratios(keys: list[dict], values: list[dict]) -> str:
    """Paper vs ours: per-token / per-channel error ratios at 2 bits, group 32 (ours averaged over runs)."""
    def ours(rows: list[dict], metric: str) -> float:
        def pick(axis: str) -> float:
            return mean(r[metric] for r in rows if r["bits"] == 2 and r["axis"] == axis)

        return pick("per-token") / pick("per-channel")

    got = {"key err": ours(keys, "key err"), "score err": ours(keys, "score err"),
           "value err": ours(values, "value err"), "output err (V)": ours(values, "output err")}
    rows = [{"metric": m, "paper per-token": t, "paper per-channel": c, "paper ratio token/channel": t / c,
             "our ratio token/channel": got[m]} for m, (t, c) in PAPER.items()]
    return table(rows, list(rows[0]))


def plot(parts: dict[str, list[dict]], path: Path, title: str) -> None:
    """Four panels: key and value errors by axis and bits, the recent window, and group size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(20, 4.2))
    domains = list(dict.fromkeys(r["domain"] for r in parts["keys"]))
    for i, (part, metrics) in enumerate((("keys", ["key err", "score err", "output err"]),
                                         ("values", ["value err", "output err"]))):
        labels, width = [], 0.8 / len(metrics)
        rows = [r for r in parts[part] if r["domain"] == domains[0]]
        for j, m in enumerate(metrics):
            ax[i].bar([k + j * width for k in range(len(rows))], [r[m] for r in rows], width, label=m)
        labels = [f"{r['axis']}\n{r['bits']}-bit" for r in rows]
        ax[i].set_xticks([k + width * (len(metrics) - 1) / 2 for k in range(len(rows))], labels, fontsize=8)
        ax[i].set_yscale("log")
        ax[i].set_title(f"{part} quantized, group 32 ({domains[0]})")
        ax[i].legend(fontsize=7)
    for d in domains:
        rows = [r for r in parts["window"] if r["domain"] == d and r["keys"] == "per-channel" and r["values"] == "per-token"]
        ax[2].plot([r["fp16 window"] for r in rows], [r["last-query output err"] for r in rows], "o-", label=f"{d}: output err")
        ax[2].plot([r["fp16 window"] for r in rows], [r["next-token KL"] for r in rows], "s--", label=f"{d}: KL")
    ax[2].set_yscale("log")
    ax[2].set_xlabel("full-precision recent tokens")
    ax[2].set_title("KIVI 2-bit + recent window")
    ax[2].legend(fontsize=7)
    for axis, style in (("per-token", "o-"), ("per-channel", "s--")):
        rows = [r for r in parts["groups"] if r["domain"] == domains[0] and r["axis"] == axis]
        xs = [r["values/scale"] for r in rows]
        ax[3].plot(xs, [r["score err"] for r in rows], style, label=f"K {axis}: score err")
        ax[3].plot(xs, [r["V output err"] for r in rows], style, label=f"V {axis}: output err", alpha=0.6)
    ax[3].set_xscale("log", base=2)
    ax[3].set_yscale("log")
    ax[3].set_xlabel("values per scale (channels of a token, or tokens of a channel)")
    ax[3].set_title(f"2-bit group size ({domains[0]})")
    ax[3].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = parser(__doc__, [], [1024])
    ap.add_argument("--domains", nargs="+", default=["prose", "code"], choices=["prose", "code", "legal"])
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 32, 128])
    ap.add_argument("--last-queries", type=int, default=64, help="queries scored in the window experiment")
    ap.add_argument("--continuation", type=int, default=64, help="tokens teacher-forced for the KL")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.continuation = [1024], 32
    tag = args.tag or ("quick" if args.quick else "full")
    torch.manual_seed(args.seed)
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    cap = capture(model)
    parts: dict[str, list[dict]] = defaultdict(list)
    checks, info = [], {}
    for domain in tqdm(args.domains, desc="domains"):
        for n in args.contexts:
            r = run_domain(model, tok, cap, domain, n, args)
            checks.append(r["check"])
            info = {"head_dim": r["head_dim"], "layers": r["layers"]}
            for k, v in rows_for(domain, n, r).items():
                parts[k] += v

    name = f"mechanisms_{args.model}_{tag}"
    kcols = ["domain", "T", "axis", "bits", "group", "key err", "score err", "score err median / max",
             "output err", "output err median / max"]
    vcols = ["domain", "T", "axis", "bits", "group", "value err", "output err", "output err median / max"]
    gcols = ["domain", "T", "axis", "group", "values/scale", "key err", "score err", "K output err", "value err", "V output err"]
    wcols = ["domain", "T", "keys", "values", "fp16 window", "last-query output err", "median / max", "next-token KL"]
    pcols = ["domain", "T", "bits"] + [f"{m} {w} RoPE" for m in ("key err", "score err", "output err") for w in ("after", "before")]
    md = (f"# Key/value quantization mechanisms at the point of consumption: {args.model} ({tag})\n\n{header(args)}\n"
          f"{info['layers']} layers, head_dim {info['head_dim']}; domains {args.domains}, contexts {args.contexts} "
          f"tokens, seed {args.seed}. Relative squared errors ||x̂ - x||² / ||x||² per layer and head, mean over "
          f"heads; columns give the mean over layers and the per-layer median / max. Keys are measured after "
          f"RoPE (and k-norm), as cached. Capture check: the rebuilt attention output matches the model's "
          f"to a relative squared error of {max(checks):.1e}.\n\n"
          f"## 1. Keys: per-token vs per-channel (group 32)\n\nScore err: q·k·scaling over attendable positions; "
          f"output err: softmax(scores)·V with exact values.\n\n{table(parts['keys'], kcols)}\n\n"
          f"## 1b. Keys per channel (group 32), quantized after RoPE (as cached) vs before it (KVQuant)\n\n"
          f"Before RoPE: the cached keys are un-rotated with the model's own RoPE table (`rdkv.rope`), quantized, "
          f"and rotated back; errors are measured on the rotated keys, as attention sees them (mean over "
          f"layers).\n\n{table(parts['prerope'], pcols)}\n\n"
          f"## 2. Values: per-token vs per-channel (group 32)\n\nOutput err: true probabilities times quantized "
          f"values.\n\n{table(parts['values'], vcols)}\n\n"
          f"## Paper (KIVI, Llama-2-13B, 2-bit, group 32) vs ours\n\nThe paper's numbers are absolute errors on "
          f"another model; ours are relative, so only the per-token / per-channel ratios compare (ours: mean "
          f"over domains and layers).\n\n{ratios(parts['keys'], parts['values'])}\n\n"
          f"## 3. Full-precision recent window and axis pairings (2-bit, group 32)\n\nOutput error of the last "
          f"{args.last_queries} prefill queries with both K and V quantized (softmax recomputed); KL: mean "
          f"KL(full || quantized) of next-token distributions over {args.continuation} tokens teacher-forced "
          f"through the quantized prefill cache (the new tokens stay full precision).\n\n"
          f"{table(parts['window'], wcols)}\n\n"
          f"## 4. Group size (2-bit)\n\nPer-token groups are channels of one token (D = the whole head, "
          f"{info['head_dim']}); per-channel groups are consecutive tokens of one channel (all = the whole "
          f"context).\n\n{table(parts['groups'], gcols)}\n\n![plot]({name}.png)\n")
    publish(name, md)
    plot(parts, RESULTS / f"{name}.png", f"{args.model} ({tag})")


if __name__ == "__main__":
    main()

"""Shared pieces of the experiment scripts: one prefill, many compressions, teacher-forced scores."""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import ruler
import torch

import rdkv
from rdkv.calibrate import PriorFit
from rdkv.dense import probabilities
from rdkv.methods import Method

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
DEFAULT_METHODS = ["rdkv", "rdkv-global", "rdkv-1pass", "rdkv-v0", "rdkv-paper", "snapkv", "adakv", "streaming", "knorm",
                   "kivi2", "kivi4", "int4", "int8"]


def parser(doc: str, budgets: list[float], contexts: list[int]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, type=method_arg, metavar="METHOD",
                    help="method names (rdkv.methods.METHODS or common.VARIANTS), each optionally with options after "
                         "a colon, e.g. rdkv:floor=0,surprisal=1 (a sweep is one command)")
    ap.add_argument("--budgets", type=float, nargs="+", default=budgets)
    ap.add_argument("--contexts", type=int, nargs="+", default=contexts)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a few-minute run on 2 cores")
    ap.add_argument("--tag", default=None, help="suffix of the result files (default: quick or full)")
    return ap


# ablations and superseded configurations of RDKV, under the names the results use (docs/experiments.md):
# name -> (the packaged method it varies, its options)
VARIANTS: dict[str, tuple[str, dict]] = {
    "rdkv-all": ("rdkv", {"weights": "all"}),  # needs rdkv.record(model, all_queries=True)
    "rdkv-global": ("rdkv", {"scope": "global"}),
    "rdkv-pool": ("rdkv", {"pool_weights": 7}),  # SnapKV-style pooled weights: better when the question is in the prompt
    # weights from all 256 recorded queries instead of the last 64: better on Gemma 3 query-agnostic (1k), worse
    # on SmolLM2 at 2k-4k below 25% and on query-aware prompts (2026-11-29/30)
    "rdkv-w256": ("rdkv", {"window": 256}),
    "rdkv-wsl256": ("rdkv", {"window_sliding": 256}),  # all 256 queries for sliding-window layers only
    "rdkv-wgl256": ("rdkv", {"window": 256, "window_sliding": 64}),  # all 256 for global layers only
    # window weights per window query that can see each token: better at 25% and on Gemma 3's agnostic needle,
    # worse at 5%
    "rdkv-visible": ("rdkv", {"visible": 1.0}),
    "rdkv-visible-wgl256": ("rdkv", {"visible": 1.0, "window": 256, "window_sliding": 64}),  # rdkv-hybrid without horizon
    "rdkv-1pass": ("rdkv", {"passes": 1}),
    "rdkv-v0": ("rdkv", {"scope": "global", "passes": 1}),  # the first default: one knapsack, K priced for every token
    "rdkv-aware-v0": ("rdkv-aware", {"pool_forward": 0}),  # rdkv-aware until 2026-12-02: no forward reach
    # also keeps what the earlier global layers weighed (Prior.carry): the question-in-prompt 2.5% cells
    "rdkv-aware-carry": ("rdkv-aware", {"carry": 0.5}),
    "rdkv-noprotect": ("rdkv", {"sinks": 0, "recent": 0}),
    "rdkv-noevict": ("rdkv", {"evict": False}),
    "rdkv-noprior": ("rdkv", {"surprisal": 0.0}),  # no reserve for unseen questions at all
    "rdkv-qfloor": ("rdkv", {"q_floor": 0.5}),  # half of each K channel's query weight from the channel mean
    "rdkv-floor": ("rdkv", {"floor": 1.0, "surprisal": 3.0}),  # the prior before 2026-11-29
    "rdkv-prerope": ("rdkv", {"prerope": True}),  # KVQuant's pre-RoPE keys, rotated back at decode
    # where an evicted token's mass is assumed to go (rdkv.distortion.EVICT_TO; the default is "heavy")
    "rdkv-evict-output": ("rdkv", {"evict_to": "output"}),  # the default until the 8k regression was traced to it
    "rdkv-evict-mean": ("rdkv", {"evict_to": "mean"}),
    "rdkv-evict-max": ("rdkv", {"evict_to": "max"}),
    "rdkv-evict-kept": ("rdkv", {"evict_to": "kept"}),
    "rdkv-joint": ("rdkv", {"evict_jointly": True}),  # evicting a set costs its cross terms too
    # weighed by the context repeated after the prefill (KVzip's reconstruction queries, rdkv.reconstruct)
    "rdkv-recon": ("rdkv", {"weights": "reconstruct"}),
    "rdkv-recon-noprior": ("rdkv", {"weights": "reconstruct", "surprisal": 0.0}),
    # each token weighed by the largest attention one repetition query paid it (KVzip's score), no prior
    "rdkv-recon-max": ("rdkv", {"weights": "reconstruct", "surprisal": 0.0, "score": "max"}),
    # ... and the budget split across layers by one ranking of every layer's tokens by those peaks (KVzip's top-k)
    "rdkv-recon-peak": ("rdkv", {"weights": "reconstruct", "surprisal": 0.0, "score": "max", "split": "peak"}),
}
NAMES = (*rdkv.methods.NAMES, *VARIANTS)
PARTS = {"spec", "prior", "eviction", "solve"}


def named(name: str) -> str | Method:
    """What ``method=`` gets for a name: a packaged name as it is (``auto`` depends on the model), a variant
    as its method object."""
    if name in VARIANTS:
        base, options = VARIANTS[name]
        return replace(rdkv.methods.named(base).with_options(**options), name=name)
    return name


def split_method(text: str) -> tuple[str | Method, dict]:
    """``"rdkv-pool:surprisal=1,k_group=256,v_group=64/32/32"`` -> (the rdkv-pool method, {"surprisal": 1,
    "k_group": 256, "v_group": (64, 32, 32)}), for ``rdkv.compress(rec, b, method=m, **options)``."""
    name, _, opts = text.partition(":")
    if name not in NAMES:
        raise argparse.ArgumentTypeError(f"unknown method {name!r}; choose one of {', '.join(NAMES)}")
    method = named(name)
    # single fields only: a whole part (spec=, prior=, ...) is not written on a command line
    known = set(rdkv.methods.named("rdkv" if method == rdkv.methods.AUTO else method).options()) - PARTS
    overrides = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not KEY=VALUE with KEY one of {sorted(known)}")
        overrides[key] = {"True": True, "False": False}.get(value, value)
        if "/" in value:  # one value per V width, e.g. v_group=64/32/32
            overrides[key] = tuple(int(x) for x in value.split("/"))
            continue
        for cast in (int, float):
            try:
                overrides[key] = cast(value)
                break
            except ValueError:
                pass
    return method, overrides


def add_sample_args(ap: argparse.ArgumentParser, task: str, protocol: str) -> None:
    """The arguments that name one RULER sample and its prefill, as the diagnostic scripts take them."""
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--task", default=task, choices=ruler.TASKS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=0, help="eval_ruler's sample index (seed 0 + sample)")
    ap.add_argument("--protocol", default=protocol, choices=("aware", "agnostic"))


def method_arg(text: str) -> str:
    split_method(text)
    return text


def method_of(model, text: str) -> Method:
    """The method a ``--methods`` entry runs on ``model``, ``layer_gains=fit`` left out."""
    method, extra = split_method(text)
    if extra.get("layer_gains") == "fit":
        del extra["layer_gains"]
    return rdkv.methods.resolve(model, method, extra)


def weight_window(model, method: str, sliding: bool) -> int:
    """How many recorded queries a method's weights use on a layer (sliding-window or not), as compress
    resolves it for a default ``rdkv.record``."""
    m = method_of(model, method).for_record(rdkv.Record(model))
    return m.weights.of_layer(sliding) or m.weights.window


def needs_all_queries(model, methods: list[str]) -> bool:
    """Whether any method reads every prefill query (then ``rdkv.record(model, all_queries=True)``)."""
    return any(method_of(model, m).all_queries for m in methods)


def header(args) -> str:
    return (f"Command: `python {' '.join(os.sys.argv)}`  \n"
            f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
            f"transformers {__import__('transformers').__version__}; date {time.strftime('%Y-%m-%d')}\n"
            + (f"\n{args.prior_note}\n" if getattr(args, "prior_note", None) else ""))


def domain_text(name: str) -> str:
    if name == "prose":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    if name == "code":
        import argparse

        return inspect.getsource(argparse)
    if name == "legal":
        return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    raise ValueError(name)


def calibration_texts(tok, offset: int = 30000) -> list[torch.Tensor]:
    """Text the evaluations do not score: prose tokens offset..offset+1024 of the language reference and the
    first 1024 tokens of the ``collections`` module (the code domain scores ``argparse``)."""
    import collections

    prose = tok(domain_text("prose"), return_tensors="pt").input_ids
    code = tok(inspect.getsource(collections), return_tensors="pt").input_ids
    return [prose[:, offset : offset + 1024], code[:, :1024]]


def add_tune_prior(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tune-prior", action="store_true",
                    help="fit floor/surprisal on calibration text first (rdkv.tune_prior); plain rdkv rows then use it")


def tune_prior(model, tok, args) -> PriorFit | None:
    """With ``--tune-prior`` (:func:`add_tune_prior`): the ``rdkv.tune_prior`` fit on :func:`calibration_texts`
    (also kept as ``args.prior``), else None. Given to :func:`compressions` and :func:`fitted_gains`, it sets
    the prior of every RDKV method that does not choose its own (:func:`with_prior`); the choice and every
    candidate's score go into the results header."""
    args.prior = None
    if not args.tune_prior:
        return None
    fit = args.prior = rdkv.tune_prior(model, calibration_texts(tok))
    scores = ", ".join(f"({f:g}, {s:g}): {v:.3f}" for f, s, v in fit.scores)
    args.prior_note = (f"Prior tuned on this model (`rdkv.tune_prior` on common.calibration_texts, budgets 0.1/0.25): "
                       f"`rdkv` rows use floor={fit.floor:g}, surprisal={fit.surprisal:g}; mean log KL per (floor, "
                       f"surprisal): {scores}.")
    print(args.prior_note, flush=True)
    return fit


def with_prior(model, method: str | Method, options: dict, prior: PriorFit | None) -> dict:
    """``options`` for ``rdkv.compress(rec, b, method=method, **options)`` with a tuned prior's ``prior.options``
    (floor, surprisal) under them, when ``method`` is an RDKV method with the default prior (``auto`` as it
    resolves for ``model``) and the options set neither; otherwise ``options`` as they are."""
    if prior is None:
        return options
    m = rdkv.methods.resolve(model, method, {})
    if not isinstance(m, rdkv.RDKV) or m.prior != rdkv.methods.Prior() or {"floor", "surprisal"} & set(options):
        return options
    return {**prior.options, **options}


def settings(method: str | Method, budgets: list[float]) -> list[float | None]:
    """Fixed-rate baselines run once at their own size; the rest at every budget."""
    return [None] if method != rdkv.methods.AUTO and rdkv.methods.named(method).fixed_rate else budgets


def fitted_gains(model, tok, methods: list[str], prior: PriorFit | None = None) -> dict[str, tuple[float, ...]]:
    """``rdkv.fit_layer_gains`` on :func:`calibration_texts` for every method given with ``layer_gains=fit``
    (with that method's other options, minus ``scope``, and the tuned ``prior`` where :func:`with_prior`
    applies it); :func:`compressions` then uses them."""
    out = {}
    for m in methods:
        name, extra = split_method(m)
        if extra.pop("layer_gains", None) == "fit":
            extra.pop("scope", None)
            extra = with_prior(model, name, extra, prior)
            out[m] = rdkv.fit_layer_gains(model, calibration_texts(tok), method=name, **extra)
            print(f"layer gains for {m}: " + " ".join(f"{g:.3g}" for g in out[m]), flush=True)
    return out


def compressions(rec: rdkv.Record, methods: list[str], budgets: list[float], gains: dict | None = None,
                 prior: PriorFit | None = None, **options):
    """Yield (method, budget, cache) for the recorded prefill ``rec``; a budget too small for a method is
    skipped. A method given with ``layer_gains=fit`` uses ``gains[method]`` (from :func:`fitted_gains`); a
    tuned ``prior`` (:func:`tune_prior`) goes to the methods :func:`with_prior` gives it to."""
    for m in methods:
        name, extra = split_method(m)
        if extra.get("layer_gains") == "fit":
            if m not in (gains or {}):
                raise ValueError(f"{m}: layer_gains=fit needs common.fitted_gains(model, tok, methods) first")
            extra["layer_gains"] = gains[m]
        kw = with_prior(rec.model, name, {**options, **extra}, prior)
        for b in settings(name, budgets):
            try:
                yield m, b, rdkv.compress(rec, b, method=name, **kw)
            except rdkv.RDKVError as e:
                print(f"  skip {m} @ {b}: {e}")


def probe_inputs(tok, n: int, depth: float, protocol: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(prefix to prefill, tail to teacher-force, answer tokens at the tail's end) of one retrieval probe.

    ``agnostic``: the context alone is compressed, question + answer follow. ``aware``: the question ends
    the compressed prompt; only its last token and the answer are fed through the compressed cache.
    """
    enc = lambda s: tok(s, return_tensors="pt", add_special_tokens=False).input_ids  # noqa: E731
    probe = rdkv.models.retrieval_prompt(n, depth, tok, seed=seed)
    ctx = tok(probe["context"], return_tensors="pt").input_ids
    q, ans = enc(probe["question"]), enc(probe["answer"])
    if protocol == "agnostic":
        return ctx, torch.cat([q, ans], 1), ans.shape[1]
    return torch.cat([ctx, q[:, :-1]], 1), torch.cat([q[:, -1:], ans], 1), ans.shape[1]


def forward(model, cache, tail: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of teacher-forcing ``tail`` [1, L] through ``cache`` (float32)."""
    return model(tail, **rdkv.cache_kwargs(cache)).logits[0].float()


def dense_probs(st, q: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention probabilities [Hq, L, T] of queries q [Hq, L, D] (the last L positions the layer record
    ``st`` holds) over its last ``keys`` keys, and those keys' positions [T]. Diagnostics only: it forms the
    whole L x T matrix."""
    k = st.key[:1, :, -keys:].float()
    k_pos, q_pos = torch.arange(st.seen - keys, st.seen), torch.arange(st.seen - q.shape[1], st.seen)
    p, _ = probabilities(q.float()[None].unflatten(1, (k.shape[1], -1)), k, q_pos, k_pos, st.scaling,
                         st.sliding_window, st.softcap)
    return p.flatten(1, 2)[0], k_pos


def token_margins(logits: torch.Tensor, tail: torch.Tensor, n_ans: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer token (the last ``n_ans`` of ``tail``): its logit minus the best other token's, and that
    rival's id. Negative exactly where the argmax misses; near 0 where any small perturbation flips it."""
    pred, target = logits[-n_ans - 1 : -1], tail[0, -n_ans:]
    rival = pred.scatter(1, target[:, None], float("-inf")).max(-1)
    return pred.gather(1, target[:, None])[:, 0] - rival.values, rival.indices


def answer_scores(logits: torch.Tensor, tail: torch.Tensor, n_ans: int) -> tuple[float, bool, float]:
    """(NLL, exact match of the argmax, smallest token margin) of the last ``n_ans`` tail tokens."""
    pred, target = logits[-n_ans - 1 : -1], tail[0, -n_ans:]
    nll = float(-pred.log_softmax(-1).gather(1, target[:, None]).sum())
    return nll, bool(torch.equal(pred.argmax(-1), target)), float(token_margins(logits, tail, n_ans)[0].min())


def by_depth(rs: list[dict], depths: list[float]) -> str:
    """Mean answer margin per depth over a cell's probes, e.g. ``+0.35 +1.7 -2.1``."""
    out = []
    for d in depths:
        ms = [r["margin"] for r in rs if r["depth"] == d]
        out.append(f"{sum(ms) / len(ms):+.2g}" if ms else "-")
    return " ".join(out)


def plot(rows: list[dict], x: str, ys: list[str], path: Path, title: str) -> None:
    """Quality vs bytes, one line per method, one panel per metric (and per protocol if present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    groups = sorted({r.get("protocol", "") for r in rows})
    fig, axes = plt.subplots(len(groups), len(ys), figsize=(5 * len(ys), 3.6 * len(groups)), squeeze=False)
    for gi, g in enumerate(groups):
        for yi, y in enumerate(ys):
            ax = axes[gi][yi]
            colors = plt.get_cmap("tab20").colors
            methods = list(dict.fromkeys(r["method"] for r in rows))
            lead = next((m for m in methods if m.startswith("rdkv")), None)  # the first rdkv method is drawn bold
            for i, m in enumerate(methods):
                pts = sorted((r[x], r[y]) for r in rows if r["method"] == m and r.get("protocol", "") == g)
                if y in ("KL", "NLL"):  # log axis: a zero (a lossless cell) has no place on it
                    pts = [p for p in pts if p[1] > 0]
                style = "o-" if m.startswith("rdkv") else "s--"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=m, color=colors[i % 20],
                        lw=2.5 if m == lead else 1)
            ax.set_xscale("log")
            xs = [r[x] for r in rows]
            ticks = [t for t in (0.025, 0.05, 0.1, 0.25, 0.5, 1.0) if 0.8 * min(xs) <= t <= 1.25 * max(xs)]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])  # the budgets, where the data is
            ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on a short decade
            ax.set_xlabel("bytes held / fp16 bytes")
            ax.set_ylabel(y)
            ax.set_title(f"{title} {g}".strip())
            if y in ("KL", "NLL"):
                ax.set_yscale("log")
            elif y == "ppl increase %":  # may be negative
                ax.set_yscale("symlog", linthresh=0.1)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def publish(name: str, md: str) -> None:
    """Print the markdown and save it as docs/results/<name>.md."""
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(md)


def save_outputs(folder: str | None, name: str, text: str, data: dict | None = None) -> None:
    """A benchmark's ``--out``: write ``<name>.md`` (and ``<name>.json`` when ``data`` is given) into
    ``folder``, if one was given."""
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.md"), "w") as fh:
        fh.write(text)
    if data is not None:
        with open(os.path.join(folder, f"{name}.json"), "w") as fh:
            json.dump(data, fh, indent=1)


def write(name: str, md: str, rows: list[dict], ys: list[str], title: str) -> None:
    """Print the markdown, and save it with its quality-vs-bytes plot under docs/results/."""
    publish(name, md)
    plot([r for r in rows if r["method"] != "full"], "bytes/fp16", ys, RESULTS / f"{name}.png", title)


def table(rows: list[dict], cols: list[str]) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)

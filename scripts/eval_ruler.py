"""RULER-style tasks (scripts/ruler.py) through every method at equal bytes, both protocols, greedy answers.

    python scripts/eval_ruler.py --model gemma3-270m --contexts 4096 8192 --samples 4
    python scripts/eval_ruler.py --model smollm2-135m --contexts 4096 --tasks niah_single multi_needle --quick

Protocols: ``agnostic`` (the context alone is prefilled and compressed; each question is then fed through a copy
of the compressed cache and answered greedily) and ``aware`` (the context and the question are prefilled and
compressed together; the question's last token and the answer go through the cache). One prefill per sample and
protocol, recorded once and compressed by every method at every budget (fixed-rate baselines at their own size).
Each answer is appended to ``docs/results/ruler_<model>_<tag>.jsonl`` as it is scored, so an interrupted run
continues where it stopped; the markdown table (score per task, the mean, and the mean as % of the full cache's)
and the score-vs-bytes plot are written from every line of that file. The runner is device-agnostic: it runs
where the model's weights are (``--device cuda`` on a GPU).

``--presses`` adds NVIDIA kvpress's own presses (rows ``kvpress:<press>``), as scripts/eval_kvpress.py runs them:
after rdkv's rows, the model gets its own attention back, each press prefills the same prefix on a fresh cache at
compression ratio 1 - budget, and the answer is decoded with no press active and explicit positions (an evicted
cache is shorter than the positions it covers). A press is charged its K and V elements at 2 bytes each over the
fp16 bytes of the full cache; a press that masks entries instead of dropping them (AdaKV, KVzip: they hold the
whole cache) is charged the entries it leaves visible at 2 bytes each, as if its ragged selection were stored
compactly and its indices were free. ``--press-budgets`` gives the presses budgets of their own (KVzip at 30% of
the tokens beside rdkv at 10% of the bytes). kvpress needs transformers < 5.3: ``./dev kvpress scripts/eval_ruler.py
... --presses kvzip expected`` runs in an environment with both. Gemma 3 cannot run there under its name: transformers
5.2 converts its tokenizer into single characters, which ``rdkv.models.load`` refuses; and kvpress 0.5.5's KVzip
refuses Gemma 3 and its ExpectedAttention fails on it.
"""
from __future__ import annotations

import copy
import json
from collections import defaultdict

import torch
from tqdm import tqdm

try:  # before rdkv: kvpress wraps every attention function registered when it is imported, rdkv's must not be one
    import kvpress  # noqa: F401
except ImportError:
    kvpress = None
import rdkv  # noqa: E402
import ruler  # noqa: E402
from common import RESULTS, compressions, header, needs_all_queries, parser, plot, publish, settings, split_method, table

DEFAULT_METHODS = ["rdkv", "rdkv-aware", "snapkv", "adakv", "streaming", "knorm", "int4", "kivi4"]


@torch.no_grad()
def greedy(model, cache, ids: torch.Tensor, max_new: int, tok, start: int | None = None) -> str:
    """Feed ``ids`` [1, L] through ``cache`` and decode greedily until EOS, a blank line (the model moving on) or
    ``max_new`` tokens. ``start``: the absolute position of ``ids``' first token, passed explicitly (for a cache
    that holds fewer tokens than the positions it covers); None lets the cache's length give it."""
    out = []
    for _ in range(max_new):
        pos = None if start is None else torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        nxt = model(ids, **rdkv.cache_kwargs(cache), use_cache=True, logits_to_keep=1, position_ids=pos).logits[0, -1].argmax()
        start = None if start is None else start + ids.shape[1]
        if nxt.item() == tok.eos_token_id:
            break
        out.append(nxt.item())
        if "\n\n" in tok.decode(out).lstrip():
            break
        ids = nxt.view(1, 1)
    return tok.decode(out)


def prompts(tok, s: ruler.Sample, protocol: str, device) -> list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]]:
    """[(prefix to prefill, [(question index, ids fed through its cache)])]: one prefill for the query-agnostic
    protocol, one per question for the query-aware one."""
    enc = lambda text: tok(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device)  # noqa: E731
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    context = torch.cat([torch.tensor([bos], dtype=torch.long, device=device), enc(s.context)], 1)
    if protocol == "agnostic":
        return [(context, [(i, enc(q.text)) for i, q in enumerate(s.questions)])]
    out = []
    for i, q in enumerate(s.questions):
        ids = torch.cat([context, enc(q.text)], 1)
        out.append((ids[:, :-1], [(i, ids[:, -1:])]))
    return out


def cases(args) -> list[tuple]:
    return [(task, n, k, p) for n in args.contexts for task in args.tasks for k in range(args.samples) for p in args.protocols]


def press_caches(model, presses: list[str], budgets: list[float], prefix: torch.Tensor, full, todo):
    """Yield (``kvpress:<press>``, budget, cache, bytes/fp16) for every press and budget ``todo(name, budget)`` asks
    for, with the model's own attention, charged against the ``full`` cache's fp16 bytes (a masking press: the
    entries it leaves visible); the head masks are cleared once each cache has been answered."""
    import eval_kvpress as kvp

    fp16 = kvp.held_bytes(full)
    for name in presses:
        for b in budgets:
            if todo(f"kvpress:{name}", b):
                cache = kvp.press_prefill(model, name, b, prefix)
                visible = kvp.unmasked_fraction(model, cache, prefix.shape[1])
                yield f"kvpress:{name}", b, cache, visible if visible is not None else kvp.held_bytes(cache) / fp16
                kvp.clear_head_masks(model)


def run(args, model, tok, path) -> None:
    done = set()
    if path.exists():
        done = {json.loads(line)["key"] for line in path.read_text().splitlines() if line.strip()}
    device = next(model.parameters()).device
    all_queries = needs_all_queries(model, args.methods)
    plain = model.config._attn_implementation  # the presses' attention (rdkv.record installs its own)

    def answer_all(caches, start: int | None = None) -> None:
        """Answer the current prefix's questions (``asks``) through a copy of each cache; log each answer."""
        for m, b, cache, ratio in caches:
            for (i, ids), key in zip(asks, keys(m, b)):
                if key in done:
                    continue
                q = s.questions[i]
                answer = greedy(model, copy.deepcopy(cache), ids, s.max_new_tokens, tok, start)
                row = {"key": key, "task": task, "context": n, "sample": k, "protocol": protocol, "method": m,
                       "budget": b, "bytes/fp16": ratio, "question": i, "score": ruler.score(answer, q),
                       "answer": answer, "expected": list(q.answers)}
                log.write(json.dumps(row) + "\n")
                log.flush()
                done.add(key)

    with path.open("a") as log:
        for task, n, k, protocol in tqdm(cases(args), desc="cases"):
            s = ruler.sample(task, tok, n, args.seed + k, args.haystack)
            for prefix, asks in prompts(tok, s, protocol, device):
                keys = lambda m, b: [f"{task}|{n}|{k}|{protocol}|{m}|{b}|{i}" for i, _ in asks]  # noqa: E731
                missing = lambda m, b: any(key not in done for key in keys(m, b))  # noqa: E731
                todo = [m for m in args.methods  # a resumed case compresses only what it has not answered
                        if any(missing(m, b) for b in settings(split_method(m)[0], args.budgets))]
                pending = any(missing(f"kvpress:{p}", b) for p in args.presses for b in args.press_budgets)
                if not todo and not pending and not missing("full", None):
                    continue
                with rdkv.record(model, all_queries=all_queries) as rec:
                    full = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
                caches = [("full", None, full, 1.0)] + [
                    (m, b, c, c.nbytes / c.fp16_bytes) for m, b, c in compressions(rec, todo, args.budgets)]
                answer_all(caches)
                if pending:  # the presses run with the model's own attention, after rdkv's caches are answered
                    model.set_attn_implementation(plain)
                    answer_all(press_caches(model, args.presses, args.press_budgets, prefix, full, missing),
                               prefix.shape[1])


def summarise(rows: list[dict], tasks: list[str]) -> list[dict]:
    """One row per (protocol, context, method, budget): mean score per task (x100), their mean, % of full."""
    cells = defaultdict(lambda: defaultdict(list))
    ratio = defaultdict(list)
    for r in rows:
        cell = (r["protocol"], r["context"], r["method"], r["budget"])
        cells[cell][r["task"]].append(r["score"])
        ratio[cell].append(r["bytes/fp16"])
    out = []
    for (protocol, n, m, b), per in sorted(cells.items(), key=lambda x: (x[0][0], x[0][1], x[0][2] != "full",
                                                                        x[0][2], x[0][3] or 0)):
        scores = {t: 100 * sum(v) / len(v) for t, v in per.items()}
        row = {"protocol": protocol, "context": n, "method": m, "budget": b if b is not None else "-",
               "bytes/fp16": sum(ratio[protocol, n, m, b]) / len(ratio[protocol, n, m, b])}
        row |= {t: scores.get(t, float("nan")) for t in tasks}
        row["mean"] = sum(scores.values()) / len(scores)
        row["all 3 needles"] = "-"  # a cell with no multi-needle answer (a method run on some tasks only)
        if "multi_needle" in per:  # samples whose every needle was answered, of those with that task
            by_sample = defaultdict(list)
            for r in rows:
                if (r["task"], r["protocol"], r["context"], r["method"], r["budget"]) == ("multi_needle", protocol, n, m, b):
                    by_sample[r["sample"]].append(r["score"])
            row["all 3 needles"] = f"{sum(min(v) == 1 for v in by_sample.values())}/{len(by_sample)}"
        row["answers"] = sum(len(v) for v in per.values())
        out.append(row)
    full = {(r["protocol"], r["context"]): r["mean"] for r in out if r["method"] == "full"}
    for r in out:
        f = full.get((r["protocol"], r["context"]))
        r["% of full"] = 100 * r["mean"] / f if f else float("nan")
    return out


def main() -> None:
    ap = parser(__doc__, [0.025, 0.05, 0.1, 0.25], [4096])
    ap.set_defaults(methods=DEFAULT_METHODS)
    ap.add_argument("--tasks", nargs="+", default=list(ruler.TASKS), choices=ruler.TASKS)
    ap.add_argument("--samples", type=int, default=2, help="samples per task and context")
    ap.add_argument("--protocols", nargs="+", default=["agnostic", "aware"], choices=["agnostic", "aware"])
    ap.add_argument("--haystack", default="prose", choices=ruler.HAYSTACKS)
    ap.add_argument("--presses", nargs="+", default=[], metavar="PRESS",
                    help="kvpress presses to add (snapkv, adakv, expected, streaming, knorm, tova, kvzip); needs kvpress")
    ap.add_argument("--press-budgets", type=float, nargs="+", metavar="B",
                    help="the presses' budgets (fraction of tokens kept); default: --budgets")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--report-only", action="store_true", help="write the table and plot from the answers so far")
    args = ap.parse_args()
    if args.presses and kvpress is None:
        ap.error("--presses needs kvpress, which needs transformers < 5.3: run it as ./dev kvpress scripts/eval_ruler.py ...")
    if args.quick:
        args.samples, args.budgets = 1, [0.025, 0.1]
    args.press_budgets = args.press_budgets or args.budgets
    tag = args.tag or ("quick" if args.quick else "full")
    torch.set_grad_enabled(False)
    name = f"ruler_{args.model}_{tag}"
    path = RESULTS / f"{name}.jsonl"
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        model, tok = rdkv.models.load(args.model)
        run(args, model.to(args.device), tok, path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summary = summarise(rows, args.tasks)
    cols = ["protocol", "context", "method", "budget", "bytes/fp16", *args.tasks, "mean", "% of full", "answers"]
    cols += ["all 3 needles"] if "multi_needle" in args.tasks else []
    md = (f"# RULER-style tasks: {args.model} ({tag})\n\n{header(args)}\n"
          f"Haystack {args.haystack}; {args.samples} samples per task and context; score = share of the expected strings "
          f"in the greedy answer, x100 (scripts/ruler.py). Every answer: [`{name}.jsonl`]({name}.jsonl).\n\n"
          f"{table(summary, cols)}\n")
    publish(name, md)
    plot([dict(r, score=r["mean"]) for r in summary if r["method"] != "full"], "bytes/fp16", ["score"],
         RESULTS / f"{name}.png", f"RULER-style mean score, {args.model}")


if __name__ == "__main__":
    main()

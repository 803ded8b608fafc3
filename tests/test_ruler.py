"""The RULER-style task generator (scripts/ruler.py) and its runner (scripts/eval_ruler.py)."""
import argparse
import collections
import copy
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import rdkv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import eval_ruler  # noqa: E402
import ruler  # noqa: E402


def words(text: str, add_special_tokens: bool = False) -> dict:
    """A word-level tokenizer: the generator only counts tokens."""
    return {"input_ids": re.findall(r"\S+", text)}


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("n", [1000, 3000])
def test_every_task_fills_its_context_and_hides_its_answers_in_it(task, n):
    s = ruler.sample(task, words, n, seed=3)
    assert s.task == task and s.questions
    assert 0.9 * n <= len(words(s.context)["input_ids"]) <= 1.05 * n
    for q in s.questions:
        assert q.answers and all(a in s.context for a in q.answers)
        assert all(a not in q.text for a in q.answers)  # the question gives nothing away
    again = ruler.sample(task, words, n, seed=3)
    assert again == s and ruler.sample(task, words, n, seed=4) != s  # seeded


def test_needles_sit_at_their_depths_and_distractors_are_other_keys():
    s = ruler.sample("multi_needle", words, 3000, seed=0)
    at = [s.context.index(q.answers[0]) / len(s.context) for q in s.questions]
    assert at == sorted(at) and all(abs(a - d) < 0.08 for a, d in zip(at, (0.2, 0.5, 0.8)))
    m = ruler.sample("niah_multikey", words, 3000, seed=0)
    needles = ruler.NEEDLE.findall(m.context)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    assert (m.questions[0].text.split(" for ")[1].split(" mentioned")[0], m.questions[0].answers[0]) in needles


def test_variable_tracking_is_one_chain_from_the_value():
    s = ruler.sample("vt", words, 2000, seed=1)
    names = s.questions[0].answers
    lines = re.findall(r"VAR (\w+) = (VAR )?(\w+)", s.context)
    value = lines[0][2]
    assert lines[0][0] == names[0] and value.isdigit()
    assert [(b, a) for b, _, a in lines[1:]] == list(zip(names[1:], names[:-1]))  # each holds the one before


def test_common_words_are_the_most_frequent_in_the_list():
    s = ruler.sample("cwe", words, 3000, seed=2)
    counts = collections.Counter(re.findall(r"\d+\. (\w+)", s.context))
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(s.questions[0].answers) and min(counts[w] for w in top) == 30
    assert max(c for w, c in counts.items() if w not in top) == 3


def test_score_is_the_share_of_expected_strings_found():
    q = ruler.Question("?", ("1234567", "7654321"))
    assert ruler.score(" 1234567 and 7654321.", q) == 1.0
    assert ruler.score(" 1234567, then 1111111", q) == 0.5
    assert ruler.score(" none", q) == 0.0
    assert ruler.score(" ABCDE", ruler.Question("?", ("abcde",))) == 1.0  # case-insensitive


def test_summary_is_per_task_mean_and_share_of_the_full_cache():
    rows = [{"protocol": "agnostic", "context": 100, "method": m, "budget": b, "bytes/fp16": r, "task": t, "sample": k,
             "score": s} for m, b, r, t, k, s in [
        ("full", None, 1.0, "niah_single", 0, 1.0), ("full", None, 1.0, "multi_needle", 0, 1.0),
        ("full", None, 1.0, "multi_needle", 0, 1.0), ("rdkv", 0.1, 0.099, "niah_single", 0, 1.0),
        ("rdkv", 0.1, 0.099, "multi_needle", 0, 1.0), ("rdkv", 0.1, 0.099, "multi_needle", 0, 0.0),
        ("rdkv-x", 0.1, 0.1, "niah_single", 0, 1.0)]]
    full, got, single_only = eval_ruler.summarise(rows, ["niah_single", "multi_needle"])
    assert full["mean"] == 100 and full["all 3 needles"] == "1/1"
    assert got["multi_needle"] == 50 and got["mean"] == 75 and got["% of full"] == 75 and got["all 3 needles"] == "0/1"
    assert single_only["all 3 needles"] == "-" and single_only["mean"] == 100 and math.isnan(single_only["multi_needle"])


def test_a_run_on_a_real_model_scores_every_cache_and_resumes(tmp_path, monkeypatch):
    """SmolLM2 at 512 tokens: every method and budget answers every question once, in the file; a second run
    finds them all done and prefills nothing; a run after losing one method's answers compresses only that one."""
    model, tok = rdkv.models.load("smollm2-135m")
    args = argparse.Namespace(contexts=[512], tasks=["niah_single", "multi_needle"], samples=1, seed=0,
                              protocols=["agnostic", "aware"], methods=["rdkv", "snapkv", "int4"], budgets=[0.25],
                              haystack="prose", presses=[])
    path = tmp_path / "run.jsonl"
    eval_ruler.run(args, model, tok, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # niah_single: 1 question; multi_needle: 3, one prefill (agnostic) or three (aware); 4 caches each
    assert len(rows) == 2 * (1 + 3) * 4 and len({r["key"] for r in rows}) == len(rows)
    assert {r["method"] for r in rows} == {"full", "rdkv", "snapkv", "int4"}
    assert all(0 <= r["score"] <= 1 and r["score"] == ruler.score(r["answer"], ruler.Question("", tuple(r["expected"])))
               for r in rows)
    calls, real = [], rdkv.record
    monkeypatch.setattr(rdkv, "record", lambda *a, **k: calls.append(1) or real(*a, **k))
    eval_ruler.run(args, model, tok, path)
    assert not calls and len(path.read_text().splitlines()) == len(rows)
    # an interrupted case (snapkv's answers of the single-needle case lost): only snapkv is compressed again
    lost = [r for r in rows if r["method"] == "snapkv" and r["task"] == "niah_single"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r not in lost))
    asked, real_compressions = [], eval_ruler.compressions
    monkeypatch.setattr(eval_ruler, "compressions", lambda rec, methods, budgets: asked.append(list(methods))
                        or real_compressions(rec, methods, budgets))
    eval_ruler.run(args, model, tok, path)
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert asked == [["snapkv"]] * len(lost) and sorted(r["key"] for r in again) == sorted(r["key"] for r in rows)


def test_greedy_with_explicit_positions_answers_as_the_cache_length_does():
    """kvpress's caches are decoded with explicit positions (they hold fewer tokens than they cover): on a full
    cache, the answer with positions given from the prompt's length is the answer the cache's length gives."""
    model, tok = rdkv.models.load("smollm2-135m")
    s = ruler.sample("niah_single", tok, 512, 0, "prose")
    (prefix, [(_, ids)]), = eval_ruler.prompts(tok, s, "aware", "cpu")
    with torch.no_grad():
        cache = model(prefix, use_cache=True).past_key_values
    plain = eval_ruler.greedy(model, copy.deepcopy(cache), ids, 8, tok)
    assert plain.strip() and eval_ruler.greedy(model, copy.deepcopy(cache), ids, 8, tok, prefix.shape[1]) == plain


def test_needle_diagnosis_finds_every_needle_in_the_prompt_and_reports_each_layer(monkeypatch, capsys):
    """scripts/diag_needles.py on SmolLM2: the four multi-key needles are found at the tokens that spell them,
    every layer gets one row per method and budget whose cells are shares of those tokens (and of the cache's bytes,
    which add up to the whole), and each cache's greedy answer is printed beside the full cache's."""
    import diag_needles
    from conftest import load_real

    model, tok = load_real("smollm2-135m")
    s = ruler.sample("niah_multikey", tok, 1000, 0, "prose")
    ids = eval_ruler.prompts(tok, s, "aware", "cpu")[0][0][0].tolist()
    spans = diag_needles.needle_spans(tok, ids, s.context)
    assert len(spans) == 4 and [p.start for _, _, p in spans] == sorted(p.start for _, _, p in spans)
    for key, value, pos in spans:
        assert value in tok.decode(ids[pos.start : pos.stop]) and key.split("-")[0] in tok.decode(ids[pos.start : pos.stop])
    monkeypatch.setattr(diag_needles.rdkv.models, "load", lambda name: (model, tok))
    monkeypatch.setattr(sys, "argv", ["diag_needles.py", "--model", "smollm2-135m", "--context", "1000", "--budgets", "0.1"])
    diag_needles.main()
    out = capsys.readouterr().out.splitlines()
    rows = [r for r in out if r.startswith("| rdkv-aware | 0.1 | ")]
    assert len(rows) == model.config.num_hidden_layers + 1  # every layer, then the answer
    shares = [int(c.split("%")[0]) for r in rows[:-1] for c in r.split("|")[7:-1]]
    assert len(shares) == 4 * (len(rows) - 1) and all(0 <= x <= 100 for x in shares) and max(shares) > 0
    byte_shares = [float(r.split("|")[6].strip().rstrip("%")) for r in rows[:-1]]  # every layer is global here
    assert abs(sum(byte_shares) - 100) <= 0.05 * len(byte_shares)  # each rounded to 0.1%
    assert sum(r.startswith("| full | - | '") for r in out) == 1 and rows[-1].count("'") >= 2


def test_oracle_diagnosis_packs_the_allocation_with_one_part_changed_per_row(monkeypatch, capsys):
    """scripts/diag_oracles.py on Gemma 3 (sliding-window and global layers) at 1k: one row per oracle, in order. The
    allocation fits the budget; the cache with every token at 16 bits holds the full cache (its bytes plus the
    packed format's metadata) and answers as it does; each partial change costs less than that and more than the
    allocation (so the allocation keeps some K blocks as channel means), and at 2 bits less than at 16; a longer
    tail of the sliding-window layers costs more, and less without its keys raised or on five of those layers; one
    layer's evicted tokens cost less than every layer's and than that layer whole; a layer's bytes are its own (one
    layer at 16 bits plus every other layer at 16 bits is the allocation plus every layer at 16 bits)."""
    import diag_oracles
    from conftest import load_real

    model, tok = load_real("gemma3-270m")
    monkeypatch.setattr(diag_oracles.rdkv.models, "load", lambda name: (model, tok))
    monkeypatch.setattr(sys, "argv", ["diag_oracles.py", "--context", "1000", "--budget", "0.1", "--layers", "5",
                                      "--tails-on", "0,1,2,3,4"])
    diag_oracles.main()
    rows = [r.split(" | ") for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r][1:]
    names = [r[0][2:] for r in rows]
    assert names == ["full", "as allocated", "every token at 16 bits", "kept tokens at 16 bits",
                     "evicted tokens back at 16 bits", "evicted tokens back at 2 bits", "K blocks at 2 bits or more",
                     "sliding-window layers whole at 16 bits", "sliding-window layers whole at 2 bits",
                     *(f"sliding-window layers' last {n} tokens at 2 bits" for n in diag_oracles.TAILS),
                     "the same, last 128, K as allocated", "the same, last 256, K as allocated",
                     "layers 0,1,2,3,4's last 128 tokens at 2 bits", "layer 5 at 16 bits", "every layer but 5 at 16 bits",
                     "layer 5's evicted tokens back at 2 bits", "layer 5's evicted tokens back at 16 bits"]
    size = {n: float(r[1]) for n, r in zip(names, rows)}  # printed to 4 decimals
    answer = {n: r[2].rstrip(" |") for n, r in zip(names, rows)}
    assert 0.09 < size["as allocated"] <= 0.1  # the solver spends the budget but for page and K-group rounding
    # metadata over fp16: one position per kept row, K scales and zeros; measured 1.008 at 1k
    assert 1 < size["every token at 16 bits"] < 1.02 and answer["every token at 16 bits"] == answer["full"]
    for n in names[3:]:
        assert size["as allocated"] < size[n] < size["every token at 16 bits"], n
    for part in ("evicted tokens back at", "sliding-window layers whole at", "layer 5's evicted tokens back at"):
        assert size[f"{part} 2 bits"] < size[f"{part} 16 bits"]
    # a longer tail holds more, and less than the whole window at 16 bits
    tails = [size[f"sliding-window layers' last {n} tokens at 2 bits"] for n in diag_oracles.TAILS]
    assert tails == sorted(tails) and tails[0] < tails[-1] < size["sliding-window layers whole at 16 bits"]
    # the same tokens without raising K cost less; five of the fifteen layers' ends, less than all of them
    for n in (128, 256):
        assert size[f"the same, last {n}, K as allocated"] < size[f"sliding-window layers' last {n} tokens at 2 bits"]
    assert size["layers 0,1,2,3,4's last 128 tokens at 2 bits"] < size["sliding-window layers' last 128 tokens at 2 bits"]
    # one layer's evicted tokens are a part of every layer's, and of that layer whole
    assert size["layer 5's evicted tokens back at 16 bits"] < min(size["evicted tokens back at 16 bits"],
                                                                  size["layer 5 at 16 bits"])
    one, rest = size["layer 5 at 16 bits"], size["every layer but 5 at 16 bits"]
    assert abs(one + rest - size["as allocated"] - size["every token at 16 bits"]) < 3e-4  # four roundings

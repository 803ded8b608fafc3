"""RULER-style synthetic long-context tasks, generated here from the task definitions of RULER (Hsieh et al.,
"RULER: What's the Real Context Size of Your Long-Context Language Models?", 2024), over real text that ships
with Python and the system.

Every task gives a :class:`Sample`: a context of about ``n`` tokens, one or more questions, each with the strings
a correct greedy answer contains. A score is RULER's: the share of a question's expected strings found in the
answer (case-insensitive), averaged over questions and samples.

* ``niah_single``: one needle "One of the special magic numbers for <key> is: <7 digits>." in the haystack.
* ``niah_multikey``: the same, with three more needles of other keys (distractors).
* ``niah_multivalue``: four needles of one key with different values; all four are asked for.
* ``niah_multiquery``: four needles of four keys; the values of all four are asked for.
* ``vt`` (variable tracking): "VAR ABCDE = 12345", then "VAR FGHIJ = VAR ABCDE", ... spread over the haystack;
  the question asks for every variable that holds the value.
* ``cwe`` (common words extraction): a numbered list of words, ten of them repeated many times; the question
  asks for the ten most common.
* ``multi_needle``: three needles of three keys at depths 0.2 / 0.5 / 0.8, asked one at a time: one question per
  needle, every question after the same compression when the protocol is query-agnostic.

Haystacks: ``prose`` (Python's language reference), ``code`` (the standard library's own sources) and ``legal``
(Python's licence and the system's licence texts).
"""
from __future__ import annotations

import inspect
import random
import re
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HAYSTACKS = ("prose", "code", "legal")
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "multi_needle")


@dataclass(frozen=True)
class Question:
    text: str  # the question and the start of its answer, appended after the context
    answers: tuple[str, ...]  # every string a correct answer contains


@dataclass(frozen=True)
class Sample:
    task: str
    context: str
    questions: tuple[Question, ...]
    max_new_tokens: int  # greedy tokens a correct answer needs, with room


@cache
def haystack_text(name: str) -> str:
    if name == "prose":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    if name == "code":
        import argparse
        import collections
        import dataclasses
        import json
        import logging

        return "\n\n".join(inspect.getsource(m) for m in (argparse, collections, dataclasses, json, logging))
    if name == "legal":
        texts = [(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()]
        system = Path("/usr/share/common-licenses")
        texts += [p.read_text(errors="replace") for p in sorted(system.glob("*")) if p.is_file()] if system.is_dir() else []
        return "\n\n".join(texts)
    raise ValueError(f"unknown haystack {name!r}; choose one of {HAYSTACKS}")


def _paragraphs(name: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", haystack_text(name)) if p.strip()]


@cache
def _vocabulary() -> tuple[str, ...]:
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,9}\b", haystack_text("prose")))))


def _words(rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct lowercase words of the prose haystack."""
    return rng.sample([w for w in _vocabulary() if w not in exclude], n)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _key(rng: random.Random) -> str:
    return "-".join(_words(rng, 2))


class _Fill:
    """A haystack cut to a token count, with lines inserted at relative depths, at paragraph boundaries."""

    def __init__(self, tokenizer, haystack: str, rng: random.Random):
        self.count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])
        paras = _paragraphs(haystack)
        start = rng.randrange(len(paras))
        self.paras = paras[start:] + paras[:start]

    def build(self, n_tokens: int, inserts: list[tuple[float, str]]) -> str:
        room = n_tokens - sum(self.count(line + "\n\n") for _, line in inserts)
        chosen, sizes, total, i = [], [], 0, 0
        while True:
            p = self.paras[i % len(self.paras)]
            size = self.count(p + "\n\n")
            if chosen and total + size > room:  # the paragraph's first lines that still fit, then stop
                lines = p.split("\n")
                while lines and total + self.count("\n".join(lines) + "\n\n") > room:
                    lines.pop()
                if lines:
                    chosen.append("\n".join(lines))
                    sizes.append(self.count(chosen[-1] + "\n\n"))
                break
            chosen.append(p)
            sizes.append(size)
            total += size
            i += 1
        cumulative = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
        at = [min(range(len(cumulative)), key=lambda j: abs(cumulative[j] - d * total)) for d, _ in inserts]
        out = list(chosen)
        for j, (_, line) in sorted(zip(at, inserts), key=lambda x: -x[0]):  # from the back, so indices stay valid
            out.insert(j, line)
        return "\n\n".join(out)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")  # (key, value) of a _needle line


def _ask_one(key: str, value: str) -> Question:
    return Question(f"\n\nQuestion: What is the special magic number for {key} mentioned in the provided text?\n"
                    f"Answer: The special magic number for {key} mentioned in the provided text is", (value,))


def _depths(rng: random.Random, n: int) -> list[float]:
    return sorted(rng.uniform(0.05, 0.95) for _ in range(n))


def niah(tokenizer, n_tokens: int, rng: random.Random, task: str, haystack: str) -> Sample:
    fill = _Fill(tokenizer, haystack, rng)
    if task == "niah_single":
        key, value = _key(rng), _number(rng)
        lines = [_needle(key, value)]
        questions = (_ask_one(key, value),)
    elif task == "niah_multikey":
        keys, values = [_key(rng) for _ in range(4)], [_number(rng) for _ in range(4)]
        lines = [_needle(k, v) for k, v in zip(keys, values)]
        rng.shuffle(lines)
        questions = (_ask_one(keys[0], values[0]),)
    elif task == "niah_multivalue":
        key, values = _key(rng), [_number(rng) for _ in range(4)]
        lines = [_needle(key, v) for v in values]
        questions = (Question(f"\n\nQuestion: What are all the special magic numbers for {key} mentioned in the provided "
                              f"text?\nAnswer: The special magic numbers for {key} mentioned in the provided text are",
                              tuple(values)),)
    elif task == "niah_multiquery":
        keys, values = [_key(rng) for _ in range(4)], [_number(rng) for _ in range(4)]
        lines = [_needle(k, v) for k, v in zip(keys, values)]
        names = ", ".join(keys[:-1]) + f" and {keys[-1]}"
        questions = (Question(f"\n\nQuestion: What are all the special magic numbers for {names} mentioned in the "
                              f"provided text?\nAnswer: The special magic numbers for {names} mentioned in the provided "
                              "text are", tuple(values)),)
    elif task == "multi_needle":
        keys, values = [_key(rng) for _ in range(3)], [_number(rng) for _ in range(3)]
        context = fill.build(n_tokens, [(d, _needle(k, v)) for d, k, v in zip((0.2, 0.5, 0.8), keys, values)])
        return Sample(task, context, tuple(_ask_one(k, v) for k, v in zip(keys, values)), 16)
    else:
        raise ValueError(task)
    context = fill.build(n_tokens, list(zip(_depths(rng, len(lines)), lines)))
    return Sample(task, context, questions, 16 * len(questions[0].answers))


def variable_tracking(tokenizer, n_tokens: int, rng: random.Random, haystack: str, hops: int = 4) -> Sample:
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)]
    value = str(rng.randrange(10_000, 100_000))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    context = _Fill(tokenizer, haystack, rng).build(n_tokens, list(zip(_depths(rng, len(lines)), lines)))
    q = (f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above.\nAnswer: According "
         f"to the chain(s) of variable assignment in the text above, {len(names)} variables are assigned the value "
         f"{value}, they are:")
    return Sample("vt", context, (Question(q, tuple(names)),), 8 * len(names))


def common_words(tokenizer, n_tokens: int, rng: random.Random, n_common: int = 10, common_freq: int = 30,
                 rare_freq: int = 3) -> Sample:
    """RULER's cwe: the list is the whole context; ``n_common`` words appear ``common_freq`` times, as many others as
    fit appear ``rare_freq`` times each."""
    count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    common = _words(rng, n_common)
    head = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n")

    def build(n_rare: int) -> str:
        words = common * common_freq + _words(random.Random(rng.random()), n_rare, exclude=set(common)) * rare_freq
        random.Random(len(words)).shuffle(words)
        return head + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    n_rare = 0
    for _ in range(3):  # a numbered word's token count varies: measure, rescale, measure again
        size = count(build(n_rare))
        per_word = size / max(1, n_common * common_freq + n_rare * rare_freq)
        n_rare = max(0, int((n_tokens - count(head) - n_common * common_freq * per_word) / (rare_freq * per_word)))
    context = build(n_rare)
    q = (f"\n\nQuestion: What are the {n_common} most common words in the above list?\nAnswer: The top {n_common} "
         "words that appear most often in the list are:")
    return Sample("cwe", context, (Question(q, tuple(common)),), 6 * n_common)


def sample(task: str, tokenizer, n_tokens: int, seed: int, haystack: str = "prose") -> Sample:
    """One sample of ``task`` with a context of about ``n_tokens`` tokens; the same seed gives the same sample."""
    rng = random.Random(f"{task}/{n_tokens}/{seed}/{haystack}")
    if task.startswith("niah") or task == "multi_needle":
        return niah(tokenizer, n_tokens, rng, task, haystack)
    if task == "vt":
        return variable_tracking(tokenizer, n_tokens, rng, haystack)
    if task == "cwe":
        return common_words(tokenizer, n_tokens, rng)
    raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")


def score(answer: str, question: Question) -> float:
    """RULER's string match: the share of the expected strings the answer contains, case-insensitive."""
    a = answer.lower()
    return sum(s.lower() in a for s in question.answers) / len(question.answers)

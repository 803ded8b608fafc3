"""The experiment harness (scripts/common.py) on a tiny model: scores, skips and tables."""
import argparse
import copy
import sys
from pathlib import Path

import pytest
import torch

import rdkv
from conftest import recorded, tiny_gemma3, tiny_llama
from rdkv.calibrate import PriorFit, kl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import common  # noqa: E402


def test_scores_and_kl():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    tail = torch.tensor([[0, 1, 2]])
    nll, em, margin = common.answer_scores(logits, tail, 2)  # position 0 predicts 1, position 1 predicts 2
    assert em and abs(nll - 2 * float(-logits[0].log_softmax(-1)[1])) < 1e-6 and margin == 5.0
    logits[1, 1] = 5.5  # position 1 now prefers token 1 to the answer 2 by 0.5
    nll, em, margin = common.answer_scores(logits, tail, 2)
    assert not em and margin == -0.5
    probes = [{"depth": 0.1, "margin": 1.0}, {"depth": 0.1, "margin": -0.5}, {"depth": 0.5, "margin": 2.0}]
    assert common.by_depth(probes, [0.1, 0.5, 0.9]) == "+0.25 +2 -"  # mean per depth; no probe at 0.9
    assert kl(logits, logits) == 0.0
    assert kl(logits, logits.flip(0)) > 1.0
    assert abs(kl(logits.log_softmax(-1), logits.flip(0)) - kl(logits, logits.flip(0))) < 1e-6  # logits or log-probs


def test_compressions_run_every_method_once_per_budget_and_skip_what_cannot_fit():
    rec, _ = recorded(tiny_llama(7), torch.randint(0, 96, (1, 100)))
    methods = ["rdkv", "snapkv", "int8"]
    runs = common.compressions(rec, methods, [1e-4, 0.3], v_group=32, k_group=32, k_block=16)
    got = [(m, b, round(c.nbytes / c.fp16_bytes, 3)) for m, b, c in runs]
    assert [(m, b) for m, b, _ in got] == [("rdkv", 0.3), ("snapkv", 0.3), ("int8", None)]  # 1e-4 is skipped
    assert all(r <= 0.3 for m, b, r in got if b) and got[-1][2] > 0.5
    md = common.table([{"method": m, "budget": b, "bytes/fp16": r} for m, b, r in got], ["method", "budget", "bytes/fp16"])
    assert md.count("\n") == 4 and "| int8 | None |" in md


def test_method_overrides_reach_compress_and_bad_ones_are_refused():
    rec, _ = recorded(tiny_llama(7), torch.randint(0, 96, (1, 100)))
    method, options = common.split_method("rdkv-pool:surprisal=1,k_group=32,evict=False")
    assert method.name == "rdkv-pool" and method.weights.pool == 7 and method == rdkv.RDKV(weights=rdkv.methods.Weights(pool=7))
    assert options == {"surprisal": 1, "k_group": 32, "evict": False}
    assert common.split_method("snapkv:window=32") == ("snapkv", {"window": 32})  # a baseline's own options
    runs = common.compressions(rec, ["rdkv", "rdkv:evict=False"], [0.14], v_group=32, k_group=32, k_block=16)
    (_, _, plain), (_, _, kept) = list(runs)
    assert (plain.layers[0].v_widths() == 0).any()  # at 14% the default evicts some tokens
    assert (kept.layers[0].v_widths() > 0).all()  # evict=False reached compress
    assert common.needs_all_queries(rec.model, ["rdkv:weights=all"]) and not common.needs_all_queries(rec.model, ["auto", "snapkv"])
    for bad in ("nope", "rdkv:flor=1", "rdkv:floor", "rdkv:spec=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.split_method(bad)


def test_a_tuned_prior_goes_to_the_rdkv_methods_that_choose_none():
    """common.tune_prior's fit reaches compress as explicit floor/surprisal options, exactly where rdkv used
    to apply a tuned prior itself: RDKV methods with the default prior whose options set neither."""
    rec, _ = recorded(tiny_llama(7), torch.randint(0, 96, (1, 100)))
    fit, kw = PriorFit(3.0, 3.0, ()), dict(v_group=32, k_group=32, k_block=16)
    assert fit.options == {"floor": 3.0, "surprisal": 3.0}
    assert common.tune_prior(None, None, argparse.Namespace(tune_prior=False)) is None  # no --tune-prior: no fit
    given = {m: common.with_prior(rec.model, *common.split_method(m), fit) for m in
             ("rdkv", "auto", "rdkv-global", "rdkv:surprisal=1", "rdkv-aware", "rdkv-floor", "rdkv-noprior", "snapkv")}
    assert given == {"rdkv": fit.options, "auto": fit.options, "rdkv-global": fit.options,
                     "rdkv:surprisal=1": {"surprisal": 1}, "rdkv-aware": {}, "rdkv-floor": {}, "rdkv-noprior": {},
                     "snapkv": {}}
    assert common.with_prior(rec.model, "rdkv", {"k_group": 32}, None) == {"k_group": 32}
    methods = ["rdkv", "rdkv:floor=0", "rdkv-aware", "snapkv"]
    got = {m: c for m, _, c in common.compressions(rec, methods, [0.2], prior=fit, **kw)}
    plain = {m: c for m, _, c in common.compressions(rec, methods, [0.2], **kw)}
    tuned = rdkv.compress(rec, 0.2, method="rdkv", floor=3.0, surprisal=3.0, **kw)
    assert got["rdkv"].distortion == pytest.approx(tuned.distortion)
    assert got["rdkv"].distortion != pytest.approx(plain["rdkv"].distortion)  # the prior changes the allocation
    for m in methods[1:]:  # a prior of their own, or no prior at all: as without the fit
        assert all(torch.equal(x.v_widths(), y.v_widths()) for x, y in zip(got[m].layers, plain[m].layers))


def test_one_compressed_layer_can_stand_in_for_any_full_layer():
    """rdkv.calibrate's hybrids (used by diag_layers and fit_layer_gains): swapping every layer in gives the
    compressed cache's own logits, none gives the full cache's, and one layer gives something in between;
    sliding-window and global layers alike."""
    from rdkv.calibrate import plain_prefill, swap_in

    model = tiny_gemma3(3)
    ids = torch.randint(0, 96, (1, 90))
    prefix, tail = ids[:, :70], ids[:, 70:]
    with rdkv.record(model) as rec:
        full = plain_prefill(model, prefix)
    c = rdkv.compress(rec, 0.2, v_group=32, k_group=32, k_block=16)

    def through(cache) -> torch.Tensor:
        return common.forward(model, cache, tail)

    ref = through(copy.deepcopy(full))
    own = through(copy.deepcopy(c))
    n = len(c.layers)
    assert {rec.layers[i].sliding_window is None for i in range(n)} == {True, False}
    assert torch.allclose(through(swap_in(full, c, range(n))), own, atol=1e-5)
    assert torch.allclose(through(swap_in(full, c, [])), ref, atol=1e-5)
    assert kl(ref, own) > 1e-4  # the compression is not lossless, so the checks above can fail
    one = [kl(ref, through(swap_in(full, c, [i]))) for i in range(n)]
    assert all(0 < x < kl(ref, own) for x in one)


def test_perplexity_windows_leave_each_prefix_as_the_prefill_to_compress():
    """eval_perplexity.prefills: every window yields the record of its N-token prefix, the tail follows it
    and each target is the token after its tail position; scoring the full cache afterwards, even through
    the very cache the record refers to, does not change what compress sees."""
    import eval_perplexity

    class Chars:  # a tokenizer of one id per character: the script only calls tok(text, return_tensors=...)
        def __call__(self, text: str, return_tensors: str):
            return argparse.Namespace(input_ids=torch.tensor([[ord(c) % 96 for c in text]]))

    model = tiny_llama(4)
    ids = Chars()(common.domain_text("legal"), "pt").input_ids
    starts = eval_perplexity.windows(ids.shape[1], 40 + 8 + 1, 3)
    seen = 0
    for (domain, n, rec, full, tail, targets), a in zip(eval_perplexity.prefills(model, Chars(), ["legal"], [40], 8, 3),
                                                         starts):
        assert (domain, n, full.get_seq_length()) == ("legal", 40, 40)
        assert torch.equal(tail, ids[:, a + 40 : a + 48]) and torch.equal(targets, ids[0, a + 41 : a + 49])
        assert rec.closed and torch.equal(rec.ids, ids[:, a : a + 40])  # compress sees this window's prefix
        kw = dict(v_group=32, k_group=32, k_block=16)
        before = rdkv.compress(rec, 0.3, **kw)
        ref = common.forward(model, copy.deepcopy(full), tail)  # the full cache's logits
        assert ref.shape == (8, 96) and full.get_seq_length() == 40
        assert torch.equal(ref, common.forward(model, full, tail)) and full.get_seq_length() == 48
        after = rdkv.compress(rec, 0.3, **kw)
        assert all(torch.equal(x.v_widths(), y.v_widths()) for x, y in zip(before.layers, after.layers))
        assert torch.equal(rec.ids, ids[:, a : a + 40]) and all(st.seen == 40 for st in rec.layers.values())
        seen += 1
    assert seen == 3 and len(set(starts)) == 3

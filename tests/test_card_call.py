"""``rdkv.compress(model, budget)`` after an ordinary prefill, and ``rdkv.compress(cache, budget)``: the same cache
as the explicit record gives, nothing kept alive, and a defined "most recent prefill"."""
import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama
from rdkv.compat import cache_kwargs, output_cache


def same_cache(a: rdkv.TriZoneCache, b: rdkv.TriZoneCache) -> None:
    """Bit for bit: every stored tensor of every layer, and the bytes."""
    assert a.nbytes == b.nbytes and a.method == b.method
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.t.keys() == lb.t.keys()
        for name in la.t:
            assert torch.equal(la.t[name], lb.t[name]), name


def prompts(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(0, 96, (2 if padded else 1, 70))
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("arch, padded", [("llama", False), ("llama", True), ("gemma3", False), ("gemma3", True)])
def test_model_cache_and_record_compress_to_the_same_cache(arch, padded):
    """Batched and padded prompts; Gemma 3's sliding-window layers."""
    model = tiny_gemma3() if arch == "gemma3" else tiny_llama()
    ids, mask = prompts(padded)
    with rdkv.record(model) as rec:
        model(ids, attention_mask=mask, use_cache=True)
    want = rdkv.compress(rec, 0.3, **SMALL)
    out = model(ids, attention_mask=mask, use_cache=True)  # an ordinary prefill, after install (record ran it)
    same_cache(rdkv.compress(model, 0.3, **SMALL), want)
    same_cache(rdkv.compress(output_cache(out), 0.3, **SMALL), want)
    same_cache(rdkv.compress(model, 0.3, method="snapkv", **SMALL), rdkv.compress(rec, 0.3, method="snapkv", **SMALL))


def test_generate_prefill_is_recorded_too(llama):
    ids = torch.randint(0, 96, (1, 70))
    rdkv.install(llama)
    got = llama.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    rec, _ = recorded(llama, ids)
    cache = output_cache(got)
    same_cache(rdkv.compress(cache, 0.3, **SMALL), rdkv.compress(rec, 0.3, **SMALL))
    same_cache(rdkv.compress(llama, 0.3, fold=16, **SMALL), rdkv.compress(rec, 0.3, fold=16, **SMALL))


def test_dropping_the_output_frees_the_cache_and_its_record(llama):
    rdkv.install(llama)
    out = llama(torch.randint(0, 96, (1, 70)), use_cache=True)
    keys = weakref.ref(output_cache(out).layers[0].keys)
    rdkv.compress(llama, 0.3, **SMALL)
    del out
    assert keys() is None  # freed by reference counting alone: neither the model nor the record holds it
    with pytest.raises(rdkv.NotRecorded, match="most recent prefill is gone"):
        rdkv.compress(llama, 0.3, **SMALL)


def test_a_forward_through_the_cache_drops_its_record_and_compress_refuses(llama):
    """The most recent prefill is the last forward from an empty cache; a decode step through its cache makes
    compress refuse rather than compress the prefill while the cache holds more, and frees the prefill's tensors."""
    rdkv.install(llama)
    out = llama(torch.randint(0, 96, (1, 70)), use_cache=True)
    cache = output_cache(out)
    prefill_keys = weakref.ref(cache.layers[0].keys)
    llama(torch.randint(0, 96, (1, 1)), **cache_kwargs(cache), use_cache=True)
    gc.collect()
    assert prefill_keys() is None  # the cache holds the grown tensor; nothing holds the prefill's
    for source in (llama, cache):
        with pytest.raises(rdkv.NotRecorded, match="grown since its prefill"):
            rdkv.compress(source, 0.3, **SMALL)


def test_the_most_recent_of_two_prefills_is_compressed(llama):
    rdkv.install(llama)
    first = llama(torch.randint(0, 96, (1, 70)), use_cache=True)
    second = llama(torch.randint(0, 96, (1, 50)), use_cache=True)
    got = rdkv.compress(llama, 0.3, **SMALL)
    same_cache(got, rdkv.compress(output_cache(second), 0.3, **SMALL))
    assert got.get_seq_length() == 50
    assert rdkv.compress(output_cache(first), 0.3, **SMALL).get_seq_length() == 70


def test_never_installed_model_and_its_cache_are_refused_with_what_to_call(llama):
    out = llama(torch.randint(0, 96, (1, 70)), use_cache=True)
    for source in (llama, output_cache(out)):
        with pytest.raises(rdkv.NotRecorded, match=r"rdkv\.install\(model\)"):
            rdkv.compress(source, 0.3, **SMALL)
    with pytest.raises(rdkv.NotRecorded, match="no prefill since rdkv.install"):
        rdkv.compress(rdkv.install(tiny_llama(1)), 0.3, **SMALL)


def test_a_compressed_cache_or_other_object_is_refused(llama):
    rec, _ = recorded(llama, torch.randint(0, 96, (1, 70)))
    with pytest.raises(rdkv.RDKVError, match="already compressed"):
        rdkv.compress(rdkv.compress(rec, 0.3, **SMALL), 0.3)
    with pytest.raises(rdkv.RDKVError, match="takes a model after its prefill"):
        rdkv.compress("doc.rdkv", 0.3)


def test_card_call_on_a_real_model():
    """SmolLM2-135M as rdkv.models.load gives it (installed): the card's call, the cache form and the explicit
    record give the same next-token logits (1e-3, the same floats in fact) on one 600-token prefill; a plain
    transformers model of the same weights is refused with what to call."""
    model, tok = rdkv.models.load("smollm2-135m")
    probe = rdkv.models.retrieval_prompt(600, 0.5, tok)
    ids = tok(probe["context"], return_tensors="pt").input_ids
    tail = tok(probe["question"], return_tensors="pt", add_special_tokens=False).input_ids
    with rdkv.record(model) as rec:
        model(ids, use_cache=True, logits_to_keep=1)
    want = model(tail, **cache_kwargs(rdkv.compress(rec, 0.25))).logits[0, -1]
    out = model(ids, use_cache=True, logits_to_keep=1)
    by_model = rdkv.compress(model, budget=0.25)
    by_cache = rdkv.compress(output_cache(out), budget=0.25)
    keys = weakref.ref(output_cache(out).layers[0].keys)
    for cache in (by_model, by_cache):
        assert cache.nbytes <= 0.25 * cache.fp16_bytes
        torch.testing.assert_close(model(tail, **cache_kwargs(cache)).logits[0, -1], want, rtol=0, atol=1e-3)
    del out
    assert keys() is None
    with pytest.raises(rdkv.NotRecorded, match="gone"):
        rdkv.compress(model, budget=0.25)
    plain = AutoModelForCausalLM.from_pretrained(rdkv.models.converted_dir("smollm2-135m")).eval()
    plain_out = plain(ids[:, :64], use_cache=True)
    for source in (plain, output_cache(plain_out)):
        with pytest.raises(rdkv.NotRecorded, match=r"rdkv\.install\(model\)"):
            rdkv.compress(source, budget=0.25)

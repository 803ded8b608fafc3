"""rdkv.io: a saved cache loads back bit-identical and decodes the same tokens; damaged files are refused."""
import os

import pytest
import torch

from rdkv import layout
from safetensors import safe_open
from safetensors.torch import save_file

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama
from rdkv.io import load, save
from rdkv.trizone import TriZoneCache, pack_layer


def compressed(model, ids, budget=0.3, decode=3, **options):
    """record a prefill, compress it in pages, then decode ``decode`` tokens so zone C is not empty."""
    rec, _ = recorded(model, ids)
    cache = rdkv.compress(rec, budget, **{**SMALL, **options})
    for _ in range(decode):
        model(torch.randint(0, 96, (ids.shape[0], 1)), past_key_values=cache)
    return cache


def attrs(obj, skip: str) -> dict:
    """Public attributes (generate adds private bookkeeping such as ``_is_user_defined``)."""
    return {k: v for k, v in vars(obj).items() if k != skip and not k.startswith("_")}


def assert_identical(a, b):
    """Every tensor equal with the same dtype, and every other attribute of cache and layers equal
    (this also catches state added to TriZoneLayer later that save does not know about)."""
    assert attrs(a, "layers") == attrs(b, "layers")
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert attrs(la, "t") == attrs(lb, "t")
        assert la.t.keys() == lb.t.keys()
        for name in la.t:
            assert la.t[name].dtype == lb.t[name].dtype and torch.equal(la.t[name], lb.t[name]), name


@pytest.fixture(scope="module")
def saved_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("io") / "cache.safetensors"
    save(compressed(tiny_llama(), torch.randint(0, 96, (1, 80))), path)
    return path.read_bytes()


@pytest.fixture
def saved(tmp_path, saved_bytes):
    """A fresh copy of one saved cache per test (tests damage it)."""
    path = tmp_path / "cache.safetensors"
    path.write_bytes(saved_bytes)
    return path


def rewrite(path, drop=(), **meta):
    """Rewrite a saved file with safetensors' own writer, changing metadata or dropping tensors."""
    with safe_open(path, "pt") as f:
        md, t = f.metadata(), {n: f.get_tensor(n) for n in f.keys() if n not in drop}
    save_file(t, path, {**md, **meta})


def test_round_trip_is_bit_identical_and_decodes_the_same_tokens(tmp_path):
    model, ids = tiny_llama(), torch.randint(0, 96, (1, 100))
    cache = compressed(model, ids)
    assert layout.zone_c(cache.layers[0])[0].shape[2] == 3  # mid-generation: zone C is saved too
    save(cache, tmp_path / "c")
    got = load(tmp_path / "c")
    assert_identical(cache, got)
    nxt = torch.randint(0, 96, (1, 4))
    assert torch.equal(model(nxt, past_key_values=cache).logits, model(nxt, past_key_values=got).logits)
    prompt = torch.cat([ids, torch.randint(0, 96, (1, 7 + 5))], 1)  # 100 + 3 + 4 cached, 5 new
    want = model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(prompt, past_key_values=got, max_new_tokens=8, do_sample=False), want)
    save(got, tmp_path / "after")  # and again after a long zone C
    assert_identical(got, load(tmp_path / "after"))


def test_gemma3_sliding_window_cache_round_trips(tmp_path):
    model = tiny_gemma3()
    cache = compressed(model, torch.randint(0, 96, (1, 40)))
    assert cache.layers[0].sliding_window == 16 and cache.layers[0].start > 0
    save(cache, tmp_path / "g")
    got = load(tmp_path / "g")
    assert_identical(cache, got)
    for _ in range(14):  # 3 + 14 decode steps: past another window length (16)
        tok = torch.randint(0, 96, (1, 1))
        assert torch.equal(model(tok, past_key_values=cache).logits, model(tok, past_key_values=got).logits)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_load_places_tensors_on_the_device(saved, device):
    cache = load(saved, device=device)
    assert all(t.device == torch.device(device) for layer in cache.layers for t in layer.t.values())


def test_same_prefill_gives_byte_identical_files(tmp_path):
    ids = torch.randint(0, 96, (1, 90))
    model = tiny_llama()
    rec, _ = recorded(model, ids)
    save(rdkv.compress(rec, 0.3, **SMALL), tmp_path / "a")
    save(rdkv.compress(rec, 0.3, **SMALL), tmp_path / "b")
    other, _ = recorded(tiny_llama(), ids)  # a fresh model and a fresh prefill of the same tokens
    save(rdkv.compress(other, 0.3, **SMALL), tmp_path / "c")
    data = [(tmp_path / n).read_bytes() for n in "abc"]
    assert data[0] == data[1] == data[2]


def test_truncated_file_is_refused(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    with pytest.raises(rdkv.RDKVError, match="truncated"):
        load(saved)


def test_flipped_byte_in_tensor_data_fails_the_checksum(saved):
    data = bytearray(saved.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[(start + len(data)) // 2] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(rdkv.RDKVError, match="corrupted.*checksum"):
        load(saved)


def test_edited_metadata_fails_the_checksum(saved):
    rewrite(saved, cache='{"fp16_bytes": 1, "budget": 0.3, "layers": 2}')
    with pytest.raises(rdkv.RDKVError, match="checksum"):
        load(saved)


@pytest.mark.parametrize("version, msg", [("6", "newer rdkv: upgrade"), ("3", "older rdkv"), ("2", "older rdkv"),
                                          ("1", "older rdkv"), ("0", "version is unknown"),
                                          ("x", "version is unknown")])
def test_other_format_versions_are_refused(saved, version, msg):
    rewrite(saved, format_version=version)
    with pytest.raises(rdkv.CorruptFile, match=msg):
        load(saved)


def test_a_version_4_file_in_the_packed_layout_is_refused_naming_its_version(saved):
    """Version 4 held the packed layout: this rdkv reads pages only and says to compress again."""
    with safe_open(saved, "pt") as f:
        md = f.metadata()
    assert md["format_version"] == "5"
    rewrite(saved, format_version="4")
    want = (r"format version '4' and this rdkv reads versions 5; an older rdkv wrote it, in a layout this rdkv no "
            r"longer reads, or compress the prefix again")
    with pytest.raises(rdkv.CorruptFile, match=want):
        load(saved)


def segment(widths: list[int], *, k_width: int = 4, start: int = 0) -> rdkv.trizone.TriZoneLayer:
    """A one-stream layer packed directly (B = H = 1, head_dim 32), V widths per held token ``widths``."""
    T, D = len(widths), 32
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D, generator=g)
    return pack_layer(k, v, start, torch.tensor(widths).view(1, 1, T), torch.full((1, 1, D // 16), k_width),
                      torch.arange(D).view(1, 1, D), rdkv.PackSpec(**SMALL), torch.float16, None, start + T)


@pytest.mark.parametrize("k_width", [0, 16])
def test_a_segment_whose_streams_keep_no_token_round_trips(tmp_path, k_width):
    """No kept token: no page, zero bytes of pages (and the channel means alone at K width 0)."""
    layer = segment([0] * 40, k_width=k_width)
    assert layer.t["pages"].numel() == 0
    cache = TriZoneCache([layer], fp16_bytes=0)
    save(cache, tmp_path / "e")
    assert_identical(cache, load(tmp_path / "e"))


def test_positions_past_32767_round_trip(tmp_path):
    """A segment held past position 32767 stores its positions in int32 inside the pages."""
    cache = TriZoneCache([segment([2, 4, 8, 16, 0] * 8, start=40000)], fp16_bytes=0)
    cache.layers[0].c_start = cache.layers[0].prefix_len
    save(cache, tmp_path / "far")
    got = load(tmp_path / "far")
    assert_identical(cache, got)
    assert set(got.layers[0].dequantize()[2][0, :32].tolist()) == {40000 + i for i in range(40) if i % 5 != 4}


def test_folds_in_pages_round_trip(tmp_path):
    """Folds are validated as segments in pages without a zone C."""
    model, ids = tiny_llama(), torch.randint(0, 96, (1, 64))
    cache = compressed(model, ids, decode=0)
    method = rdkv.RDKV(spec=rdkv.PackSpec(**SMALL))
    cache.set_fold(rdkv.FoldPolicy(every=32, budget=0.3, keep=8, window=4, method=method))
    for _ in range(50):
        model(torch.randint(0, 96, (1, 1)), past_key_values=cache)
    assert cache.layers[0].folds
    save(cache, tmp_path / "f")
    got = load(tmp_path / "f")
    for la, lb in zip(cache.layers, got.layers):
        assert len(la.folds) == len(lb.folds)
        for fa, fb in zip(la.folds, lb.folds):
            assert fa.t.keys() == fb.t.keys() and all(torch.equal(fa.t[n], fb.t[n]) for n in fa.t)
    tok = torch.randint(0, 96, (1, 1))
    assert torch.equal(model(tok, past_key_values=cache).logits, model(tok, past_key_values=got).logits)


def test_a_safetensors_file_that_is_not_a_cache_is_refused(tmp_path):
    save_file({"w": torch.zeros(3)}, tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(rdkv.RDKVError, match="not an rdkv cache"):
        load(tmp_path / "model.safetensors")


def test_missing_tensor_is_named(saved):
    rewrite(saved, drop=("layers.1.k_perm",))
    with pytest.raises(rdkv.RDKVError, match=r"missing \['layers.1.k_perm'\]"):
        load(saved)


@pytest.mark.parametrize("content", [None, b"", b"abc", b"garbage " * 100, os.urandom(4096)])
def test_missing_or_garbage_files_are_refused(tmp_path, content):
    path = tmp_path / "x"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(rdkv.RDKVError, match="does not exist" if content is None else "not a complete safetensors"):
        load(path)
    with pytest.raises(rdkv.RDKVError, match="is a directory"):
        load(tmp_path)


def test_save_refuses_what_is_not_a_compressed_cache(tmp_path):
    from transformers import DynamicCache

    with pytest.raises(rdkv.RDKVError, match="TriZoneCache"):
        save(DynamicCache(), tmp_path / "x")


def test_failed_save_keeps_the_old_file_and_leaves_no_temp(saved, monkeypatch):
    before = saved.read_bytes()
    cache = load(saved)

    def broken(f, tensors, meta):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("rdkv.io._write", broken)
    with pytest.raises(OSError, match="disk full"):
        save(cache, saved)
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]


def test_bfloat16_cache_round_trips(tmp_path):
    cache = compressed(tiny_llama(dtype=torch.bfloat16), torch.randint(0, 96, (1, 60)), decode=2)
    assert cache.layers[0].dtype16 == torch.bfloat16 and layout.zone_c(cache.layers[0])[0].dtype == torch.bfloat16
    save(cache, tmp_path / "bf")
    assert_identical(cache, load(tmp_path / "bf"))


def test_v_group_per_width_round_trips(tmp_path):
    rec, _ = recorded(tiny_llama(2), torch.randint(0, 96, (1, 80)))
    cache = rdkv.compress(rec, 0.3, v_group=(32, 16, 8), k_group=32, k_block=16)
    assert cache.layers[0].spec.v_group == (32, 16, 8)
    save(cache, tmp_path / "w")
    assert_identical(cache, load(tmp_path / "w"))


def test_rotated_values_round_trip(tmp_path):
    model, ids = tiny_llama(3), torch.randint(0, 96, (1, 80))
    rec, _ = recorded(model, ids)
    cache = rdkv.compress(rec, 0.3, v_rotate=True, **SMALL)
    save(cache, tmp_path / "r")
    got = load(tmp_path / "r")
    assert got.layers[0].spec.v_rotate
    assert_identical(cache, got)
    nxt = torch.randint(0, 96, (1, 4))
    assert torch.equal(model(nxt, past_key_values=cache).logits, model(nxt, past_key_values=got).logits)

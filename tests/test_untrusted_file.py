"""A cache file is untrusted input: a crafted ``.rdkv`` whose checksum was recomputed with the file's own format
loads as ``CorruptFile`` naming what is wrong, or is a well-formed cache that every decode path (the C kernels, the
torch path, the oracle) decodes alike. Never a crash, a NaN or a read outside the file's tensors."""
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import rdkv
from conftest import SMALL, tiny_gemma3, tiny_llama
from rdkv import pages, quant, rope
from rdkv.compat import cache_kwargs
from rdkv.trizone import pack_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from fuzz_cache_file import fuzz, kept, made as make, positions, put_position, read, step, write


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(model, file, each decode path's logits): a 2-layer Llama cache in pages with every V class and K width in
    use and one decode step in zone C (scripts/fuzz_cache_file.py)."""
    return make(tmp_path_factory.mktemp("untrusted"))


# --- the crafted files of the report, each refused and named -------------------------------------------------

def craft(path, edit) -> None:
    tensors, meta, top, layers = read(path)
    edit(tensors, top, layers)
    write(path, tensors, meta, top, layers)


def move_rows(n: int | None, cls: int = 1):
    """Move ``n`` class rows (one more than stream 0 holds for None) from stream 0 to stream 1."""
    def edit(tensors, top, layers):
        c = tensors["layers.0.v_counts"].clone()
        m = int(c[0, cls]) + 1 if n is None else n
        c[0, cls] -= m
        c[1, cls] += m
        tensors["layers.0.v_counts"] = c
    return edit


def spec(**kw):
    def edit(tensors, top, layers):
        layers[0]["spec"].update(kw)
    return edit


def field(**kw):
    def edit(tensors, top, layers):
        layers[0].update(kw)
    return edit


def table(name: str, index, value):
    def edit(tensors, top, layers):
        x = tensors[f"layers.0.{name}"].clone()
        x.view(-1)[index] = value
        tensors[f"layers.0.{name}"] = x
    return edit


def resized(name: str, by: int):
    """Tensor ``name`` of layer 0 ``by`` elements longer (shorter where negative)."""
    def edit(tensors, top, layers):
        x = tensors[f"layers.0.{name}"]
        tensors[f"layers.0.{name}"] = x[:by] if by < 0 else torch.cat([x, x.new_zeros(by)])
    return edit


def dropped(name: str):
    def edit(tensors, top, layers):
        del tensors[f"layers.0.{name}"]
        layers[0]["tensors"].remove(name)
    return edit


def added(name: str, x: torch.Tensor):
    def edit(tensors, top, layers):
        tensors[f"layers.0.{name}"] = x
        layers[0]["tensors"].append(name)
    return edit


def position(value):
    """Layer 0's first kept token's position set to ``value``."""
    def edit(tensors, top, layers):
        put_position(tensors, layers[0], 0, 0, value)
    return edit


def positions_swapped(tensors, top, layers):
    """Two consecutive tokens of one (stream, V class) swap positions: the packer's order broken."""
    s, cls, _, _ = kept(tensors, layers[0], 0)
    j = next(j for j in range(len(s) - 1) if s[j] == s[j + 1] and cls[j] == cls[j + 1])
    pos = positions(tensors, layers[0], 0)
    put_position(tensors, layers[0], 0, j, pos[j + 1])
    put_position(tensors, layers[0], 0, j + 1, pos[j])


def position_twice(tensors, top, layers):
    """A token takes the position of a token of another V class of its stream, its own class still in order."""
    s, cls, _, _ = kept(tensors, layers[0], 0)
    pos = positions(tensors, layers[0], 0)

    def neighbour(k, d):
        return pos[k + d] if 0 <= k + d < len(pos) and s[k + d] == s[k] and cls[k + d] == cls[k] else None

    k, j = next((k, j) for k in range(len(pos)) for j in range(len(pos)) if s[j] == s[k] and cls[j] != cls[k]
                and (neighbour(k, -1) is None or neighbour(k, -1) < pos[j])
                and (neighbour(k, 1) is None or pos[j] < neighbour(k, 1)))
    put_position(tensors, layers[0], 0, k, pos[j])


def bad_16bit(where: str, bits: int):
    """The 16-bit word ``bits`` (an fp16 NaN or Inf) written into layer 0's pages: at the first K scale (``scale``)
    or in the last, empty slot of a partly filled class-16 page (``empty``: its V row, which the page kernel
    loads and weighs by zero)."""
    def edit(tensors, top, layers):
        lay = layers[0]
        spec, D, L = rdkv.PackSpec(**lay["spec"]), lay["head_dim"], lay["prefix_len"] - lay["start"]
        p = pages.plan({n: tensors[f"layers.0.{n}"] for n in ("v_counts", "k_bits")}, spec, D, lay["prefix_len"],
                       pages.page_tokens(D, spec, L))
        if where == "scale":
            s = int((p.chans[:, 1:4].sum(1) > 0).nonzero()[0])
            at = int(p.class_base[s][p.pages[s] > 0][0] + p.k_meta[s])
        else:
            s = int((p.counts[:, 3] % p.page > 0).nonzero()[0])
            last = p.class_base[s, 3] + (p.pages[s, 3] - 1) * p.page_size[s, 3]
            at = int(last + p.v_off[s] + (p.page - 1) * 2 * D)
        x = tensors["layers.0.pages"].clone()
        x[at:at + 2] = torch.tensor([bits], dtype=torch.int16).view(torch.uint8)
        tensors["layers.0.pages"] = x
    return edit


def unknown_fold_key(tensors, top, layers):
    top["fold"] = {**asdict(rdkv.FoldPolicy(every=64, budget=0.3, method=rdkv.RDKV(spec=rdkv.PackSpec(**SMALL)))),
                   "bogus": 1}


def drop_layer(tensors, top, layers):
    last = len(layers) - 1
    for n in [n for n in tensors if n.startswith(f"layers.{last}.")]:
        del tensors[n]
    layers.pop()
    top["layers"] -= 1
    if top["layer_distortion"] is not None:
        top["layer_distortion"].pop()


CRAFTED = {
    "10^6 class-4 rows moved across streams": (move_rows(10**6), "v_counts holds a negative count"),
    "one class-4 row more than a stream holds moved": (move_rows(None), "negative count"),
    "a count past the stream's positions": (table("v_counts", 0, 2**31 - 1), "v_counts keeps more tokens"),
    "a class-4 row moved across streams": (move_rows(1), "pages"),  # its size, or the positions it then holds
    "v_group=2 at 2 bits": (spec(v_group=[2, 32, 32]), "multiples of 4"),
    "v_group larger than head_dim": (spec(v_group=64), "must divide head_dim"),
    "c_start = 10^12": (field(c_start=10**12), "c_start"),
    "sliding_window = -5": (field(sliding_window=-5), "sliding_window"),
    "k_group = 0": (spec(k_group=0), "k_group"),
    "k_block = 0": (spec(k_block=0), "k_block"),
    "k_bits = 3": (table("k_bits", 0, 3), "k_bits must hold widths"),
    "k_bits = 255": (table("k_bits", 0, 255), "k_bits must hold widths"),
    "k_bits unsorted": (table("k_bits", 0, 16), "k_bits must hold widths in .* sorted"),
    "a K width the pages were not packed at": (table("k_bits", 1, 4), r"tensor 'pages': expected \(\d+,\) torch.uint8"),
    "a k_perm entry 200": (table("k_perm", 0, 200), "k_perm is not a permutation"),
    "a k_perm entry repeated": (table("k_perm", 0, 1), "k_perm is not a permutation"),
    "head_dim 32 -> 64": (field(head_dim=64), "expected"),
    "head_dim = 10^9": (field(head_dim=10**9), "head_dim"),
    "start past prefix_len": (field(start=10**6), "start"),
    "a position -1": (position(-1), r"pages holds a position outside \[0, 150\)"),
    "a position at prefix_len": (position(150), "pages holds a position outside"),
    "a position 2^15 - 1": (position(2**15 - 1), "pages holds a position outside"),
    "two positions of a class swapped": (positions_swapped, "do not increase within a stream's V class"),
    "a position held twice in a stream": (position_twice, "pages holds a position twice in one stream"),
    "pages one page short": (resized("pages", -16), "tensor 'pages': expected"),
    "pages 16 bytes long": (resized("pages", 16), "tensor 'pages': expected"),
    "pages missing": (dropped("pages"), "tensor 'pages': expected .* got missing"),
    "k_mean one mean short": (resized("k_mean", -1), "tensor 'k_mean': expected"),
    "a NaN channel mean": (table("k_mean", 0, float("nan")), "tensor 'k_mean' holds NaN"),
    "a NaN K scale in a page": (bad_16bit("scale", 0x7E00), "pages holds a NaN or Inf"),
    "an Inf V row in an empty slot": (bad_16bit("empty", 0x7C00), "pages holds a NaN or Inf"),
    "a packed-layout tensor beside the pages": (added("pos", torch.zeros(3, dtype=torch.int16)),
                                                r"unexpected tensors \['pos'\]"),
    "an unknown spec key": (spec(bogus=1), "bogus"),
    "an unknown fold key": (unknown_fold_key, "bogus"),
    "batch = 2^31": (field(batch=2**31 - 1), "batch"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_files_are_refused_naming_the_field(made, tmp_path, case):
    model, src, _ = made
    path = tmp_path / "crafted.rdkv"
    path.write_bytes(src.read_bytes())
    edit, match = CRAFTED[case]
    craft(path, edit)
    with pytest.raises(rdkv.CorruptFile, match=match):
        rdkv.load(path)


def test_a_cache_decodes_only_with_the_model_it_was_made_for(made, tmp_path):
    model, src, _ = made
    with pytest.raises(rdkv.RDKVError, match="compressed for another model.*num_hidden_layers: cache 2, model 3"):
        step(rdkv.install(tiny_gemma3()), rdkv.load(src), "c")
    other = rdkv.install(tiny_llama(3))
    other.config.num_hidden_layers = 3  # a config that differs in one field only
    with pytest.raises(rdkv.RDKVError, match="another model"):
        other(torch.tensor([[5]]), **cache_kwargs(rdkv.load(src)))
    path = tmp_path / "short.rdkv"  # 1 layer for a 2-layer model, and no signature (a cache made without a model)
    path.write_bytes(src.read_bytes())
    tensors, meta, top, layers = read(path)
    drop_layer(tensors, top, layers)
    top.pop("model")
    write(path, tensors, meta, top, layers)
    with pytest.raises(rdkv.RDKVError, match="the cache has 1 layers, the model 2"):
        step(model, rdkv.load(path), "c")


# --- the fuzz test: systematic mutations of every header field and count table ----------------------------------

def test_fuzzed_files_are_refused_or_decode_alike(made, tmp_path):
    """A fixed seed, every scalar and pack-spec field of every layer and samples of every count table (a few
    hundred files): each is refused, or is a well-formed cache every path decodes alike (scripts/fuzz_cache_file.py,
    which runs more)."""
    model, src, want = made
    seen = fuzz(model, src, want, tmp_path, seed=0, per_table=6)
    assert seen["refused"] > 200 and seen["same"] > 10 and sum(seen.values()) > 250, seen


# --- saving and reading files ------------------------------------------------------------------------------------

def test_saves_are_private_keep_a_mode_and_clean_up_after_a_killed_save(made, tmp_path):
    import os
    import subprocess

    _, src, _ = made
    cache = rdkv.load(src)
    old = os.umask(0)
    try:
        rdkv.save(cache, tmp_path / "new.rdkv")
    finally:
        os.umask(old)
    assert (tmp_path / "new.rdkv").stat().st_mode & 0o777 == 0o600  # new files: the owner's only, whatever the umask
    (tmp_path / "shared.rdkv").write_bytes(b"")
    (tmp_path / "shared.rdkv").chmod(0o640)
    rdkv.save(cache, tmp_path / "shared.rdkv")
    assert (tmp_path / "shared.rdkv").stat().st_mode & 0o777 == 0o640  # saved over: its mode kept
    # a save killed before its rename leaves its temporary file; the next save into the folder removes it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f".x.rdkv.{int(dead.stdout)}.{'0' * 32}.tmp"
    mine = tmp_path / f".y.rdkv.{os.getpid()}.{'1' * 32}.tmp"  # a live process's save in progress: kept
    leftover.write_bytes(b"partial")
    mine.write_bytes(b"partial")
    rdkv.save(cache, tmp_path / "new.rdkv")
    assert not leftover.exists() and mine.exists()


@pytest.mark.parametrize("what", ["/dev/zero", "fifo"])
def test_device_files_and_fifos_are_not_regular_files(tmp_path, what):
    import os

    path = what
    if what == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    with pytest.raises(rdkv.RDKVError, match="is not a regular file"):
        rdkv.load(path)


def test_a_file_rewritten_after_load_changes_nothing_loaded(made, tmp_path):
    """The tensors are read once and copied: truncating or rewriting the file under a loaded cache (another process
    saving over it) neither faults the process nor changes what it decodes."""
    model, src, want = made
    path = tmp_path / "doc.rdkv"
    path.write_bytes(src.read_bytes())
    cache = rdkv.load(path)
    with open(path, "wb"):
        pass
    torch.testing.assert_close(step(model, cache, "c"), want["c"], rtol=0, atol=0)


# --- the validator on segments packed directly -------------------------------------------------------------------

def packed(*, D=32, T=50, start=0, dtype16=torch.float16, keep=True, H=2, seed=0):
    """A layer in pages (zone C empty) and the keyword arguments rdkv.pages.check_pages takes for it."""
    g = torch.Generator().manual_seed(seed)
    spec, widths = rdkv.PackSpec(**SMALL), torch.tensor(quant.WIDTHS)
    v_width = widths[torch.randint(0, 5, (1, H, T), generator=g)] if keep else torch.zeros(1, H, T, dtype=torch.long)
    k_bits = widths[torch.randint(0, 5, (1, H, D // spec.k_block), generator=g)]
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(H)]).view(1, H, D)
    k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)
    layer = pack_layer(k, v, start, v_width, k_bits, perm, spec, dtype16, None, start + T)
    return layer, dict(batch=1, heads=H, head_dim=D, start=start, prefix_len=start + T, spec=spec, sliding_window=None,
                       dtype16=dtype16)


@pytest.mark.parametrize("case", ["fp16", "bf16", "int32 positions", "head_dim 512", "no kept token", "long",
                                  "rope table", "decode queries", "fold"])
def test_check_pages_accepts_every_segment_the_packer_makes(case):
    layer, kw = packed(**{"bf16": dict(dtype16=torch.bfloat16), "int32 positions": dict(start=40000),
                          "head_dim 512": dict(D=512, T=20), "no kept token": dict(keep=False),
                          "long": dict(T=1000, H=1)}.get(case, {}))
    t = dict(layer.t)
    if case == "rope table":
        t["rope"] = torch.zeros(rope.rope_bytes(kw["head_dim"]) // 4)
    if case == "decode queries":
        t["qwin"] = torch.zeros(1, 4, 3, kw["head_dim"], dtype=kw["dtype16"])
    if case == "fold":
        del t["kc"], t["vc"]
    pages.check_pages(t, zone_c=case != "fold", **kw)
    if case == "no kept token":
        assert t["pages"].numel() == 0
    if case == "fold":  # a fold holds no zone C; a layer must
        with pytest.raises(rdkv.RDKVError, match="tensor 'kc': expected"):
            pages.check_pages(t, **kw)


def test_check_pages_checks_every_16_bit_value_of_the_pages():
    """A NaN in any 16-bit word of a K or V section (scales, zeros, 16-bit rows) is refused, in bf16 rows too; the
    code and position bytes are not 16-bit values."""
    for dtype16 in (torch.float16, torch.bfloat16):
        layer, kw = packed(dtype16=dtype16, T=70)
        p = pages.segment_plan(layer)
        masks = pages._pages16(p, kw["head_dim"], kw["spec"], dtype16)
        words = sorted({int(i) for m in masks.values() for i in m.nonzero()[:, 0]})
        nan = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}
        for w in words[:: max(1, len(words) // 50)]:
            t = dict(layer.t)
            x = t["pages"].clone()
            is16 = dtype16 in masks and bool(masks[dtype16][w]) and dtype16 != quant.META_DTYPE
            x[2 * w:2 * w + 2] = torch.tensor([nan[dtype16 if is16 else quant.META_DTYPE]], dtype=torch.int16
                                              ).view(torch.uint8)
            t["pages"] = x
            with pytest.raises(rdkv.RDKVError, match="pages holds a NaN or Inf"):
                pages.check_pages(t, **kw)

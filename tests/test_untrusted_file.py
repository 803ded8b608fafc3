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
from rdkv.compat import cache_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from fuzz_cache_file import fuzz, made as make, read, step, write


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(model, file, each decode path's logits): a 2-layer Llama cache with every V class and several K widths in
    use and one decode step in zone C (scripts/fuzz_cache_file.py)."""
    return make(tmp_path_factory.mktemp("untrusted"))


# --- the crafted files of the report, each refused and named -------------------------------------------------

def craft(path, edit) -> None:
    tensors, meta, top, layers = read(path)
    edit(tensors, top, layers)
    write(path, tensors, meta, top, layers)


def move_rows(n: int, cls: int = 1):
    def edit(tensors, top, layers):
        c = tensors["layers.0.v_counts"].clone()
        c[0, cls] -= n
        c[1, cls] += n
        tensors["layers.0.v_counts"] = c
        tensors["layers.0.k_bits"] = torch.zeros_like(tensors["layers.0.k_bits"])
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


def nan_scale(tensors, top, layers):
    name = next(n for n in sorted(tensors) if n.startswith("layers.0.") and n.endswith(".scale") and tensors[n].numel())
    x = tensors[name].clone()
    x.view(-1)[0] = float("nan")
    tensors[name] = x


def unknown_fold_key(tensors, top, layers):
    top["fold"] = {**asdict(rdkv.FoldPolicy(every=64, budget=0.3, method=rdkv.RDKV(spec=rdkv.PackSpec(**SMALL)))),
                   "bogus": 1}


def drop_layer(tensors, top, layers):
    last = len(layers) - 1
    for n in [n for n in tensors if n.startswith(f"layers.{last}.")]:
        del tensors[n]
    layers.pop()
    top["layers"] -= 1
    top["layer_distortion"].pop()


CRAFTED = {
    "10^6 class-4 rows moved across streams": (move_rows(10**6), "v_counts holds a negative count"),
    "65 class-4 rows moved across streams": (move_rows(65), "negative count"),
    "a count past the stream's positions": (table("v_counts", 0, 2**31 - 1), "v_counts keeps more tokens"),
    "v_group=2 at 2 bits": (spec(v_group=[2, 32, 32]), "multiples of 4"),
    "v_group larger than head_dim": (spec(v_group=64), "must divide head_dim"),
    "c_start = 10^12": (field(c_start=10**12), "c_start"),
    "sliding_window = -5": (field(sliding_window=-5), "sliding_window"),
    "k_group = 0": (spec(k_group=0), "k_group"),
    "k_block = 0": (spec(k_block=0), "k_block"),
    "k_bits = 3": (table("k_bits", 0, 3), "k_bits must hold widths"),
    "k_bits = 255": (table("k_bits", 0, 255), "k_bits must hold widths"),
    "a k_perm entry 200": (table("k_perm", 0, 200), "k_perm is not a permutation"),
    "head_dim 32 -> 64": (field(head_dim=64), "expected"),
    "head_dim = 10^9": (field(head_dim=10**9), "head_dim"),
    "start past prefix_len": (field(start=10**6), "start"),
    "a position out of range": (table("pos", 0, -1), "pos holds a position outside"),
    "an unknown spec key": (spec(bogus=1), "bogus"),
    "an unknown fold key": (unknown_fold_key, "bogus"),
    "a NaN scale": (nan_scale, "NaN"),
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
    path = tmp_path / "short.rdkv"  # 1 layer for a 2-layer model, and no signature (a version-3 file)
    path.write_bytes(src.read_bytes())
    tensors, meta, top, layers = read(path)
    drop_layer(tensors, top, layers)
    top.pop("model")
    write(path, tensors, {**meta, "format_version": "3"}, top, layers)
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

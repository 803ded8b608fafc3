"""A cache file is untrusted input: a crafted ``.rdkv`` whose checksum was recomputed with the file's own format
loads as ``CorruptFile`` naming what is wrong, or is a well-formed cache that every decode path (the C kernels, the
torch path, the oracle) decodes alike. Never a crash, a NaN or a read outside the file's tensors."""
import json
import random
from dataclasses import asdict

import numpy as np
import pytest
import torch
from safetensors import safe_open

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama
from rdkv.compat import cache_kwargs
from rdkv.io import _checksum, _write

PATHS = ("c", "torch", "reference")


def resign(path, tensors: dict, meta: dict) -> None:
    """Write ``tensors`` and ``meta`` as rdkv.save would, with the checksum recomputed (what an attacker can do)."""
    meta = dict(meta)
    meta["sha256"] = _checksum(tensors, meta)
    with open(path, "wb") as f:
        _write(f, tensors, meta)


def read(path) -> tuple[dict, dict, dict, list]:
    with safe_open(path, "pt") as f:  # copied: the file is rewritten in place next
        tensors, meta = {n: f.get_tensor(n).clone() for n in f.keys()}, dict(f.metadata())
    return tensors, meta, json.loads(meta["cache"]), json.loads(meta["layers"])


def write(path, tensors, meta, top, layers) -> None:
    resign(path, tensors, {**meta, "cache": json.dumps(top), "layers": json.dumps(layers, sort_keys=True)})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A 2-layer Llama cache with every V class and several K widths in use, one decode step in zone C, and
    the next-token logits each decode path gives for it."""
    model = rdkv.install(tiny_llama(3))
    ids = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(0))
    rec, _ = recorded(model, ids)
    cache = rdkv.compress(rec, 0.3, **SMALL)
    model(ids[:, :1], **cache_kwargs(cache))
    path = tmp_path_factory.mktemp("untrusted") / "doc.rdkv"
    rdkv.save(cache, path)
    want = {p: step(model, rdkv.load(path), p) for p in PATHS}
    return model, path, want


def step(model, cache, path: str) -> torch.Tensor:
    """Next-token logits of one decode step through ``cache`` on one decode path."""
    import os

    from rdkv.kernels import cpu_dequant

    old_backend, library = os.environ.get("RDKV_BACKEND"), cpu_dequant.library
    os.environ["RDKV_BACKEND"] = "reference" if path == "reference" else "torch"
    if path == "torch":
        cpu_dequant.library = lambda: None
    try:
        return model(torch.tensor([[5]]), **cache_kwargs(cache)).logits[0, -1]
    finally:
        cpu_dequant.library = library
        if old_backend is None:
            del os.environ["RDKV_BACKEND"]
        else:
            os.environ["RDKV_BACKEND"] = old_backend


def outcome(model, path, want: dict) -> str:
    """'refused' at load, or at decode with an RDKVError on every path; else the file describes a valid cache
    (a mutation can make another valid one: two streams' permutations swapped), and every path decodes it to
    finite logits that agree with the oracle's, 'same' where they are the original's. A read past a buffer or
    of a wrong row would make the C path disagree."""
    try:
        rdkv.load(path)
    except rdkv.CorruptFile:
        return "refused"
    got = {}
    for p in PATHS:
        try:
            got[p] = step(model, rdkv.load(path), p)
        except rdkv.RDKVError:
            got[p] = None
    if all(g is None for g in got.values()):
        return "refused"
    assert all(g is not None for g in got.values()), f"only some decode paths refuse: {[p for p in got if got[p] is None]}"
    for p in PATHS:
        assert torch.isfinite(got[p]).all(), f"{p}: NaN/Inf logits from a file that loaded"
        torch.testing.assert_close(got[p], got["reference"], rtol=1e-4, atol=1e-4, msg=f"{p} disagrees with the oracle")
    return "same" if all(torch.equal(got[p], want[p]) for p in PATHS) else "valid"


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

SCALARS = ("batch", "heads", "head_dim", "start", "prefix_len", "c_start", "sliding_window")
SPEC = ("v_group", "k_group", "k_block")
TABLES = ("v_counts", "k_bits", "k_perm", "pos")


def mutations(x, rng: random.Random) -> list:
    """What an attacker tries on an integer field: sign flip, +-1, +-2, +-2^31, zero, huge."""
    x = x if isinstance(x, int) else 1
    return [-x, x + 1, x - 1, x + 2, x - 2, x + 2**31, x - 2**31, 0, 2**63 - 1, rng.randint(-1000, 1000)]


def cases(tensors, layers, rng: random.Random):
    for i in range(len(layers)):
        for name in SCALARS:
            for v in mutations(layers[i][name], rng):
                yield f"layers.{i}.{name}={v}", ("field", i, name, v)
        for name in SPEC:
            for v in mutations(layers[i]["spec"][name] if name != "v_group" else 32, rng):
                yield f"layers.{i}.spec.{name}={v}", ("spec", i, name, v)
        for name in TABLES:
            x = tensors[f"layers.{i}.{name}"]
            for _ in range(6):
                j = rng.randrange(x.numel())
                v = rng.choice([-1, 1, 2**31 - 1, -(2**31), 0, 255, 3, int(x.view(-1)[j]) + 1])
                yield f"layers.{i}.{name}[{j}]={v}", ("table", i, name, (j, v))
            if x.dim() == 2 and x.shape[0] > 1:  # a swap between streams
                yield f"layers.{i}.{name} streams swapped", ("swap", i, name, None)


def apply(tensors, layers, kind, i, name, v) -> None:
    if kind == "field":
        layers[i][name] = v
    elif kind == "spec":
        layers[i]["spec"][name] = v
    else:
        key = f"layers.{i}.{name}"
        x = tensors[key].clone()
        if kind == "swap":
            x[[0, 1]] = x[[1, 0]]
        else:
            j, value = v
            info = torch.iinfo(x.dtype)
            x.view(-1)[j] = int(np.clip(value, info.min, info.max))  # what the stored dtype can hold
        tensors[key] = x


def test_fuzzed_files_are_refused_or_decode_the_same(made, tmp_path):
    """A fixed seed, every scalar and pack-spec field of every layer and samples of every count table (a few
    hundred files): each is refused, or decodes what the original decodes on every path.
    ``python scripts/fuzz_cache_file.py`` runs the same with more samples."""
    model, src, want = made
    tensors, meta, top, layers = read(src)
    rng = random.Random(0)
    seen = {"refused": 0, "same": 0, "valid": 0}
    path = tmp_path / "fuzzed.rdkv"
    for label, (kind, i, name, v) in cases(tensors, layers, rng):
        t2, l2 = dict(tensors), json.loads(json.dumps(layers))
        apply(t2, l2, kind, i, name, v)
        write(path, t2, meta, top, l2)
        try:
            seen[outcome(model, path, want)] += 1
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from e
    print(seen)
    assert seen["refused"] > 200 and sum(seen.values()) > 250, seen


# --- saving and reading files ------------------------------------------------------------------------------------

def test_saves_are_private_keep_a_mode_and_clean_up_after_a_killed_save(made, tmp_path):
    import os
    import subprocess
    import sys

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

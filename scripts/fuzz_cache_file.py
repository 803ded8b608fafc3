"""Fuzz a saved cache file: mutate every header field and integer table of its segments in pages (``v_counts``,
``k_bits``, ``k_perm`` and the positions stored inside ``pages``), re-sign each file with a recomputed checksum (what
anyone can do with the file's own format), load it and decode one step on every decode path.

    python scripts/fuzz_cache_file.py --cases 5000 --seed 1

Each file must be refused (``CorruptFile`` at load, or ``RDKVError`` at decode on every path), or be a well-formed
cache that every path decodes to finite logits agreeing with the oracle ("same" where they equal the original's;
"valid" where a mutation made another valid cache, e.g. two streams' permutations swapped). A crash, a NaN or a
path that disagrees ends the run with the case that did it. The cache is a random-weight Llama's (2 layers, GQA,
head_dim 32) prefill packed in pages at a random allocation using every V class and K width, with one decode step
in zone C, the one tests/test_untrusted_file.py fuzzes with a few hundred cases.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

import rdkv
from rdkv import layout, pages, quant
from rdkv.compat import cache_kwargs, output_cache
from rdkv.io import _checksum, _write
from rdkv.kernels import cpu_dequant
from rdkv.trizone import TriZoneCache, model_signature, pack_layer

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


def kept(tensors: dict, layer: dict, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """Layer ``i``'s kept tokens from the file's counts and K widths (:mod:`rdkv.pages`): the stream and V class of
    each, the byte address of its position inside the layer's ``pages``, and the positions' dtype."""
    spec, D, end = rdkv.PackSpec(**layer["spec"]), layer["head_dim"], layer["prefix_len"]
    t = {n: tensors[f"layers.{i}.{n}"] for n in ("v_counts", "k_bits")}
    p = pages.plan(t, spec, D, end, pages.page_tokens(D, spec, end - layer["start"]))
    at = pages._Slots(p)
    return at.s, at.cls, pages._pos_addresses(p, at, D, spec, end), layout.pos_dtype(end)


def positions(tensors: dict, layer: dict, i: int) -> list[int]:
    """The positions stored in layer ``i``'s pages, one per kept token in storage order."""
    _, _, addr, dtype = kept(tensors, layer, i)
    return pages._get(tensors[f"layers.{i}.pages"], addr, dtype).tolist()


def put_position(tensors: dict, layer: dict, i: int, j: int, value: int) -> None:
    """Store ``value`` (clipped to the stored dtype) as the position of layer ``i``'s ``j``-th kept token."""
    *_, addr, dtype = kept(tensors, layer, i)
    info = torch.iinfo(dtype)
    key = f"layers.{i}.pages"
    x = tensors[key].clone()
    x[addr[j] + torch.arange(info.bits // 8)] = torch.tensor([int(np.clip(value, info.min, info.max))],
                                                             dtype=dtype).view(torch.uint8)
    tensors[key] = x


def step(model, cache, path: str) -> torch.Tensor:
    """Next-token logits of one decode step through ``cache`` on one decode path."""
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


SCALARS = ("batch", "heads", "head_dim", "start", "prefix_len", "c_start", "sliding_window")
SPEC = ("v_group", "k_group", "k_block")
TABLES = ("v_counts", "k_bits", "k_perm")  # with the positions inside "pages": every integer table of a segment


def mutations(x, rng: random.Random) -> list:
    """What an attacker tries on an integer field: sign flip, +-1, +-2, +-2^31, zero, huge."""
    x = x if isinstance(x, int) else 1
    return [-x, x + 1, x - 1, x + 2, x - 2, x + 2**31, x - 2**31, 0, 2**63 - 1, rng.randint(-1000, 1000)]


def cases(tensors, layers, rng: random.Random, per_table: int = 6):
    for i in range(len(layers)):
        for name in SCALARS:
            for v in mutations(layers[i][name], rng):
                yield f"layers.{i}.{name}={v}", ("field", i, name, v)
        for name in SPEC:
            for v in mutations(layers[i]["spec"][name] if name != "v_group" else 32, rng):
                yield f"layers.{i}.spec.{name}={v}", ("spec", i, name, v)
        for name in TABLES:
            x = tensors[f"layers.{i}.{name}"]
            for _ in range(per_table):
                j = rng.randrange(x.numel())
                v = rng.choice([-1, 1, 2**31 - 1, -(2**31), 0, 255, 3, int(x.view(-1)[j]) + 1])
                yield f"layers.{i}.{name}[{j}]={v}", ("table", i, name, (j, v))
            if x.dim() == 2 and x.shape[0] > 1:  # a swap between streams
                yield f"layers.{i}.{name} streams swapped", ("swap", i, name, None)
        pos = positions(tensors, layers[i], i)
        for _ in range(per_table):
            j = rng.randrange(len(pos))
            v = rng.choice([-1, 1, 2**31 - 1, -(2**31), 0, 255, pos[j] + 1, pos[j - 1], pos[-1] + 1])
            yield f"layers.{i}.positions[{j}]={v}", ("position", i, "pages", (j, v))


def apply(tensors, layers, kind, i, name, v) -> None:
    if kind == "field":
        layers[i][name] = v
    elif kind == "spec":
        layers[i]["spec"][name] = v
    elif kind == "position":
        put_position(tensors, layers[i], i, *v)
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


def allocated(model, ids: torch.Tensor, seed: int) -> TriZoneCache:
    """The prefill of ``ids`` packed in pages at a fixed random allocation: every V class in each layer, every K width
    in some, partly filled pages (what a file may hold, whatever the solver would choose)."""
    g = torch.Generator().manual_seed(seed)
    spec, widths = rdkv.PackSpec(v_group=32, k_group=32, k_block=16), torch.tensor(quant.WIDTHS)
    layers = []
    for i, kv in enumerate(output_cache(model(ids, use_cache=True)).layers):
        B, H, T, D = kv.keys.shape
        nb = D // spec.k_block
        v_width = widths[torch.randint(0, len(widths), (B, H, T), generator=g)]
        k_bits = widths[(torch.arange(B * H * nb) + i) % len(widths)].view(B, H, nb)
        perm = torch.stack([torch.randperm(D, generator=g) for _ in range(B * H)]).view(B, H, D)
        layers.append(pack_layer(kv.keys, kv.values, 0, v_width, k_bits, perm, spec, torch.float16, None, T))
    return TriZoneCache(layers, fp16_bytes=sum(layout.fp16_bytes(T, H * D) for _ in layers), budget=None,
                        method=None, model=model_signature(model))


def made(folder: Path, seed: int = 3) -> tuple[torch.nn.Module, Path, dict]:
    """(model, saved file, each path's logits for it): a random-weight Llama's cache in pages (:func:`allocated`),
    one decode step in zone C."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
    model = rdkv.install(LlamaForCausalLM(cfg).eval())
    ids = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(0))
    cache = allocated(model, ids, seed)
    model(ids[:, :1], **cache_kwargs(cache))
    path = folder / "doc.rdkv"
    rdkv.save(cache, path)
    return model, path, {p: step(model, rdkv.load(path), p) for p in PATHS}


def fuzz(model, src: Path, want: dict, folder: Path, seed: int, per_table: int, limit: int | None = None) -> dict:
    """Run the cases (:func:`cases`) with ``seed``; the outcome counts. Raises on the first bad outcome."""
    tensors, meta, top, layers = read(src)
    rng = random.Random(seed)
    seen = {"refused": 0, "same": 0, "valid": 0}
    path = folder / "fuzzed.rdkv"
    for n, (label, (kind, i, name, v)) in enumerate(cases(tensors, layers, rng, per_table)):
        if limit is not None and n >= limit:
            break
        t2, l2 = dict(tensors), json.loads(json.dumps(layers))
        apply(t2, l2, kind, i, name, v)
        write(path, t2, meta, top, l2)
        try:
            seen[outcome(model, path, want)] += 1
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from e
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        model, src, want = made(Path(tmp))
        per_table = max(6, (args.cases - 206) // 8)  # 3 tables and the positions x 2 layers; fields, swaps: 206
        seen = fuzz(model, src, want, Path(tmp), args.seed, per_table, args.cases)
    print(f"{sum(seen.values())} files: {seen}")


if __name__ == "__main__":
    main()

"""Save a compressed cache to one safetensors file and load it back, bit for bit.

Users compress a long shared prefix once and reuse it, so the file must be safe to load (safetensors
holds raw tensors only: loading never runs code, unlike pickle), must say which layout it holds (a
format name and an integer version, checked before anything else), and must refuse to hand back a cache
that is not the one saved (a sha256 over every tensor and the metadata, checked on load).

File layout: tensor ``layers.{i}.{name}`` is ``cache.layers[i].t[name]`` (zone C included, so a cache
mid-generation round-trips) and ``layers.{i}.folds.{j}.{name}`` the tensors of its j-th fold. String
metadata: ``format``, ``format_version``, ``cache`` (JSON: fp16_bytes, budget, layer count, method, modelled
distortion per layer, fold policy), ``layers`` (JSON list: each layer's scalars, its PackSpec, its 16-bit dtype
name, the names of its tensors and its folds' spans and tensor names) and ``sha256``.

The container is written here rather than by ``safetensors.torch.save_file``: that writer emits the
metadata in hash-map order, which differs from run to run, and equal caches must give equal bytes. The
file is read back with safetensors itself, which validates the header, offsets and file size.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import asdict
from typing import IO

import torch
from safetensors import SafetensorError, safe_open

from .errors import CorruptFile, RDKVError
from .fold import FoldPolicy
from .trizone import PackSpec, TriZoneCache, TriZoneLayer

FORMAT = "rdkv.trizone"
VERSION = 3  # 2: per-layer modelled distortion, a V group size per width; 3: the fold policy names its method
_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
           torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
           torch.bool: "BOOL"}
_DTYPE16 = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # a whitelist: names never reach getattr


def _bytes(t: torch.Tensor):
    """The tensor's raw little-endian bytes, without a copy for contiguous CPU tensors."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in name order, then the metadata JSON."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{_DTYPES[t.dtype]}\0{list(t.shape)}\0{t.numel() * t.element_size()}\0".encode())
        h.update(_bytes(t))
    h.update(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    return h.hexdigest()


def _write(f: IO[bytes], tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """A safetensors container in a fixed order: widest dtypes first (so every tensor stays aligned
    after the 8-byte-padded header), then by name; metadata keys sorted."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {"__metadata__": dict(sorted(meta.items()))}
    off = 0
    for n in order:
        t = tensors[n]
        size = t.numel() * t.element_size()
        header[n] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + size]}
        off += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for n in order:
        f.write(_bytes(tensors[n]))


def save(cache: TriZoneCache, path: str | os.PathLike) -> None:
    """Write ``cache`` (as ``rdkv.compress`` returned it, or after decoding on it) to ``path``.

    The file appears atomically: it is written to a temporary file in the same folder and renamed over
    ``path``, so a crash or a full disk never leaves a half-written cache under the final name.
    """
    if not isinstance(cache, TriZoneCache) or not all(isinstance(x, TriZoneLayer) for x in cache.layers):
        raise RDKVError(f"rdkv.save takes the TriZoneCache rdkv.compress returned, got {type(cache).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        dtype16 = next((k for k, v in _DTYPE16.items() if v == layer.dtype16), None)
        if dtype16 is None:
            raise RDKVError(f"layer {i}: 16-bit dtype {layer.dtype16} is not float16 or bfloat16; cannot save it")
        for prefix, part in [(f"layers.{i}", layer)] + [(f"layers.{i}.folds.{j}", f) for j, f in enumerate(layer.folds)]:
            for name, t in part.t.items():
                if t.dtype not in _DTYPES:
                    raise RDKVError(f"layer {i} tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
                tensors[f"{prefix}.{name}"] = t.detach().to("cpu").contiguous()
        layers.append({"batch": layer.batch, "heads": layer.heads, "head_dim": layer.head_dim, "start": layer.start,
                       "prefix_len": layer.prefix_len, "c_start": layer.c_start, "spec": asdict(layer.spec),
                       "sliding_window": layer.sliding_window, "dtype16": dtype16, "tensors": sorted(layer.t),
                       "folds": [{"start": f.start, "end": f.prefix_len, "tensors": sorted(f.t)} for f in layer.folds]})
    policy = cache.layers[0].fold if cache.layers else None
    meta = {"format": FORMAT, "format_version": str(VERSION),
            "cache": json.dumps({"fp16_bytes": cache.fp16_bytes, "budget": cache.budget, "layers": len(layers),
                                 "method": cache.method, "layer_distortion": cache.layer_distortion,
                                 "fold": None if policy is None else asdict(policy)}),
            "layers": json.dumps(layers, sort_keys=True)}
    meta["sha256"] = _checksum(tensors, meta)
    path = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{base}.{uuid.uuid4().hex}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:  # umask applies
            _write(f, tensors, meta)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> TriZoneCache:
    """Read a cache written by :func:`save`, verify it, and place its tensors on ``device``.

    Raises :class:`rdkv.RDKVError` for a missing path and :class:`rdkv.CorruptFile` saying what is wrong
    with the file (truncated, not a cache, another format version, missing tensors, or a checksum mismatch)
    rather than returning a cache that could
    decode wrong tokens.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise RDKVError(f"cannot load a cache from {path!r}: it {what}; pass the file rdkv.save wrote")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta, names = f.metadata() or {}, set(f.keys())
    except (SafetensorError, OSError) as e:
        raise CorruptFile(f"{path!r} is not a complete safetensors file ({e}); it is truncated or not an rdkv "
                        "cache: save the cache again with rdkv.save") from e
    if meta.get("format") != FORMAT:
        raise CorruptFile(f"{path!r} is a safetensors file but not an rdkv cache (format {meta.get('format')!r}, "
                        f"expected {FORMAT!r}); load files written by rdkv.save")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        version = None
    if version != VERSION:
        hint = ("it was written by a newer rdkv: upgrade rdkv to read it" if version is not None and version > VERSION
                else "an older rdkv wrote it, in a layout this rdkv no longer reads" if version is not None and version >= 1
                else "that version is unknown")
        raise CorruptFile(f"{path!r} has rdkv cache format version {meta.get('format_version')!r} and this rdkv reads "
                        f"version {VERSION}; {hint}, or compress the prefix again")
    try:
        top, layers = json.loads(meta["cache"]), json.loads(meta["layers"])
        want = {f"layers.{i}.{n}" for i, lay in enumerate(layers) for n in lay["tensors"]}
        want |= {f"layers.{i}.folds.{j}.{n}" for i, lay in enumerate(layers) for j, f in enumerate(lay.get("folds", []))
                 for n in f["tensors"]}
        if top["layers"] != len(layers):
            raise ValueError(f"{top['layers']} layers announced, {len(layers)} described")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptFile(f"{path!r}: the rdkv metadata is malformed ({e}); the file is damaged, save it again") from e
    if names != want:
        missing, extra = sorted(want - names), sorted(names - want)
        raise CorruptFile(f"{path!r} does not hold the tensors its metadata lists (missing {missing[:5]}"
                        f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}); the file is damaged, save it again")
    with safe_open(path, framework="pt", device="cpu") as f:
        tensors = {n: f.get_tensor(n) for n in sorted(names)}
    if _checksum(tensors, meta) != meta.get("sha256"):
        raise CorruptFile(f"{path!r} is corrupted: its sha256 checksum does not match its contents; "
                        "save the cache again from the original (or compress the prefix again)")
    out = []
    for i, lay in enumerate(layers):
        if lay["dtype16"] not in _DTYPE16:
            raise CorruptFile(f"{path!r} layer {i}: unknown 16-bit dtype {lay['dtype16']!r}")
        shape = dict(batch=lay["batch"], heads=lay["heads"], head_dim=lay["head_dim"], spec=PackSpec(**lay["spec"]),
                     sliding_window=lay["sliding_window"], dtype16=_DTYPE16[lay["dtype16"]])
        t = {n: tensors[f"layers.{i}.{n}"].to(device) for n in lay["tensors"]}
        layer = TriZoneLayer(t, start=lay["start"], prefix_len=lay["prefix_len"], **shape)
        layer.c_start = lay.get("c_start", lay["prefix_len"])
        for j, f in enumerate(lay.get("folds", [])):
            ft = {n: tensors[f"layers.{i}.folds.{j}.{n}"].to(device) for n in f["tensors"]}
            layer.folds.append(TriZoneLayer(ft, start=f["start"], prefix_len=f["end"], **shape))
        out.append(layer)
    per_layer = top.get("layer_distortion")
    cache = TriZoneCache(out, fp16_bytes=top["fp16_bytes"], budget=top["budget"], method=top.get("method"),
                         layer_distortion=None if per_layer is None else tuple(per_layer))
    if top.get("fold"):
        cache.set_fold(FoldPolicy.from_dict(top["fold"]))
    return cache

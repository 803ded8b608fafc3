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

import contextlib
import hashlib
import json
import os
import re
import stat
import uuid
from dataclasses import asdict
from typing import IO

import torch
import safetensors.torch
from safetensors import SafetensorError

from . import layout, pages
from .errors import CorruptFile, RDKVError
from .fold import FoldPolicy
from .layout import POSITION_LIMIT, PackSpec
from .trizone import SIGNATURE, TriZoneCache, TriZoneLayer

FORMAT = "rdkv.trizone"
# 2: per-layer modelled distortion, a V group size per width; 3: the fold policy names its method; 4: the model the cache
# was compressed for; 5: segments in pages (rdkv.pages). Versions 1-4 hold the packed layout, which is no longer read
VERSION = 5
READS = (5,)
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


_LEFTOVER = re.compile(r"\..+\.(\d+)\.[0-9a-f]{32}\.tmp")


def _remove_leftovers(folder: str) -> None:
    """Remove the temporary files of saves into ``folder`` whose process is gone (killed mid-save)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = _LEFTOVER.fullmatch(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
        except (PermissionError, OverflowError):  # another user's live process, or no pid at all
            continue


def save(cache: TriZoneCache, path: str | os.PathLike) -> None:
    """Write ``cache`` (as ``rdkv.compress`` returned it, or after decoding on it) to ``path``.

    The file appears atomically: it is written to a temporary file in the same folder (named after the writing
    process) and renamed over ``path``, so a crash or a full disk never leaves a half-written cache under the final
    name; the temporary files of saves killed before their rename are removed by the next save into that folder. A
    new file is created 0600 (a cache holds what its prompt said), one saved over keeps its mode.

    Args:
        cache: the :class:`TriZoneCache` to write.
        path: the file to write.
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
                                 "fold": None if policy is None else asdict(policy), "model": cache.model}),
            "layers": json.dumps(layers, sort_keys=True)}
    meta["sha256"] = _checksum(tensors, meta)
    path = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(path))
    _remove_leftovers(folder)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)  # a file saved over keeps its mode
    except OSError:
        mode = 0o600  # a KV cache holds what its prompt said: readable by its owner only
    tmp = os.path.join(folder, f".{base}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            _write(f, tensors, meta)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> TriZoneCache:
    """Read a cache written by :func:`save`, verify it, and place its tensors on ``device``.

    A file is untrusted input: the checksum only shows it is what some writer wrote. Every field is checked
    before anything is built or sized by it (:func:`rdkv.pages.check_pages`): scalars in range, the pack spec
    legal, every count, position, permutation and width table consistent with the pages it indexes, their
    dtypes and shapes exactly what the packer makes, 16-bit values, scales and zeros finite, the fold policy and
    spans well formed. The model the cache was compressed for is recorded in it, and decoding with another
    raises (:meth:`rdkv.TriZoneCache.check_model`).

    Raises :class:`rdkv.RDKVError` for a path that is not a regular file and :class:`rdkv.CorruptFile` saying
    what is wrong with the file (truncated, not a cache, another format version, missing tensors, a checksum
    mismatch, or the field that is out of range; a file of format version 4 or older holds the packed layout, which
    this rdkv no longer reads) rather than returning a cache that could decode wrong tokens.

    Args:
        path: a file :func:`save` wrote.
        device: where the cache's tensors are placed (after they are checked, on the CPU).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = ("is a directory" if os.path.isdir(path) else "is not a regular file" if os.path.exists(path)
                else "does not exist")
        raise RDKVError(f"cannot load a cache from {path!r}: it {what}; pass the file rdkv.save wrote")
    try:
        # one read, then copies: a tensor mapped from the file would change, or fault the process (SIGBUS), when
        # the file is rewritten or truncated after the checksum was verified
        with open(path, "rb") as f:
            raw = f.read()
        tensors = safetensors.torch.load(raw)
        meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")]).get("__metadata__") or {}
        names = set(tensors)
        del raw
    except (SafetensorError, OSError, ValueError, AttributeError) as e:
        raise CorruptFile(f"{path!r} is not a complete safetensors file ({e}); it is truncated or not an rdkv "
                        "cache: save the cache again with rdkv.save") from e
    if meta.get("format") != FORMAT:
        raise CorruptFile(f"{path!r} is a safetensors file but not an rdkv cache (format {meta.get('format')!r}, "
                        f"expected {FORMAT!r}); load files written by rdkv.save")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        version = None
    if version not in READS:
        hint = ("it was written by a newer rdkv: upgrade rdkv to read it" if version is not None and version > VERSION
                else "an older rdkv wrote it, in a layout this rdkv no longer reads" if version is not None and version >= 1
                else "that version is unknown")
        raise CorruptFile(f"{path!r} has rdkv cache format version {meta.get('format_version')!r} and this rdkv reads "
                        f"versions {', '.join(map(str, READS))}; {hint}, or compress the prefix again")
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
    if _checksum(tensors, meta) != meta.get("sha256"):
        raise CorruptFile(f"{path!r} is corrupted: its sha256 checksum does not match its contents; "
                        "save the cache again from the original (or compress the prefix again)")
    try:
        cache = _build(top, layers, tensors)
    except (RDKVError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptFile(f"{path!r}: {e}; the file is damaged or was not written by rdkv.save: save it again") from e
    return _placed(cache, device)


def _number(name: str, x, lo: float, hi: float, none: bool = False) -> float | None:
    if x is None and none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (lo <= x <= hi):
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {x!r}")
    return x


def _build(top: dict, layers: list, tensors: dict[str, torch.Tensor]) -> TriZoneCache:
    """The cache the metadata and tensors describe, every field checked first (:func:`rdkv.pages.check_pages`,
    :meth:`rdkv.fold.FoldPolicy.check`): a bad field raises naming it, before anything is sized by it."""
    out = []
    for i, lay in enumerate(layers):
        try:
            if lay["dtype16"] not in _DTYPE16:
                raise ValueError(f"unknown 16-bit dtype {lay['dtype16']!r}")
            shape = dict(batch=lay["batch"], heads=lay["heads"], head_dim=lay["head_dim"], spec=PackSpec(**lay["spec"]),
                         sliding_window=lay["sliding_window"], dtype16=_DTYPE16[lay["dtype16"]])
            t = {n: tensors[f"layers.{i}.{n}"] for n in lay["tensors"]}
            pages.check_pages(t, start=lay["start"], prefix_len=lay["prefix_len"], **shape)
            layer = TriZoneLayer(t, start=lay["start"], prefix_len=lay["prefix_len"], **shape)
            end = lay["prefix_len"]
            for j, f in enumerate(lay["folds"]):
                ft = {n: tensors[f"layers.{i}.folds.{j}.{n}"] for n in f["tensors"]}
                if f["start"] < end:
                    raise ValueError(f"fold {j} starts at {f['start']}, before the end {end} of what precedes it")
                try:
                    pages.check_pages(ft, start=f["start"], prefix_len=f["end"], zone_c=False, **shape)
                except RDKVError as e:
                    raise RDKVError(f"fold {j}: {e}") from e
                layer.folds.append(TriZoneLayer(ft, start=f["start"], prefix_len=f["end"], **shape))
                end = f["end"]
            layer.c_start = lay["c_start"]
            _number("c_start", layer.c_start, end if layer.folds else lay["prefix_len"],
                    POSITION_LIMIT - layout.zone_c(layer)[0].shape[2])
            if layer.c_start != end and (layer.folds or layer.sliding_window is None):
                # only a sliding-window layer drops folds (those no query can see any more)
                raise ValueError(f"zone C starts at {layer.c_start}, not where what precedes it ends ({end})")
        except (RDKVError, KeyError, TypeError, ValueError) as e:
            raise RDKVError(f"layer {i}: {e}") from e
        out.append(layer)
    for name, of in (("batch sizes", lambda x: x.batch), ("prefix lengths", lambda x: x.prefix_len),
                     ("lengths", lambda x: x.get_seq_length())):
        if len({of(x) for x in out}) > 1:
            raise ValueError(f"the layers hold different {name}")
    distortion = top["layer_distortion"]
    if distortion is not None:
        if not isinstance(distortion, list) or len(distortion) != len(out):
            raise ValueError("layer_distortion must hold one number per layer")
        distortion = tuple(_number("layer_distortion", d, 0, float("inf")) for d in distortion)
    model = top.get("model")
    if model is not None and (not isinstance(model, dict) or set(model) != set(SIGNATURE)):
        raise ValueError(f"the model signature must name {SIGNATURE}")
    if top["method"] is not None and not isinstance(top["method"], str):
        raise ValueError(f"method must be a name, got {top['method']!r}")
    cache = TriZoneCache(out, fp16_bytes=int(_number("fp16_bytes", top["fp16_bytes"], 0, 2**62)),
                         budget=_number("budget", top["budget"], 0, 1, none=True), method=top["method"],
                         layer_distortion=distortion, model=model)
    if top["fold"]:
        try:
            policy = FoldPolicy.from_dict(top["fold"])
        except (KeyError, TypeError, ValueError) as e:
            raise RDKVError(f"the fold policy is malformed ({e})") from e
        cache.set_fold(policy)
    return cache


def _placed(cache: TriZoneCache, device: str | torch.device) -> TriZoneCache:
    """``cache`` with every tensor on ``device`` (validated on the CPU first)."""
    for layer in cache.layers:
        for seg in layer.segments():
            seg.t = {n: x.to(device) for n, x in seg.t.items()}
    return cache

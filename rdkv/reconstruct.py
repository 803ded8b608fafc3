"""Reconstruction weights (after KVzip, Kim et al. 2025): what a model needs of its cache to repeat its context.

Query-agnostic compression has no question to weigh tokens by, and the prefill's own last queries weigh what the
end of the prompt looked at, not what a later question will ask for. KVzip asks the model to reproduce the
context instead: after the prefill, the context's own tokens are fed again through the cache, teacher-forced, and
each cached token is weighed by the attention the repetition pays it. A token the model can continue without
looking back (predictable prose) draws little; one it must copy (a needle's digits, a name, a number) draws a
lot. rdkv feeds the context again with no instruction before it: a repeated sequence is what induction heads
copy from, and no tokenizer or chat template is needed.

The pass is a second forward over the context's T tokens with the prefill's keys in front (positions T..2T-1),
about the cost of one more prefill plus its attention over 2T keys, in query chunks, so it never forms a T x T
tensor: on a CPU the output and each query's log-sum-exp come from torch's fused attention and only the record's
keys are scored again for the sums (:func:`_repeat_attention`); elsewhere, or with a softcap, it runs through
rdkv's chunked exact attention (:func:`rdkv.dense.attend`). Its sums over the T repetition queries (mass, mass2,
the squared query norms, each key's largest probability and its distance to the outputs that read it, per KV
head) weigh tokens and K channels as the prefill's window does (``rdkv.methods.Weights(form="reconstruct")``,
with ``score`` and ``k_price`` choosing among them), priced by the same distortion model. They are computed once
per record, on the first compress that asks for them, and kept with the record.
"""
from __future__ import annotations

import torch

from .attention import attention_modules
from .dense import CHUNK_ELEMENTS, AttentionSums, allowed_keys, attend, key_ranges, reader_drift, reader_sums
from .errors import RDKVError
from .records import Record


@torch.no_grad()
def reconstruct(rec: Record) -> None:
    """Set each layer's ``recon``: the attention sums of the repeated context over the keys the record holds
    (positions ``start`` to ``seen - 1``), once per record (see the module docstring)."""
    if all(st.recon is not None for st in rec.layers.values()):
        return
    if rec.ids is None or rec.ids.shape[1] != next(iter(rec.layers.values())).seen:
        raise RDKVError("reconstruction weights repeat the prefill's tokens: the record needs them (prefill with "
                        "input_ids, not inputs_embeds)")
    model, ids = rec.model, rec.ids
    B, T = ids.shape
    valid = next(iter(rec.layers.values())).valid
    if not bool(valid.all()):
        raise RDKVError("reconstruction weights need an unpadded batch: compress padded prompts one at a time")

    def attend_layer(module, query, key, value, scaling, window, softcap) -> torch.Tensor:
        st = rec.layers[module.layer_idx]
        k_pos = torch.arange(st.start, T + key.shape[2], device=query.device)
        q_pos = torch.arange(T, T + query.shape[2], device=query.device)
        k, v = torch.cat([st.key, key.to(st.key.dtype)], 2), torch.cat([st.value, value.to(st.value.dtype)], 2)
        held = T - st.start
        if softcap is None and query.device.type == "cpu" and _FLASH_CPU is not None:
            o, sums = _repeat_attention(query, k, v, q_pos, k_pos, held, scaling, window)
        else:
            o, sums = attend(query, k, v, q_pos, k_pos, scaling, window, softcap, drift=True)
        st.recon = sums.keys(slice(None, held))
        return o.to(query.dtype)

    mods = attention_modules(model)
    for m in mods:
        m._rdkv_reconstruct = attend_layer
    try:
        pos = torch.arange(T, 2 * T, device=ids.device).expand(B, T)
        model(ids, position_ids=pos, use_cache=False, logits_to_keep=1)  # no cache: the record's keys come first
    finally:
        for m in mods:
            del m._rdkv_reconstruct


# torch's fused CPU attention that also returns each query's log-sum-exp (SDPA's CPU kernel; not a public name)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _repeat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      held: int, scaling: float, window: int | None,
                      elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, AttentionSums]:
    """What :func:`rdkv.dense.attend` returns for the repetition, at a third of its cost on a CPU: the output and
    each query's log-sum-exp from torch's fused attention, then the probabilities of the first ``held`` keys (the
    record's, the only ones weighed) from their scores and that log-sum-exp, in query chunks. The repetition's
    own keys are never scored twice, and no probability of theirs is formed. The sums include
    :attr:`rdkv.dense.AttentionSums.drift`."""
    B, Hq, L, D = q.shape
    H = k.shape[1]
    G = Hq // H
    kk, vv = k.to(q.dtype).repeat_interleave(G, 1), v.to(q.dtype).repeat_interleave(G, 1)
    kf = k[:, :, :held].float()
    out = q.new_empty(B, Hq, L, D)
    readers = kf.new_zeros(B, H, D + 1, held)
    sums = AttentionSums(mass=kf.new_zeros(B, H, held), mass2=kf.new_zeros(B, H, held), q2=kf.new_zeros(B, H, D),
                         nq=kf.new_full((B,), float(L * G)), peak=kf.new_zeros(B, H, held))  # every token sees itself
    chunk = max(1, elements // max(1, B * Hq * k.shape[2]))
    # the chunks' scores and masks grow with their key ranges: carved from one buffer each, so the heap does not
    # grow chunk by chunk (freed blocks too small for the next chunk's tensors stay with the process)
    scores = kf.new_empty(B * Hq * min(chunk, L) * held)
    bias_buf = q.new_empty(min(chunk, L) * k.shape[2])
    starts = range(0, L, chunk)
    for a, (lo, hi) in zip(starts, key_ranges(q_pos, k_pos, window, starts, chunk)):  # hi > lo: a token sees itself
        qc, ok = q[:, :, a : a + chunk], allowed_keys(q_pos[a : a + chunk], k_pos[lo:hi], window)
        bias = bias_buf[: ok.numel()].view(ok.shape).zero_().masked_fill_(~ok, float("-inf"))
        o, lse = _FLASH_CPU(qc, kk[:, :, lo:hi], vv[:, :, lo:hi], 0.0, False, attn_mask=bias, scale=scaling)
        out[:, :, a : a + chunk] = o
        qg = qc.float().unflatten(1, (H, G))  # [B, H, G, c, D]
        sums.q2 += qg.square().sum((2, 3))
        end = min(hi, held)
        if end <= lo:  # the chunk sees none of the record's keys (a sliding window past them)
            continue
        p = scores[: B * Hq * qg.shape[3] * (end - lo)].view(B, H, G, qg.shape[3], end - lo)
        torch.matmul(qg, kf[:, :, lo:end].transpose(-1, -2).unsqueeze(2), out=p)
        p.mul_(scaling).sub_(lse.float().unflatten(1, (H, G)).unsqueeze(-1)).exp_().masked_fill_(~ok[:, : end - lo], 0.0)
        sums.mass[..., lo:end] += p.sum((2, 3))
        torch.maximum(sums.peak[..., lo:end], p.amax((2, 3)), out=sums.peak[..., lo:end])
        sums.mass2[..., lo:end] += p.square_().sum((2, 3))
        readers[..., lo:end] += reader_sums(p, o.float().unflatten(1, (H, G)))  # p holds p^2 here
    sums.drift = reader_drift(v[:, :, :held].float(), sums.mass2, readers)
    return out, sums

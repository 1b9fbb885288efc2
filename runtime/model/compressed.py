"""DeepSeek-V4 attention (``AttentionSpec.kind == "shared_kv"``): shared-KV MQA over a sliding window plus
compressed KV entries.

One KV head is read as both keys and values; the trailing ``R`` channels of queries and keys are rotated
(interleaved pairs), and the same rotation is undone on the output at the query's position. Each query sees the
keys of its sliding window and, with a compressor, pooled entries of the whole past:

- HCA (``rate`` m, no overlap): entry w pools tokens [w·m, (w+1)·m) by a per-channel softmax over learned gates;
  a query at p sees every entry whose window is complete, w < (p+1) // m.
- CSA (``overlap``): entry w pools the Cb half of window w and the Ca half of window w-1 (2m slots), and a lightning
  indexer over its own pooled keys picks the ``topk`` complete entries each query sees.

Entries are rotated at their window's first position and normalized. The output heads go through a grouped
low-rank projection (``o_a_proj`` per group, then ``o_b_proj``).

Cache layout, per position (one part each, so paging, prefix sharing and truncation work unchanged): the rotated KV
[hd]; with a compressor its projections and gates [c·hd] (c = 2 with overlap) and an entry slot [hd] that holds the
pooled entry of the window ending at that position (zeros elsewhere); CSA adds the indexer's projections [2·Di] and
entry slot [Di]. A window's entry is pooled once, in the forward that completes it, and written back to its slot.

Legend: T new tokens, S cached + new positions, H heads, hd head dim, R rotated channels, m compression rate,
E complete windows, G output groups, Hi / Di indexer heads / head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.layers import Span, dense_linear, linear, rms_norm, unit_rms_norm
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import AttentionSpec, CompressorSpec

Weights = dict[str, torch.Tensor]


def rope_tail(x: torch.Tensor, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``R`` channels of x [T, H, hd] (interleaved pairs); the leading channels pass through."""
    r = rotary.spec.dim
    tail = rotary.apply(x[..., -r:].contiguous(), cos, sin, style="interleaved")
    return torch.cat([x[..., :-r], tail], dim=-1)


def shared_kv_attention(
    x: torch.Tensor, w: Weights, spec: AttentionSpec, rotary: Rotary, layer: int, cache: KVCache | None,
    positions: torch.Tensor, eps: float, spans: list[Span] | None = None, decode_row: bool = False,
) -> torch.Tensor:
    """x [T, D] → [T, D]. Projections run once over all rows; the cache, the compressor's windows and the attention
    run per sequence (``spans`` as in ``gqa_attention``; None: the rows are one sequence in ``cache``, a decode token
    and its drafts with ``decode_row``). A decode row's queries (every chunk's, in deterministic mode) attend one by
    one with the shapes of their own decode steps: the indexer's top-k then breaks ties among the complete entries
    as the decode step does, and the bits are the decode step's."""
    t, h, hd = x.shape[0], spec.num_heads, spec.head_dim
    comp = spec.compressor
    q_resid = rms_norm(linear(x, w, "q_a_proj"), w["q_a_norm.weight"], eps)  # [T, q_rank]
    q = unit_rms_norm(linear(q_resid, w, "q_b_proj").view(t, h, hd), eps)
    kv = rms_norm(linear(x, w, "kv_proj"), w["kv_norm.weight"], eps)  # [T, hd]
    cos, sin = rotary.cos_sin(positions, None if spans is None else [sp.end - sp.start for sp in spans])
    q = rope_tail(q, rotary, cos, sin)
    kv = rope_tail(kv[:, None, :], rotary, cos, sin)[:, 0]
    parts = [kv]
    index_q = index_w = None
    if comp is not None:
        parts += [linear(x, w, "compressor.kv_proj"), linear(x, w, "compressor.gate_proj"), kv.new_zeros(t, hd)]
        ix = comp.indexer
        if ix is not None:
            parts += [linear(x, w, "indexer.kv_proj"), linear(x, w, "indexer.gate_proj"), kv.new_zeros(t, ix.head_dim)]
            index_q = rope_tail(linear(q_resid, w, "indexer.q_b_proj").view(t, ix.num_heads, ix.head_dim),
                                rotary, cos, sin)
            index_w = linear(x, w, "indexer.weights_proj").float() * ix.num_heads**-0.5  # [T, Hi]
    outs = []
    for sp in spans if spans is not None else [Span(0, t, cache, positions, decode_row)]:  # type: ignore[list-item]
        chunk = [p[sp.start : sp.end] for p in parts]
        slots = list(chunk)
        views = sp.cache.append(layer, *chunk)
        keys_c = keys_i = None
        if comp is not None:
            keys_c = _entries(views, chunk, 1, "compressor", sp, w, comp, rotary, eps)
            if comp.indexer is not None:
                keys_i = _entries(views, chunk, 4, "indexer", sp, w, comp, rotary, eps)
            if any(c is not p for c, p in zip(chunk, slots)):
                sp.cache.append(layer, *chunk)  # again, with the entry slots of the completed windows filled
        rows = slice(sp.start, sp.end)
        iq = None if index_q is None else (index_q[rows], index_w[rows])  # type: ignore[index]
        if sp.end - sp.start > 1 and (sp.decode or kops.deterministic()):
            for i, p in enumerate(sp.positions.tolist()):
                n = 0 if comp is None else (p + 1) // comp.rate  # the entries complete at its decode step
                outs.append(_attend_with_index(
                    q[sp.start + i : sp.start + i + 1], views[0][: p + 1], None if keys_c is None else keys_c[:n],
                    None if keys_i is None else keys_i[:n], None if iq is None else (iq[0][i : i + 1], iq[1][i : i + 1]),
                    sp.positions[i : i + 1], w["sinks"], spec))
        else:
            outs.append(_attend_with_index(q[rows], views[0], keys_c, keys_i, iq, sp.positions, w["sinks"], spec))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, hd]
    out = rope_tail(out, rotary, cos, -sin)  # keys are the values: undo their rotation at the query position
    groups = spec.o_groups
    wa = w["o_a_proj.weight"].view(groups, spec.o_group_rank, -1)  # [G, r, H·hd/G]
    if kops.deterministic():  # one fixed-order product per group: a row's bits whatever T
        per_group = out.reshape(t, groups, -1)
        grouped = torch.cat([dense_linear(per_group[:, g].contiguous(), wa[g].contiguous()) for g in range(groups)], -1)
    else:
        grouped = torch.einsum("tgi,gri->tgr", out.reshape(t, groups, -1), wa).reshape(t, -1)
    return linear(grouped, w, "o_b_proj")


def _attend_with_index(
    q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None, index_keys: torch.Tensor | None,
    index: tuple[torch.Tensor, torch.Tensor] | None, q_pos: torch.Tensor, sinks: torch.Tensor, spec: AttentionSpec,
) -> torch.Tensor:
    """``_attend`` of one sequence's queries, the indexer's picks first where the layer has an indexer (``index``:
    its queries [T, Hi, Di] and head weights [T, Hi])."""
    keep = None
    if index_keys is not None and index is not None:
        assert spec.compressor is not None
        keep = _index_topk(index[0], index[1], index_keys, spec.compressor, q_pos)
    return _attend(q, kv, entries, keep, q_pos, sinks, spec)


def cached_width(spec: AttentionSpec) -> int:
    """Cache elements one position costs in a ``shared_kv`` layer (the cache layout of the module docstring)."""
    hd, comp = spec.head_dim, spec.compressor
    if comp is None:
        return hd
    c = 2 if comp.overlap else 1
    width = hd + 2 * c * hd + hd  # kv, projections and gates, entry slot
    if comp.indexer is not None:
        width += 2 * c * comp.indexer.head_dim + comp.indexer.head_dim
    return width


def _entries(
    views: list[torch.Tensor], chunk: list[torch.Tensor], at: int, role: str, sp: Span, w: Weights,
    comp: CompressorSpec, rotary: Rotary, eps: float,
) -> torch.Tensor:
    """The entries [E, width] of every complete window of this sequence, from its cached parts ``views[at:at+3]``
    (projections, gates, entry slots). Windows this chunk completes are pooled now and their entries put into
    ``chunk[at + 2]`` (replaced by a filled copy) for the caller to write back."""
    m = comp.rate
    start = int(sp.positions[0])
    end = start + int(sp.positions.shape[0])
    proj, gate, slots = views[at : at + 3]
    first, last = start // m, end // m  # windows [first, last) are completed by this chunk
    old = slots[m - 1 : first * m : m]  # [first, width]
    if last == first:
        return old
    new = _pool(proj, gate, w[f"{role}.position_bias"], first, last, comp, slots.shape[1])
    new = rms_norm(new, w[f"{role}.kv_norm.weight"], eps)
    cos, sin = rotary.cos_sin(torch.arange(first, last, device=new.device) * m)  # each at its window's start
    new = rope_tail(new[:, None, :], rotary, cos, sin)[:, 0]
    rows = torch.arange(first + 1, last + 1, device=new.device) * m - 1 - start  # slots of the windows' last tokens
    filled = chunk[at + 2].clone()
    filled[rows] = new.to(filled.dtype)
    chunk[at + 2] = filled
    return torch.cat([old, new.to(old.dtype)])


def _pool(proj: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, first: int, last: int, comp: CompressorSpec,
          width: int) -> torch.Tensor:
    """Windows [first, last) → pooled [n, width]: Σ_slots softmax(gate + bias) · proj per channel.

    Overlapping (CSA) windows take the Cb half (channels width:) of their own tokens and the Ca half (:width) of the
    previous window's tokens; window 0 has no previous window (its slots get weight 0)."""
    m, n = comp.rate, last - first
    kv = proj[first * m : last * m].view(n, m, -1)
    g = gate[first * m : last * m].view(n, m, -1).float() + bias  # [n, m, c·width]
    if comp.overlap:
        lo = max(first - 1, 0)
        prev_kv = proj[lo * m : (last - 1) * m].view(-1, m, 2 * width)[..., :width]
        prev_g = gate[lo * m : (last - 1) * m].view(-1, m, 2 * width)[..., :width].float() + bias[:, :width]
        if first == 0:  # no window before the first
            prev_kv = torch.cat([prev_kv.new_zeros(1, m, width), prev_kv])
            prev_g = torch.cat([prev_g.new_full((1, m, width), float("-inf")), prev_g])
        kv = torch.cat([prev_kv, kv[..., width:]], dim=1)  # [n, 2m, width]
        g = torch.cat([prev_g, g[..., width:]], dim=1)
    return (kv * torch.softmax(g, dim=1).to(kv.dtype)).sum(dim=1)


def _index_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, comp: CompressorSpec, q_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The lightning indexer's choice: (entry ids [T, k], valid [T, k]) — for each query the ``topk`` complete
    entries by Σ_h w_h · relu(q_h · key) (fewer are valid while fewer windows are complete). None without entries."""
    ix = comp.indexer
    assert ix is not None
    e = keys.shape[0]
    if e == 0:
        return None
    scores = F.relu(torch.einsum("thd,ed->the", q.float(), keys.float())) * ix.head_dim**-0.5  # [T, Hi, E]
    index = (scores * weights[:, :, None]).sum(dim=1)  # [T, E]
    complete = (q_pos + 1) // comp.rate  # [T]: entries a query may see
    index = index.masked_fill(torch.arange(e, device=q.device)[None, :] >= complete[:, None], float("-inf"))
    top = index.topk(min(ix.topk, e), dim=-1).indices
    return top, top < complete[:, None]


def _attend(
    q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None, keep: tuple[torch.Tensor, torch.Tensor] | None,
    q_pos: torch.Tensor, sinks: torch.Tensor, spec: AttentionSpec,
) -> torch.Tensor:
    """One sequence: q [T, H, hd] over its window keys (kv [S, hd], keys = values) and compressed entries [E, hd]
    (all complete ones, or the indexer's ``keep``), with per-head sinks in the softmax → [T, H, hd]."""
    t, h, _ = q.shape
    s, window = kv.shape[0], spec.sliding_window
    lo = max(0, int(q_pos[0]) - window + 1) if window else 0
    keys = kv[lo:s]  # [Sw, hd]: only keys some query of the chunk can see
    k_pos = torch.arange(lo, s, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [T, Sw]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    logits = [(torch.einsum("thd,sd->ths", q, keys) * spec.scale).masked_fill(~allowed[:, None, :], float("-inf"))]
    values = None
    if entries is not None and entries.shape[0]:
        comp = spec.compressor
        assert comp is not None
        if keep is None:  # every complete window
            values = entries
            seen = torch.arange(entries.shape[0], device=q.device)[None, :] < ((q_pos + 1) // comp.rate)[:, None]
            scores = torch.einsum("thd,ed->the", q, entries)
        else:  # the indexer's picks
            top, seen = keep
            values = entries[top]  # [T, k, hd]
            scores = torch.einsum("thd,tkd->thk", q, values)
        logits.append((scores * spec.scale).masked_fill(~seen[:, None, :], float("-inf")))
    logits.append(sinks.to(q.dtype).view(1, h, 1).expand(t, h, 1))
    probs = torch.softmax(torch.cat(logits, dim=-1).float(), dim=-1).to(q.dtype)
    sw = keys.shape[0]
    out = torch.einsum("ths,sd->thd", probs[..., :sw], keys)
    if values is not None:
        pc = probs[..., sw:-1]
        out = out + (torch.einsum("the,ed->thd", pc, values) if values.dim() == 2
                     else torch.einsum("thk,tkd->thd", pc, values))
    return out


class Loader(Protocol):
    """What ``load_shared_kv`` needs of the checkpoint loader (``model/weights.py``)."""

    def linear(self, out: Weights, prefix: str, leaf: str, n_out: int, n_in: int, bias: bool,
               key: str | None = None) -> None: ...

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def norm(self, name: str, dim: int) -> torch.Tensor: ...


def load_shared_kv(ld: Loader, prefix: str, a: AttentionSpec, d: int) -> Weights:
    """The tensors of one ``shared_kv`` attention under ``prefix`` (``model.layers.{i}.attn``), by their checkpoint
    names (transformers writes DeepSeek-V4 with the reference's: ``wq_a``, ``wkv``, ``wo_a``, ``compressor.ape``,
    ``indexer.compressor.*``, ...), keyed by the names the forward reads."""
    w: Weights = {}
    hd, q_rank = a.head_dim, a.q_lora_rank or d
    ld.linear(w, prefix, "wq_a", q_rank, d, False, key="q_a_proj")
    w["q_a_norm.weight"] = ld.norm(f"{prefix}.q_norm.weight", q_rank)
    ld.linear(w, prefix, "wq_b", a.num_heads * hd, q_rank, False, key="q_b_proj")
    ld.linear(w, prefix, "wkv", hd, d, False, key="kv_proj")
    w["kv_norm.weight"] = ld.norm(f"{prefix}.norm.weight", hd)
    ld.linear(w, prefix, "wo_a", a.o_groups * a.o_group_rank, a.num_heads * hd // a.o_groups, False, key="o_a_proj")
    ld.linear(w, prefix, "wo_b", d, a.o_groups * a.o_group_rank, False, key="o_b_proj")
    w["sinks"] = ld.take(f"{prefix}.attn_sink", (a.num_heads,))
    comp = a.compressor
    if comp is None:
        return w
    c = 2 if comp.overlap else 1
    blocks = [("compressor", f"{prefix}.compressor", hd)]
    if comp.indexer is not None:
        blocks.append(("indexer", f"{prefix}.indexer.compressor", comp.indexer.head_dim))
    for role, base, width in blocks:
        ld.linear(w, base, "wkv", c * width, d, False, key=f"{role}.kv_proj")
        ld.linear(w, base, "wgate", c * width, d, False, key=f"{role}.gate_proj")
        w[f"{role}.position_bias"] = ld.take(f"{base}.ape", (comp.rate, c * width), torch.float32)
        w[f"{role}.kv_norm.weight"] = ld.norm(f"{base}.norm.weight", width)
    ix = comp.indexer
    if ix is not None:
        ld.linear(w, f"{prefix}.indexer", "wq_b", ix.num_heads * ix.head_dim, q_rank, False, key="indexer.q_b_proj")
        ld.linear(w, f"{prefix}.indexer", "weights_proj", ix.num_heads, d, False, key="indexer.weights_proj")
    return w

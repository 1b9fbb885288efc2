"""``freetoken inspect MODEL``: what a checkpoint (folder or GGUF file) is and what the engine will do with it (no
weights loaded)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a model folder: architecture, parameters, experts, plan")
    p.add_argument("model", nargs="?", default=None,
                   help="model folder, .gguf file (or first part of a split one), 'builtin' or 'synthetic:ARCH'")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.set_defaults(func=run)


def describe(path: Any) -> dict[str, Any]:
    from freetoken_agent.runtime.checkpoint.reader import CheckpointReader, load_config
    from freetoken_agent.runtime.gguf import open_gguf
    from freetoken_agent.runtime.model.adapters import spec_from_config

    gguf = open_gguf(path)
    if gguf is not None:
        spec, reader = gguf.spec, gguf.reader
    else:
        spec = spec_from_config(load_config(path))
        reader = CheckpointReader(path, renames=spec.checkpoint_renames)  # counted under transformers' names
    expert_re = re.compile(r"\.experts\.|\.(input|output)_linear\.")
    expert_params = dense_params = expert_bytes = dense_bytes = 0
    for name, info in reader.infos.items():
        n = 1
        for s in info.shape:
            n *= s
        if expert_re.search(name):
            expert_params, expert_bytes = expert_params + n, expert_bytes + info.nbytes
        else:
            dense_params, dense_bytes = dense_params + n, dense_bytes + info.nbytes
    moe_layers = spec.moe_layers()
    moe = spec.layers[moe_layers[0]].moe if moe_layers else None
    n_experts = sum(spec.layers[i].moe.num_experts for i in moe_layers)  # type: ignore[union-attr]
    attn = next((layer.attention for layer in spec.layers if getattr(layer, "recurrent", None) is None),
                spec.layers[0].attention)
    recurrent = [i for i, layer in enumerate(spec.layers) if getattr(layer, "recurrent", None) is not None]
    active = dense_params + (expert_params * moe.top_k // moe.num_experts if moe else 0)
    info = {
        "path": str(path),
        "architecture": spec.model_type,
        "layers": spec.num_layers,
        "moe_layers": len(moe_layers),
        "dense_layers": spec.num_layers - len(moe_layers),
        "recurrent_layers": len(recurrent),
        "mixers": (f"hybrid: {len(recurrent)} recurrent "
                   f"({', '.join(sorted({spec.layers[i].recurrent.kind for i in recurrent}))}) + "  # type: ignore[union-attr]
                   f"{spec.num_layers - len(recurrent)} attention") if recurrent else "attention only",
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "attention": f"{attn.kind.upper()} heads={attn.num_heads} kv_heads={attn.num_kv_heads} head_dim={attn.head_dim}"
        + (f" latent={attn.kv_lora_rank}" if attn.kind == "mla" else "")
        + (" sinks" if attn.sinks else "") + (f" qk_norm={attn.qk_norm}" if attn.qk_norm != "none" else ""),
        "experts_per_layer": moe.num_experts if moe else 0,
        "experts_per_token": moe.top_k if moe else 0,
        "router": (f"{moe.router.scoring}{' top-k-first' if moe.router.topk_before_scoring else ''}"
                   f"{' +bias' if moe.router.correction_bias else ''}"
                   f"{f' groups={moe.router.n_group}/{moe.router.topk_group}' if moe.router.n_group > 1 else ''}"
                   if moe else "-"),
        "shared_experts": bool(moe and moe.shared),
        "params_total": dense_params + expert_params,
        "params_dense": dense_params,
        "params_experts": expert_params,
        "params_active_per_token": active,
        "bytes_dense": dense_bytes,
        "bytes_experts": expert_bytes,
        "bytes_per_expert": expert_bytes // n_experts if n_experts else 0,
        "checkpoint_files": len({i.file for i in reader.infos.values()}),
        "plan": "load all weights into host RAM and run the generic decoder on the CPU "
                f"(dense {dense_bytes / 2**20:.1f} MiB + experts {expert_bytes / 2**20:.1f} MiB)",
    }
    if gguf is not None:
        info.update(describe_gguf(gguf, dense_bytes, expert_bytes))
    return info


def describe_gguf(gguf: Any, dense_bytes: int, expert_bytes: int) -> dict[str, Any]:
    """What a GGUF file adds: its llama.cpp architecture, the ggml type of each tensor group, how the experts
    reach the kernels (as stored, or converted with the measured error) and the plan."""
    from collections import Counter

    from freetoken_agent.runtime.quant.formats import GGUF_NATIVE

    reader = gguf.reader
    groups: dict[str, Counter] = {}
    for name, src in reader.sources.items():
        leaf = src.tensor.name.split(".")[-2] if src.tensor.name.startswith("blk.") else src.tensor.name.split(".")[0]
        group = ("experts " + leaf.removeprefix("ffn_").removesuffix("_exps") if leaf.endswith("_exps") else
                 "attention" if leaf.startswith("attn_") and not leaf.endswith("norm") else
                 "norms" if leaf.endswith("norm") else
                 "router" if leaf.startswith("ffn_gate_inp") else
                 "shared experts" if leaf.endswith("_shexp") else
                 "dense mlp" if leaf.startswith("ffn_") else leaf)
        groups.setdefault(group, Counter())[src.tensor.type_name] += 1 if src.expert in (None, 0) else 0
    formats = {g: ", ".join(f"{t}×{n}" for t, n in sorted(c.items()) if n) for g, c in sorted(groups.items())}
    conversions = []
    for c in gguf.measure_conversion():
        conversions.append(f"layer {c.layer} {c.part}: {c.stored} → {c.runs_as.upper()}"
                           + (" as stored (no conversion)" if c.rel_rms_error is None else
                              f" requantized, relative RMS error {100 * c.rel_rms_error:.2f}% "
                              f"(measured on {c.experts_measured} experts)"))
    plan_layers = gguf.expert_plan()
    run = sorted({f or "float" for _, f in plan_layers})
    native = ", ".join(GGUF_NATIVE)
    return {
        "format": f"GGUF ({len(gguf.file.parts)} file{'s' if len(gguf.file.parts) > 1 else ''}, llama.cpp "
                  f"architecture {gguf.architecture})",
        "tensor_formats": formats,
        "expert_conversion": conversions or ["experts are float: loaded as stored (--quant q8/q4 quantizes them)"],
        "plan": (f"memory-map the file; dense weights ({dense_bytes / 2**20:.1f} MiB stored): projections stored in "
                 f"{native} run as stored, the rest dequantized to the compute dtype; routed experts "
                 f"({expert_bytes / 2**20:.1f} MiB stored) run as {' + '.join(run).upper()} on the CPU kernels "
                 f"({native} as stored, other block types converted at load)"),
        "tokenizer": str(gguf.file.metadata.get("tokenizer.ggml.model", "none"))
        + (f" (pre-tokenizer {gguf.file.metadata['tokenizer.ggml.pre']})" if "tokenizer.ggml.pre" in gguf.file.metadata
           else ""),
        "chat_template": "yes" if gguf.file.metadata.get("tokenizer.chat_template") else "no",
    }


def run(args: argparse.Namespace) -> int:
    from freetoken_agent.runtime.models import is_synthetic, resolve_model

    path = resolve_model(args.model)
    info = describe(path)
    if is_synthetic(path):
        info["note"] = "synthetic checkpoint: RANDOM weights"
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{info['architecture']} — {path}", show_header=False)
    for key, value in info.items():
        if key in ("path", "architecture"):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and (key.startswith(("params", "bytes"))):
            value = f"{value:,}"
        if isinstance(value, dict):
            value = "\n".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = "\n".join(str(v) for v in value)
        table.add_row(key.replace("_", " "), str(value))
    Console().print(table)
    return 0

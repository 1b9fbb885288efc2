"""``freetoken inspect MODEL_DIR``: what a checkpoint is and what the engine will do with it (no weights loaded)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a model folder: architecture, parameters, experts, plan")
    p.add_argument("model", nargs="?", default=None, help="model folder, 'builtin' or 'synthetic:ARCH'")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.set_defaults(func=run)


def describe(path: Any) -> dict[str, Any]:
    from freetoken_agent.runtime.checkpoint.reader import CheckpointReader, load_config
    from freetoken_agent.runtime.model.adapters import spec_from_config

    spec = spec_from_config(load_config(path))
    reader = CheckpointReader(path)
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
    return {
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
        table.add_row(key.replace("_", " "), str(value))
    Console().print(table)
    return 0

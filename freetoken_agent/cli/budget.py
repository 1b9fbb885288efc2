"""Flags shared by every command that loads a model: ``--quant``, ``--quant-dense``, ``--kv-dtype``,
``--device-memory``, ``--host-memory``, ``--residency-policy``, ``--speculate``. ``engine_kwargs(args)`` turns them into ``Engine.from_pretrained`` keyword
arguments (empty when no flag was given, so the unbudgeted load path is unchanged).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_budget_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory budget (expert residency)")
    g.add_argument("--quant", default="none", choices=["none", "q8", "q4"],
                   help="quantize routed experts at load (Q8_0 / Q4_0 blocks, CPU kernels)")
    g.add_argument("--quant-dense", default="none", choices=["none", "q8", "q4"],
                   help="also quantize attention projections, dense MLPs and the lm_head (CPU kernels; "
                        "~2.5x faster decode on CPU, slightly less accurate)")
    g.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "fp8"],
                   help="KV cache storage: 16 bits hold twice the context in the same memory and decode attention "
                        "reads them as is; fp16 is ~1.3x faster decode after a 4k prompt, logits within ~2e-2 of fp32; "
                        "fp8 (e4m3) holds four times the context, less accurately "
                        "(auto: the model's dtype; $FREETOKEN_KV_DTYPE overrides it)")
    g.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="hard limit on accelerator memory, e.g. 8GB (experts beyond it live in host slots)")
    g.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="hard limit on host memory for weights and expert slots, e.g. 16GB or 64MB "
                        "(experts beyond it stream from the expert cache file on disk)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a greedy request gives the same tokens whatever shares its batch "
                        "and whether its prefix came from the cache (slower prefill; see the README)")
    g.add_argument("--speculate", default="on", type=speculate_flag, metavar="on|off|K",
                   help="speculative decoding from the context (drafts where they pay, verified in the batch; same "
                        "greedy tokens, same sampled distribution): on (default), off, or at most K draft tokens")
    g.add_argument("--draft-history", default=None, type=_draft_history, metavar="TOKENS",
                   help="tokens of earlier outputs the engine keeps to draft from (default 65536; 0: drafts come "
                        "from each sequence's own tokens only)")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a small model of the same tokenizer (folder or GGUF) that drafts for speculative decoding "
                        "instead of prompt lookup; refused when its tokenizer differs")
    g.add_argument("--residency-policy", default=None, choices=["lru", "heat", "phase"],
                   help="which expert leaves a full slot pool (default: lru; phase for run/acp under a budget)")


def speculate_flag(value: str) -> bool | int:
    """``--speculate``: on → True, off → False, K → at most K draft tokens per step (0: off)."""
    low = value.strip().lower()
    if low in ("on", "true", "yes"):
        return True
    if low in ("off", "false", "no"):
        return False
    if low.isdigit() and int(low) <= 64:
        return int(low)
    raise argparse.ArgumentTypeError(f"expected on, off or a number of draft tokens 0..64, got {value!r}")


def _draft_history(value: str) -> int:
    if not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 0, got {value!r}")
    return int(value)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``quant=``/``dense_quant=``/``deterministic=``/``kv_dtype=``/``speculate=`` (with ``--draft-history``)/``draft_model=``/``threads=``/``budget=``/``residency=`` for ``Engine.from_pretrained`` from the parsed flags ({} when none)."""
    device, host, policy = (getattr(args, n, None) for n in ("device_memory", "host_memory", "residency_policy"))
    quant = {"quant": args.quant} if getattr(args, "quant", "none") != "none" else {}
    if getattr(args, "quant_dense", "none") != "none":
        quant["dense_quant"] = args.quant_dense
    if getattr(args, "deterministic", False):
        quant["deterministic"] = True
    if getattr(args, "kv_dtype", "auto") != "auto":
        quant["kv_dtype"] = args.kv_dtype
    if getattr(args, "speculate", True) is not True:
        quant["speculate"] = args.speculate
    if getattr(args, "draft_history", None) is not None:
        from freetoken_agent.runtime.generation.speculative import SpeculationConfig

        on = getattr(args, "speculate", True)  # the config --speculate gives, with this history size
        config = SpeculationConfig.of(on)
        quant["speculate"] = SpeculationConfig(enabled=config.enabled, max_draft=config.max_draft,
                                               history_tokens=args.draft_history)
    if getattr(args, "draft_model", None):
        quant["draft_model"] = args.draft_model
    if getattr(args, "threads", None) is not None:  # torch's threads and the kernels' pool (Engine.from_pretrained)
        quant["threads"] = args.threads
    if device is None and host is None and policy is None:
        return quant
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from freetoken_agent.runtime.memory import Budget

    return {**quant, "budget": Budget.from_strings(device, host), "residency": ResidencyConfig(policy=policy or "lru")}


def format_residency(stats: dict[str, Any]) -> list[str]:
    """Human-readable lines for ``engine.stats()["residency"]``."""
    from freetoken_agent.runtime.memory import format_bytes

    lines = [f"residency: policy {stats['policy']}, stall {stats['stall_s']} s, planner {stats['planner']}"]
    for name, t in stats["tiers"].items():
        if name == "disk":
            lines.append(f"  disk: read {format_bytes(t['bytes_read'])} of {format_bytes(t['bytes'])} "
                         f"({t['read_gbps']} GB/s) from {t['file']}")
        else:
            lines.append(f"  {name}: hit rate {t['hit_rate']} ({t['hits']} hits, {t['misses']} misses), "
                         f"{t['slots']} slots, {t['evictions']} evictions, peak {format_bytes(t['peak'])} "
                         f"of {format_bytes(t['limit'])}")
    p = stats["prefetch"]
    lines.append(f"  prefetch: {p['issued']} issued, {p['used']} used, {p['wasted']} wasted "
                 f"(accuracy {p['accuracy']})")
    return lines

"""``freetoken generate``: stream tokens from a model for a prompt (text or token ids)."""

from __future__ import annotations

import argparse
import json
import sys

from freetoken_agent.cli.budget import add_budget_flags, engine_kwargs, format_residency
from freetoken_agent.cli.flags import count, sampling


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams tokens)")
    p.add_argument("--model", default=None, help="model folder, 'builtin' (default) or 'synthetic:ARCH'")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message with the chat template")
    p.add_argument("--max-new-tokens", type=sampling("max_new_tokens"), default=64)
    p.add_argument("--temperature", type=sampling("temperature"), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=sampling("top_k"), default=0)
    p.add_argument("--top-p", type=sampling("top_p"), default=1.0)
    p.add_argument("--seed", type=sampling("seed"), default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=count(), default=None, help="CPU threads (default: free cores)")
    p.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON at the end")
    p.add_argument("--stats", action="store_true", help="print engine stats (residency tiers, prefetch) at the end")
    add_budget_flags(p)
    p.set_defaults(func=run)


def _prompt_ids(args: argparse.Namespace, engine: object) -> list[int]:
    from freetoken_agent.cli import CLIError

    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.replace(" ", "").split(",") if x]
        except ValueError:
            raise CLIError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    text = args.prompt if args.prompt is not None else ("Write a Python function that reverses a string."
                                                        if args.chat else "def fibonacci(n):")
    if args.chat:
        messages = [{"role": "user", "content": text}]
        if _is_builtin(engine):  # the built-in model answers in the agent format with the prompt it was trained on
            from freetoken_agent.runtime.builtin import BUILTIN_SYSTEM_PROMPT

            messages.insert(0, {"role": "system", "content": BUILTIN_SYSTEM_PROMPT})
        text = engine.render_chat(messages)  # type: ignore[attr-defined]
    return engine.tokenizer.encode(text, add_special_tokens=not args.chat)  # type: ignore[attr-defined]


def _is_builtin(engine: object) -> bool:
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from freetoken_agent.runtime.errors import CheckpointError

    try:
        return getattr(engine, "path", None) == builtin_model_dir()
    except CheckpointError:
        return False


def run(args: argparse.Namespace) -> int:
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.models import is_synthetic, resolve_model

    path = resolve_model(args.model)
    if is_synthetic(path):
        print(f"note: {path.name} is a synthetic checkpoint with RANDOM weights: expect gibberish", file=sys.stderr)
    engine = Engine.from_pretrained(path, dtype=args.dtype, require_tokenizer=args.prompt_ids is None,
                                    **engine_kwargs(args))
    ids = _prompt_ids(args, engine)
    events = engine.iter_generate(
        ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
    )
    out_ids, pieces, reason = [], [], "length"
    for ev in events:
        out_ids.append(ev.token_id)
        pieces.append(ev.text)
        reason = ev.finish_reason or reason
        if not args.json:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"prompt_ids": ids, "token_ids": out_ids, "text": "".join(pieces),
                          "finish_reason": reason, "stats": engine.stats()}))
    else:
        stats = engine.stats()
        sys.stdout.write("\n")
        spec = stats["speculation"]
        kept = f"; speculation kept {spec['accepted']} of {spec['drafted']} drafts" if spec["drafted"] else ""
        print(f"[{len(out_ids)} tokens, {reason}; prefill {stats['prefill_tok_s']} tok/s, "
              f"decode {stats['decode_tok_s']} tok/s{kept}]", file=sys.stderr)
        if args.stats:
            for line in ([json.dumps(stats)] if stats["residency"] is None else format_residency(stats["residency"])):
                print(line, file=sys.stderr)
    return 0

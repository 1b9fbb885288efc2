"""Constrained decoding's cost per token, by grammar engine: llguidance (what the server uses) and xgrammar (an
optional comparison: a skip line when it is not installed; nothing in the product imports it), on the same grammars
— a JSON Schema and a forced tool call — with the served model's tokenizer.

    python -m freetoken_agent.evals.perf.bench_constrained [--model builtin] [--requests 4] [--tokens 96]

Reports, per engine and grammar: the one-off tokenizer setup; compile (grammar source to a matcher ready for its
first mask, cold: every request compiles its own grammar, as the server does for per-request tools and schemas);
the mask time per token, mean and p99 (computing the mask and applying it to the logits: what the grammar adds to
each step), the advance per token (feeding the picked token to the grammar); tokens and end-to-end decode tok/s,
with a free (unconstrained) run for reference.

The JSON-Schema run decodes exactly ``--tokens`` tokens (the schema's array needs more, so no run stops early); the
tool-call run stops where the call is complete (end-of-sequence is allowed only there). Both engines get the same
grammars: the schema with ``json.dumps``' separators and no free whitespace, and the Hermes call
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` over three tools.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.evals.perf.timing import timed

TOOLS = [
    {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}},
        "required": ["path"]}},
    {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}},
    {"name": "run_shell", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "number"},
        "mode": {"type": "string", "enum": ["read-only", "write"]}}, "required": ["command"]}},
]
"""The tool-call grammar's tools (the arguments of each follow its schema)."""

CALL_SCHEMA = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                          "required": ["name", "arguments"], "additionalProperties": False} for t in TOOLS]}
"""One call's JSON: a tool's name and arguments valid under that tool's schema."""
OPEN, CLOSE = "<tool_call>", "</tool_call>"
"""The Hermes call's tags, each on its own line around the call's JSON."""


def notes_schema(tokens: int) -> dict[str, Any]:
    """A schema whose shortest valid value is longer than ``tokens`` tokens (so the run never ends early)."""
    return {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                       "minItems": tokens}}, "required": ["notes"]}


class Timed:
    """A logits processor with each mask (``__call__``) and advance (``accept``) timed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.mask_s: list[float] = []
        self.advance_s: list[float] = []

    def __call__(self, logits: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(logits)
        self.mask_s.append(time.perf_counter() - t0)
        return out

    def accept(self, token: int) -> None:
        t0 = time.perf_counter()
        self.inner.accept(token)
        self.advance_s.append(time.perf_counter() - t0)


class Llguidance:
    """The product's engine: ``GrammarProcessor`` over llguidance (``runtime/generation/constraints.py``)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: Path, vocab: int, eos: tuple[int, ...], threads: int, token_of: Any) -> None:
        import llguidance

        from freetoken_agent.runtime.generation import constraints

        self.c, self.vocab, self.token_of = constraints, vocab, token_of
        t0 = time.perf_counter()
        llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab, eos_token=list(eos))
        self.note = (f"LLTokenizer {(time.perf_counter() - t0) * 1000:.0f} ms; the rest is the first mask: "
                     "torch.compile of llguidance.torch's mask kernel")
        self.tokenizer = constraints.grammar_tokenizer(tokenizer_json, vocab, eos)  # the product's, warmed

    def tag(self, text: str) -> str:
        """A tag as the product's grammars write it: its one token when the tokenizer has it as an added token
        (llguidance does not spell an added token's text with it), else its text."""
        token = self.token_of(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    def processor(self, grammar: str, tokens: int) -> Any:
        c = self.c
        if grammar == "json_schema":
            source = c.json_schema_grammar(notes_schema(tokens))
        else:
            source = c.lark_grammar(f'start: {self.tag(OPEN)} "\\n" call "\\n" {self.tag(CLOSE)}\n'
                                    f"call: %json {json.dumps(c.styled(CALL_SCHEMA))}\n")
        return c.GrammarProcessor(self.tokenizer, source, self.vocab)


class XGrammar:
    """xgrammar (``pip install xgrammar``): compiled per request with its cache off (what a per-request grammar
    costs), masks filled per step and applied with its CPU kernel. Tags are text (xgrammar matches an added
    token's text with the token or with its spelling)."""

    name = "xgrammar"

    def __init__(self, tokenizer_json: Path, vocab: int, eos: tuple[int, ...], threads: int, token_of: Any) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.vocab = xgr, vocab
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json)),
                                                  vocab_size=vocab, stop_token_ids=list(eos))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.note = "TokenizerInfo from the Hugging Face tokenizer"

    def processor(self, grammar: str, tokens: int) -> Any:
        xgr = self.xgr
        style = {"any_whitespace": False, "separators": (", ", ": ")}
        if grammar == "json_schema":
            compiled = self.compiler.compile_json_schema(json.dumps(notes_schema(tokens)), **style)
        else:
            call = xgr.Grammar.from_json_schema(json.dumps(CALL_SCHEMA), **style)
            compiled = self.compiler.compile_grammar(xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(OPEN + chr(10))}"), call,
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + CLOSE)}")))
        return XGrammarProcessor(xgr, compiled, self.vocab)


class XGrammarProcessor:
    """A ``LogitsProcessor`` over one xgrammar matcher (the benchmark's counterpart of ``GrammarProcessor``)."""

    def __init__(self, xgr: Any, compiled: Any, vocab: int) -> None:
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.mask = xgr.allocate_token_bitmask(1, vocab)  # [1, ceil(V / 32)] int32

    def __call__(self, logits: Any) -> Any:
        self.matcher.fill_next_token_bitmask(self.mask)
        out = logits.float().clone()[None, :]  # [1, V]
        self.xgr.apply_token_bitmask_inplace(out, self.mask)
        return out[0]

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}, which its own mask allowed")


def _decode(backend: Any, processor: Any, ids: list[int], tokens: int, seed: int, stop: bool) -> tuple[int, float]:
    """(tokens generated, seconds) for one request, sampled at temperature 1; ``stop``: end-of-sequence ends it."""
    result, seconds = timed(lambda: backend.engine.generate(ids, max_new_tokens=tokens, temperature=1.0, seed=seed,
                                                             processor=processor, stop_token_ids=None if stop else []))
    return len(result.token_ids), seconds


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch threads, and xgrammar's compile threads")
    p.add_argument("--json", action="store_true", help="print the report as JSON (setup lines go to stderr)")
    args = p.parse_args(argv)
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print  # noqa: E731

    import torch

    torch.set_num_threads(args.threads)
    from freetoken_agent.backends.local import LocalEngine
    from freetoken_agent.runtime.models import resolve_model

    backend = LocalEngine.from_pretrained(resolve_model(args.model))
    engine = backend.engine
    tokenizer_json = Path(engine.path) / "tokenizer.json"
    vocab, eos = int(engine.spec.vocab_size), tuple(sorted(engine.eos_token_ids))
    ids = engine.tokenizer.encode("Notes on the bug in calc.py:")
    say(f"model {args.model}: vocabulary {vocab}, {args.requests} requests x {args.tokens} tokens, "
          f"{args.threads} thread(s)")

    grammar_engines = []
    for kind in (Llguidance, XGrammar):
        t0 = time.perf_counter()  # the setup line's own clock: the engine's construction may raise
        try:
            grammar_engines.append(kind(tokenizer_json, vocab, eos, args.threads, engine.tokenizer.token_id))
        except ImportError as exc:
            say(f"skip {kind.name}: not installed ({exc.name}); pip install {kind.name}")
            continue
        say(f"{kind.name}: tokenizer setup {(time.perf_counter() - t0) * 1000:.0f} ms, once per process "
              f"({grammar_engines[-1].note})")

    _decode(backend, None, ids, 8, 0, stop=False)  # warm the engine (first-call allocations) outside the timing
    rows = []
    n_total, s_total = 0, 0.0
    for seed in range(args.requests):
        n, s = _decode(backend, None, ids, args.tokens, seed, stop=False)
        n_total, s_total = n_total + n, s_total + s
    rows.append(("free", "-", n_total, n_total / s_total, None, [], []))
    for grammar in ("json_schema", "tool_call"):
        for ge in grammar_engines:
            n_total, s_total, compile_s, masks, advances = 0, 0.0, [], [], []
            for seed in range(args.requests):
                built, seconds = timed(lambda: ge.processor(grammar, args.tokens))
                processor = Timed(built)
                compile_s.append(seconds)
                n, s = _decode(backend, processor, ids, args.tokens, seed, stop=grammar == "tool_call")
                n_total, s_total = n_total + n, s_total + s
                masks += processor.mask_s
                advances += processor.advance_s
            rows.append((grammar, ge.name, n_total, n_total / s_total, statistics.mean(compile_s), masks, advances))

    if args.json:
        print(json.dumps({"model": args.model, "requests": args.requests, "tokens": args.tokens, "rows": [
            {"grammar": g, "engine": name, "tokens": n, "tok_s": round(rate, 2),
             "compile_ms": round(c * 1e3, 3) if c is not None else None,
             "mask_mean_ms": round(statistics.mean(m) * 1e3, 4) if m else None,
             "mask_p99_ms": round(_p99(m) * 1e3, 4) if m else None,
             "advance_mean_ms": round(statistics.mean(a) * 1e3, 4) if a else None}
            for g, name, n, rate, c, m, a in rows]}, indent=1))
        return 0
    print(f"{'grammar':<12} {'engine':<11} {'compile ms':>10} {'mask mean ms':>12} {'mask p99 ms':>11} "
          f"{'advance ms':>10} {'tokens':>7} {'tok/s':>7}")
    for grammar, name, n, rate, compile_mean, masks, advances in rows:
        ms = (lambda v: f"{v * 1000:.3f}") if masks else (lambda v: "-")
        print(f"{grammar:<12} {name:<11} {ms(compile_mean) if compile_mean is not None else '-':>10} "
              f"{ms(statistics.mean(masks)) if masks else '-':>12} {ms(_p99(masks)) if masks else '-':>11} "
              f"{ms(statistics.mean(advances)) if advances else '-':>10} {n:>7} {rate:>7.1f}")
    return 0



@row("constrained", "constrained decoding's cost per token by grammar engine (llguidance, xgrammar): compile, mask, "
     "advance, tok/s; flags are bench_constrained's", passthrough=True)
def constrained_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())

"""What quantized experts cost in accuracy on one model: top-1 agreement and KL against the unquantized engine.

``python -m freetoken_agent.runtime.kernels.accuracy [--model PATH] [--tokens N] [--quant q8,q4]`` prints a row per
(format, expert mode): top-1 agreement and mean KL(fp32 ‖ quantized) over the prompt's positions, and the largest
logit difference from the matching plain-torch reference engine over the dequantized weights (``exact`` mode →
``TorchExperts``; ``int8`` mode → ``reference.Int8ActExperts``). The prompt is this module's own source text
(seeded random ids for a checkpoint without a tokenizer).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p ‖ q), both ``[T, V]`` logits."""
    return float(F.kl_div(q_logits.log_softmax(-1), p_logits.log_softmax(-1), log_target=True, reduction="batchmean"))


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions whose argmax agrees."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@dataclass(frozen=True)
class AccuracyRow:
    """One (format, mode) measurement."""

    quant: str
    mode: str
    top1_vs_fp32: float
    kl_vs_fp32: float
    max_abs_vs_reference: float


def measure(folder: Path, prompt: list[int], quants: tuple[str, ...] = ("q8", "q4")) -> list[AccuracyRow]:
    """Rows for every format in ``quants`` and both expert modes (needs the C kernels for ``int8``)."""
    from ..engine import Engine
    from ..experts.core import set_expert_mode
    from .build import load
    from .reference import dequantized_reference

    fp32 = Engine.from_pretrained(folder).logits(prompt)
    rows = []
    for quant in quants:
        engine = Engine.from_pretrained(folder, quant=quant)
        for mode, activations in (("exact", "fp32"), ("int8", "int8")):
            if mode == "int8" and load() is None:
                continue
            set_expert_mode(engine.decoder, mode)
            logits = engine.logits(prompt)
            ref = Engine.from_pretrained(folder, quant=quant)
            dequantized_reference(ref.decoder, activations)
            diff = float((logits - ref.logits(prompt)).abs().max())
            rows.append(AccuracyRow(quant, mode, top1(logits, fp32), kl(fp32, logits), diff))
    return rows


def main(argv: list[str] | None = None) -> int:
    from ..builtin import builtin_model_dir
    from ..engine import Engine
    from ..errors import TokenizerError

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in model)")
    p.add_argument("--tokens", type=int, default=256, help="prompt length (this module's source, tokenized)")
    p.add_argument("--quant", default="q8,q4", help="comma-separated formats")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    folder = args.model or builtin_model_dir()
    engine = Engine.from_pretrained(folder)
    try:
        prompt = engine.tokenizer.encode(Path(__file__).read_text(encoding="utf-8"))[: args.tokens]
    except TokenizerError:  # a bare checkpoint: seeded random ids
        gen = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, engine.spec.vocab_size, (args.tokens,), generator=gen).tolist()
    print(f"{folder.name}: {len(prompt)} prompt tokens\n")
    print("| quant | expert mode | top-1 vs fp32 | KL vs fp32 | max abs logit diff vs its reference |")
    print("|---|---|---|---|---|")
    for r in measure(folder, prompt, tuple(args.quant.split(","))):
        print(f"| {r.quant} | {r.mode} | {r.top1_vs_fp32:.3f} | {r.kl_vs_fp32:.4f} | {r.max_abs_vs_reference:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

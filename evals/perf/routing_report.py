"""Routing report: which experts a trained MoE picks for plan text, code/commands and tool output.

    python -m freetoken_agent.evals.perf.routing_report [--model DIR] [--data-dir DIR] [--png routing.png]

Runs the model (our engine) over the held-out agent sessions (the same deterministic split as the built-in
model's training), each cut into ``--window``-token windows scored from an empty cache (as in training), and
records every routing decision through ``Decoder.routing_observers``. Tokens are labelled by phase from the
chat template (``data.phase_spans``); system prompt and task tokens are counted in no phase. Reported per layer:

- expert frequency per phase (share of the phase's top-k choices that went to each expert);
- Jensen–Shannon divergence (base 2, 0 = identical, 1 = disjoint) between the phases' distributions, next to a
  noise floor: the divergence between the same phase in two halves of the sessions (even vs odd);
- temporal locality: the mean share of token t+1's experts that token t also used (random routing: K/E).

Legend: L layers, E experts, K experts per token, T tokens.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.evals.builtin.data import (
    DEFAULT_DATA_DIR,
    phase_spans,
    render_session,
    session_files,
    split_sessions,
)
from freetoken_agent.evals.perf.harness import row

PHASES = ("plan", "code", "tool")


@dataclass
class RoutingReport:
    """Per-layer routing statistics of one model on a set of sessions (all arrays are nested lists, JSON-ready)."""

    model: str
    sessions: list[str]
    layers: int
    experts: int
    top_k: int
    tokens: dict[str, int]
    """Tokens counted per phase."""
    frequency: dict[str, list[list[float]]]
    """phase → [L][E] share of that phase's choices per expert (each layer sums to 1)."""
    jsd: dict[str, list[float | None]]
    """"a|b" → [L] Jensen–Shannon divergence (bits) between phases a and b."""
    noise_floor: dict[str, list[float | None]]
    """phase → [L] divergence between even- and odd-numbered sessions of the same phase."""
    locality: list[float | None]
    """[L] mean |experts(t) ∩ experts(t+1)| / K over consecutive tokens of a window."""
    locality_by_phase: dict[str, list[float | None]] = field(default_factory=dict)
    """phase → [L] the same, for pairs whose token t+1 is in that phase."""

    @property
    def random_locality(self) -> float:
        return self.top_k / self.experts


def jensen_shannon(p: torch.Tensor, q: torch.Tensor) -> float:
    """JS divergence in bits between two distributions (normalised here; zeros allowed)."""
    p, q = p.double() / p.sum(), q.double() / q.sum()
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> float:
        mask = a > 0
        return float((a[mask] * (a[mask] / m[mask]).log2()).sum())

    return 0.5 * kl(p) + 0.5 * kl(q)


class _Recorder:
    """Collects the top-k expert ids of every layer for one forward (a ``routing_observers`` callable)."""

    def __init__(self, layers: int) -> None:
        self.ids: list[torch.Tensor | None] = [None] * layers

    def __call__(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.ids[layer] = topk_ids.detach().cpu()


def token_phases(text: str, offsets: list[tuple[int, int]]) -> list[str | None]:
    """The phase of each token (by its first character), or None outside every phase span."""
    spans = phase_spans(text)
    starts = [s for s, _, _ in spans]
    out: list[str | None] = []
    for begin, _ in offsets:
        i = bisect.bisect_right(starts, begin) - 1
        out.append(spans[i][2] if i >= 0 and begin < spans[i][1] else None)
    return out


def measure(model_dir: Path, sessions: list[Path], window: int = 512, max_tokens: int | None = None) -> RoutingReport:
    """Run the model over ``sessions`` and aggregate the routing statistics."""
    from freetoken_agent.runtime.engine import Engine
    from tokenizers import Tokenizer

    engine = Engine.from_pretrained(model_dir, dtype="float32")
    moe_layers = [i for i, layer in enumerate(engine.spec.layers) if layer.moe is not None]
    if not moe_layers:
        raise SystemExit(f"routing_report: error: {model_dir} has no MoE layers")
    n_layers, top_k = engine.spec.num_layers, engine.spec.layers[moe_layers[0]].moe.top_k
    n_experts = engine.spec.layers[moe_layers[0]].moe.num_experts
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    recorder = _Recorder(n_layers)
    engine.decoder.routing_observers.append(recorder)
    # counts[phase][half] : [L, E]; reuse [L]; pairs [L]
    counts = {p: torch.zeros(2, n_layers, n_experts, dtype=torch.float64) for p in PHASES}
    reuse = torch.zeros(n_layers, dtype=torch.float64)
    reuse_by = {p: torch.zeros(n_layers, dtype=torch.float64) for p in PHASES}
    pairs, pairs_by = 0, {p: 0 for p in PHASES}
    for s_index, path in enumerate(sessions):
        text = render_session(path)
        enc = tokenizer.encode(text)
        ids, phases = enc.ids[:max_tokens], token_phases(text, enc.offsets)[:max_tokens]
        for start in range(0, len(ids) - 1, window):
            chunk, labels = ids[start: start + window], phases[start: start + window]
            engine.logits(chunk)
            for layer in moe_layers:
                chosen = recorder.ids[layer]  # [T, K]
                assert chosen is not None and chosen.shape[0] == len(chunk)
                for phase in PHASES:
                    rows = [t for t, lab in enumerate(labels) if lab == phase]
                    if rows:
                        counts[phase][s_index % 2, layer] += torch.bincount(
                            chosen[rows].reshape(-1), minlength=n_experts).double()
                # [T-1] how many of t+1's experts token t also chose
                same = (chosen[1:, :, None] == chosen[:-1, None, :]).any(-1).sum(-1).double() / top_k
                reuse[layer] += same.sum()
                for phase in PHASES:
                    mask = torch.tensor([lab == phase for lab in labels[1:]])
                    reuse_by[phase][layer] += same[mask].sum()
            pairs += len(chunk) - 1
            for phase in PHASES:
                pairs_by[phase] += sum(lab == phase for lab in labels[1:])
    total = {p: counts[p].sum(0) for p in PHASES}  # [L, E]

    def per_layer(values: list[float]) -> list[float | None]:
        return [round(v, 5) if layer in moe_layers else None for layer, v in enumerate(values)]

    def divergence(x: torch.Tensor, y: torch.Tensor) -> list[float | None]:  # [L, E] x2 -> [L]
        return per_layer([jensen_shannon(x[layer], y[layer]) for layer in range(n_layers)])

    return RoutingReport(
        model=str(model_dir), sessions=[p.name for p in sessions], layers=n_layers, experts=n_experts, top_k=top_k,
        tokens={p: int(total[p][moe_layers[0]].sum() / top_k) for p in PHASES},
        frequency={p: (total[p] / total[p].sum(-1, keepdim=True).clamp(min=1)).tolist() for p in PHASES},
        jsd={f"{a}|{b}": divergence(total[a], total[b])
             for a, b in combinations(PHASES, 2) if total[a].sum() and total[b].sum()},
        noise_floor={p: divergence(counts[p][0], counts[p][1]) for p in PHASES if counts[p][0].sum() and counts[p][1].sum()},
        locality=per_layer((reuse / max(pairs, 1)).tolist()),
        locality_by_phase={p: per_layer((reuse_by[p] / max(pairs_by[p], 1)).tolist()) for p in PHASES if pairs_by[p]},
    )


def _mean(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else float("nan")


def format_report(r: RoutingReport) -> str:
    """The report as a plain-text table (one row per layer)."""
    pairs, floors = list(r.jsd), list(r.noise_floor)
    lines = [f"routing report: {r.model}",
             f"{len(r.sessions)} held-out sessions; tokens per phase: "
             + ", ".join(f"{p} {n}" for p, n in r.tokens.items())
             + f"; {r.experts} experts, top-{r.top_k} (random routing: locality {r.random_locality:.3f})",
             "JSD in bits (0 = same expert distribution, 1 = disjoint); floor = same phase, even vs odd sessions",
             ""]
    head = ["layer"] + [f"JSD {p}" for p in pairs] + [f"floor {p}" for p in floors] + ["locality"]
    head += [f"loc {p}" for p in r.locality_by_phase]
    lines.append("  ".join(f"{h:>15}" for h in head))
    for layer in range(r.layers):
        row = [str(layer)] + [r.jsd[p][layer] for p in pairs] + [r.noise_floor[p][layer] for p in floors]
        row += [r.locality[layer]] + [r.locality_by_phase[p][layer] for p in r.locality_by_phase]
        lines.append("  ".join(f"{v:>15.4f}" if isinstance(v, float) else f"{v if v is not None else '-':>15}"
                               for v in row))
    row = ["mean"] + [_mean(r.jsd[p]) for p in pairs] + [_mean(r.noise_floor[p]) for p in floors]
    row += [_mean(r.locality)] + [_mean(r.locality_by_phase[p]) for p in r.locality_by_phase]
    lines.append("  ".join(f"{v:>15.4f}" if isinstance(v, float) else f"{v:>15}" for v in row))
    lines.append("")
    for phase, freq in r.frequency.items():
        if not r.tokens.get(phase):
            continue
        top = []
        for layer, shares in enumerate(freq):
            best = sorted(range(r.experts), key=lambda e: -shares[e])[:3]
            top.append(f"L{layer}:" + ",".join(f"e{e}={shares[e]:.2f}" for e in best))
        lines.append(f"top experts for {phase:>4}: " + "  ".join(top))
    return "\n".join(lines)


def plot_heatmap(r: RoutingReport, path: Path) -> None:
    """Draw expert frequency per phase ([L × E] heatmaps side by side) to a PNG (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("routing_report: error: the PNG needs matplotlib (pip install 'freetoken-agent[plots]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(r.frequency)
    vmax = max(max(max(row) for row in r.frequency[p]) for p in phases)
    fig, axes = plt.subplots(1, len(phases), figsize=(4.2 * len(phases), 0.45 * r.layers + 2.2), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        image = ax.imshow(r.frequency[phase], aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_title(f"{phase} ({r.tokens.get(phase, 0)} tokens)")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_xticks(range(r.experts))
        ax.set_yticks(range(r.layers))
        ax.tick_params(labelsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), label="share of the phase's top-k choices")
    pair_text = ", ".join(f"{k.replace('|', ' vs ')} {_mean(v):.3f}" for k, v in r.jsd.items())
    fig.suptitle(f"Expert frequency by phase (mean JSD, bits: {pair_text})", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m freetoken_agent.evals.perf.routing_report",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in model)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder of *.traj.json sessions")
    p.add_argument("--holdout-every", type=int, default=10, help="the training split: every N-th session held out")
    p.add_argument("--all-sessions", action="store_true", help="use every session, not only the held-out ones")
    p.add_argument("--window", type=int, default=512, help="tokens per forward (fresh cache per window)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per session at most")
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--png", type=Path, default=None, help="draw the heatmap here (needs matplotlib)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from freetoken_agent.runtime.builtin import builtin_model_dir

        args.model = builtin_model_dir()
    if not args.data_dir.is_dir():
        raise SystemExit(f"routing_report: error: data folder {args.data_dir} does not exist (pass --data-dir)")
    files = session_files(args.data_dir)
    sessions = files if args.all_sessions else split_sessions(files, every=args.holdout_every).held_out
    report = measure(args.model, sessions, window=args.window, max_tokens=args.max_tokens)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report.__dict__, indent=1) + "\n")
    if args.png is not None:
        plot_heatmap(report, args.png)
        print(f"heatmap: {args.png}", file=sys.stderr)
    return 0



@row("routing", "which experts a trained MoE picks for plan text, code and tool output (divergence, locality); "
     "flags are routing_report's", passthrough=True, format=lambda r, a: r["table"])
def routing_row(args: argparse.Namespace) -> dict[str, Any]:
    import contextlib
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out, table = Path(tmp) / "report.json", io.StringIO()
        with contextlib.redirect_stdout(table):
            main([*args.passthrough, "--json", str(out)])
        return {**json.loads(out.read_text()), "table": table.getvalue()}


if __name__ == "__main__":
    sys.exit(main())

"""Weight averaging of two exports of the built-in model: ``alpha * tuned + (1 - alpha) * base``, tensor by tensor.

A fine-tune on chat conversations teaches the tiny model to end a plain turn but pulls it away from the agent
format it learned first; the average of the fine-tuned and the base weights keeps both better than either end (the
built-in model's ``training.json`` records the measurements of the shipped average). Both folders must be exports of
the same architecture (same tensor names and shapes); the output is ``tuned``'s folder with the averaged weights,
bf16 as exported, and its ``training.json`` extended with the average's provenance.

    python -m freetoken_agent.evals.builtin.average --base DIR --tuned DIR --alpha 0.8 --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken_agent.evals.builtin.export import FOLDER_FILES

WEIGHTS = "model.safetensors"


def average_folders(base: Path, tuned: Path, alpha: float, out: Path) -> dict[str, float]:
    """Write ``out`` (see the module docstring); returns the provenance added to its ``training.json``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be within [0, 1], got {alpha}")
    a, b = load_file(str(tuned / WEIGHTS)), load_file(str(base / WEIGHTS))
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        raise ValueError(f"{base} and {tuned} are not the same architecture (tensor names or shapes differ)")
    mixed = {k: (alpha * a[k].float() + (1.0 - alpha) * b[k].float()).to(a[k].dtype) for k in sorted(a)}
    out.mkdir(parents=True, exist_ok=True)
    for name in FOLDER_FILES:
        if name != WEIGHTS and (tuned / name).exists() and (tuned / name).resolve() != (out / name).resolve():
            shutil.copyfile(tuned / name, out / name)
    save_file(mixed, str(out / WEIGHTS), metadata={"format": "pt"})
    provenance = {"alpha": alpha, "tuned": str(tuned), "base": str(base)}
    info_path = out / "training.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info["weight_average"] = provenance
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return provenance


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the export the fine-tune started from")
    p.add_argument("--tuned", type=Path, required=True, help="the fine-tuned export")
    p.add_argument("--alpha", type=float, required=True, help="weight of the fine-tuned export")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        average_folders(args.base, args.tuned, args.alpha, args.out)
    except (OSError, ValueError) as exc:
        p.exit(2, f"average: {exc}\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

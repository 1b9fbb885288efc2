"""``freetoken plan``: what runs on this machine, where each part lives, and how fast — from a config alone.

    freetoken plan --preset qwen3-30b-a3b [--device-memory 8GB] [--host-memory 16GB] [--context 8192]
                   [--quant q4|q8|none] [--json] [--validate]

Budgets default to this machine (GPU memory from the probe, 90% of available host memory). Rates are measured
once per machine and thread count (``runtime/execution/capacity_calibrate.py``, about 20 s, cached);
``--validate`` calibrates afresh in the same alternating rounds as its own measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from freetoken_agent.cli import CLIError
from freetoken_agent.cli.flags import count


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="capacity planner: placement and predicted tok/s from a model config")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a model folder (only its config.json is read)")
    src.add_argument("--preset", metavar="NAME", help="a bundled config: " + ", ".join(_preset_names()))
    p.add_argument("--device-memory", metavar="SIZE", help="device budget, e.g. 8GB (default: the GPU's, or none)")
    p.add_argument("--host-memory", metavar="SIZE", help="host budget, e.g. 16GB (default: 90%% of available)")
    p.add_argument("--context", type=count(), default=4096, help="tokens of KV to plan for (default 4096)")
    p.add_argument("--quant", default="q4", choices=["q4", "q8", "none"], help="routed experts (default q4)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dense weights and KV (default float32, the CPU engine's default)")
    p.add_argument("--threads", type=count(), default=1, help="CPU threads the rates are measured at (default 1)")
    p.add_argument("--recalibrate", action="store_true", help="measure the rates again")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--validate", action="store_true",
                   help="build a random-weight model of this shape (scaled down if needed), time it, compare")
    p.set_defaults(func=run)


def _preset_names() -> list[str]:
    from freetoken_agent.runtime.execution.capacity_presets import PRESETS

    return sorted(PRESETS)


def _config(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if args.preset:
        from freetoken_agent.runtime.execution.capacity_presets import preset_config

        return args.preset.lower(), preset_config(args.preset)
    path = Path(args.model)
    cfg = path / "config.json" if path.is_dir() else path
    if not cfg.is_file():
        raise CLIError(f"no config.json at {path}")
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read {cfg}: {exc}") from None
    if not isinstance(data, dict):
        raise CLIError(f"{cfg} is not a JSON object")
    return path.name, data


def _budgets(args: argparse.Namespace) -> tuple[int | None, int | None]:
    from freetoken_agent.runtime import hardware
    from freetoken_agent.runtime.memory import parse_bytes

    _fp, _cpu, memory, _disk, gpus = hardware.describe()
    device = parse_bytes(args.device_memory) if args.device_memory else (
        int(gpus[0]["total"] * 0.9) if gpus else None)
    host = parse_bytes(args.host_memory) if args.host_memory else int(
        memory.get("available", memory.get("total", 0)) * 0.9) or None
    return device, host


def run(args: argparse.Namespace) -> int:
    from freetoken_agent.runtime.execution import capacity
    from freetoken_agent.runtime.execution.capacity_calibrate import load_or_calibrate

    if args.context < 1:
        raise CLIError(f"--context must be at least 1, got {args.context}")
    if args.threads < 1:
        raise CLIError(f"--threads must be at least 1, got {args.threads}")
    name, config = _config(args)
    size = capacity.model_size(config, args.quant, args.dtype)
    device, host = _budgets(args)
    rates = load_or_calibrate(args.threads, args.quant if args.quant != "none" else "none", args.recalibrate)
    plan = capacity.plan(size, rates, device, host, args.context, model=name, quant=args.quant)
    if args.dtype != "float32":
        plan.notes.append(f"rates were measured with float32 dense weights; {args.dtype} moves half the bytes "
                          "(the byte terms scale, the kernels may not)")
    out: dict[str, Any] = plan.to_json()
    validation = None
    if args.validate:
        from freetoken_agent.runtime.execution.capacity_validate import validate

        validation = validate(config, args.quant, args.threads)
        out["validate"] = validation
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(capacity.format_plan(plan))
        if validation is not None:
            from freetoken_agent.runtime.execution.capacity_validate import (
                format_validation,
            )

            print(format_validation(validation))
    return 0 if plan.fits else 1

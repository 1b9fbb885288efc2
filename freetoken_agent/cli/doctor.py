"""``freetoken doctor``: this machine's hardware profile (devices, memory, measured rates) and the sandbox
mechanisms its coding tools can use (Landlock, namespaces, bubblewrap), as a table.

The profile is cached per machine (``$FREETOKEN_CACHE/hardware.json``); ``--refresh`` measures again. The planner
reads the same cached numbers, so what ``doctor`` prints is what expert placement decisions are based on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from freetoken_agent.cli.flags import seconds


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="probe this machine (memory, disk, GPU, expert-kernel GB/s) and print it")
    p.add_argument("--refresh", action="store_true", help="run the microbenchmarks again instead of the cache")
    p.add_argument("--seconds", type=seconds(), default=1.0, help="time per microbenchmark (default 1 s)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.1f} GB"


def _rate(v: float | None, unit: str = "GB/s") -> str:
    return "not measured" if v is None else f"{v} {unit}"


def rows(profile: object) -> list[tuple[str, str]]:
    """(name, value) rows of a ``HardwareProfile``."""
    p = profile  # runtime.hardware.HardwareProfile
    cpu, mem, disk, b = p.cpu, p.memory, p.disk, p.bench  # type: ignore[attr-defined]
    out = [
        ("cpu", f"{cpu['model']} ({cpu['arch']})"),
        ("cores", f"{cpu['cores']} ({cpu['usable']} usable)"),
        ("simd", ", ".join(cpu["simd"]) or "none detected"),
        ("ram", f"{_gb(mem.get('total'))} total, {_gb(mem.get('available'))} available"),
        ("disk", f"{disk['path']}: {_gb(disk['free'])} free of {_gb(disk['total'])}"),
    ]
    for g in p.gpus:  # type: ignore[attr-defined]
        out.append((f"gpu {g['index']}", f"{g['name']}: {_gb(g['free'])} free of {_gb(g['total'])}"))
    if not p.gpus:  # type: ignore[attr-defined]
        out.append(("gpu", "none (CPU-only: tiers are host RAM <- disk)"))
    kernel = disk.get("expert_kernel", "?")
    out += [
        ("host memcpy", _rate(b.get("memcpy_gbps"))),
        (f"cpu expert M=1 ({kernel})", _rate(b.get("cpu_expert_gbps_m1"))),
        (f"cpu expert M=16 ({kernel})", _rate(b.get("cpu_expert_gbps_m16"))),
        ("disk read (cold)", _rate(b.get("disk_read_gbps"))),
    ]
    if p.gpus:  # type: ignore[attr-defined]
        dev_s = b.get("device_expert_s")
        out += [("host->device pinned", _rate(b.get("h2d_pinned_gbps"))),
                ("host->device pageable", _rate(b.get("h2d_pageable_gbps"))),
                ("device expert M=1 (fp16)", "not measured" if dev_s is None else f"{dev_s * 1e6:.0f} us")]
    out.append(("probed", p.probed_at))  # type: ignore[attr-defined]
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from freetoken_agent.cli import CLIError
    from freetoken_agent.runtime.hardware import cache_path, load_or_probe

    if args.seconds <= 0 or args.seconds > 60:
        raise CLIError(f"--seconds must be in (0, 60], got {args.seconds}")
    from freetoken_agent.tools.sandbox import probe as sandbox_probe

    profile = load_or_probe(refresh=args.refresh, seconds=args.seconds)
    sandbox = sandbox_probe()
    if args.json:
        print(json.dumps({**profile.to_json(), "sandbox": dataclasses.asdict(sandbox)}, indent=2))
        return 0
    table = Table(title=f"freetoken doctor (cached in {cache_path()})", show_header=False)
    for name, value in rows(profile):
        table.add_row(name, value)
    from freetoken_agent.runtime.kernels import status as kernel_status

    ks = kernel_status()  # builds the C kernels on first use; says why not when it cannot
    table.add_row("cpu expert kernels", f"C, {ks.isa} ({ks.path})" if ks.available else ks.reason)
    from freetoken_agent.runtime.kernels import hugepages

    table.add_row("weights in 2 MiB pages", hugepages.describe())
    for name, value in sandbox.rows():  # what run_shell / run_tests are confined with on this machine
        table.add_row(name, value)
    Console().print(table)
    return 0

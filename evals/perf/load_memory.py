"""What a budgeted load costs in host memory: peak RSS of a cold and a warm ``--host-memory`` load plus a generation.

Builds a synthetic ``qwen3_moe`` checkpoint (random weights, bf16 like a published one) whose experts are several
times the budget, then runs each phase in a fresh child process and reports what the kernel saw:

- ``floor``: the interpreter with torch, the runtime and a tokenizer imported and loaded, no model (what every
  budget is added to);
- ``cold``: the first budgeted load (the expert cache file is written from the checkpoint) + a greedy generation;
- ``warm``: the same with the cache file already there.

Per phase: wall time, peak RSS (``VmHWM``: anonymous + file pages mapped), peak anonymous RSS (sampled every 2 ms),
and, with ``--cgroup`` where a cgroup-v1 memory controller is writable, the cgroup's peak usage (which also counts
page cache) under a hard cap of ``budget + floor + margin``.

    python -m freetoken_agent.evals.perf.load_memory --experts 64 --layers 8 --budget 100MB --quant q8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import row, run_json_main

CHILD = r"""
import json, os, sys, threading, time
peak = {"RssAnon": 0, "VmData": 0}
def sample():
    while True:
        for line in open("/proc/self/status"):
            key = line.split(":")[0]
            if key in peak:
                peak[key] = max(peak[key], int(line.split()[1]) * 1024)
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
import torch
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.memory import Budget
from freetoken_agent.runtime.tokenizer import Tokenizer
from freetoken_agent.runtime.kernels import build, ops
out = {}
if args["phase"] == "floor":
    tok = Tokenizer.from_pretrained(args["model"])
    tok.encode("def f(x): return x")
    if build.load() is not None:  # the C kernels' library and thread pool
        ops.quantize(torch.randn(64, 256), "q8_0")
else:
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from pathlib import Path
    residency = ResidencyConfig(cache_path=Path(args["cache"]))
    kw = {"budget": Budget(host=args["budget"]), "residency": residency} if args["budget"] else {}
    eng = Engine.from_pretrained(args["model"], quant=args["quant"], dense_quant=args["dense_quant"],
                                 dtype=args["dtype"], **kw)
    out["load_s"] = round(time.perf_counter() - t0, 2)
    res = eng.generate(list(range(1, 33)), max_new_tokens=args["tokens"], stop_token_ids=(), temperature=0.0)
    out["tokens"] = list(res.token_ids)
    eng.close()
time.sleep(0.01)
status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
          if l.startswith(("VmHWM", "VmPeak"))}
out.update(wall_s=round(time.perf_counter() - t0, 2), hwm=status["VmHWM"], anon_peak=peak["RssAnon"],
           data_peak=peak["VmData"], vm_peak=status["VmPeak"])
print("RESULT " + json.dumps(out))
"""

CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def write_bf16_checkpoint(folder: Path, experts: int, layers: int, hidden: int, inter: int, **config: Any) -> Path:
    """A random-weight bf16 ``qwen3_moe`` folder (written once; one tensor in memory at a time is not needed here:
    the writer holds the whole model, which is fine for the few hundred MB this benchmark uses)."""
    import torch
    from safetensors.torch import save_file

    from freetoken_agent.runtime.model.adapters import spec_from_config
    from freetoken_agent.runtime.model.weights import expected_tensors
    from freetoken_agent.runtime.synthetic import PRESETS, write_tokenizer

    if (folder / "model.safetensors").is_file():
        return folder
    base = dict(vocab_size=1024, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = {**base, **PRESETS["qwen3_moe"], "num_experts": experts, "num_hidden_layers": layers,
              "hidden_size": hidden, "moe_intermediate_size": inter, "torch_dtype": "bfloat16", **config}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in expected_tensors(spec_from_config(config)).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            tensors[name] = (torch.randn(shape, generator=gen) * (2.0 / fan_in) ** 0.5).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder, int(config["vocab_size"]))
    return folder


def run_phase(phase: str, model: Path, cache: Path, args: argparse.Namespace, cap: int | None) -> dict[str, Any]:
    env = dict(os.environ)
    payload = json.dumps({"phase": phase, "model": str(model), "cache": str(cache / "experts.ftx"),
                          "budget": args.budget_bytes, "quant": args.quant, "dense_quant": args.dense_quant,
                          "dtype": args.dtype, "tokens": args.tokens})
    group = None
    if cap is not None:
        group = CGROUP_V1 / f"ft-load-memory-{os.getpid()}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(cap))
    pre = (f"open('{group}/cgroup.procs', 'w').write(str(__import__('os').getpid()))\n" if group else "")
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run([sys.executable, "-c", pre + CHILD, payload], env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        out: dict[str, Any] = json.loads(line[7:]) if line else {"error": f"rc {proc.returncode}: {proc.stderr[-400:]}"}
        out["cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)
        if group is not None:
            out["cgroup_peak"] = int((group / "memory.max_usage_in_bytes").read_text())
        return out
    finally:
        if group is not None:
            group.rmdir()


def main(argv: list[str] | None = None) -> int:
    from freetoken_agent.runtime.memory import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--budget", default="100MB")
    p.add_argument("--quant", default="none", choices=["none", "q8", "q4"])
    p.add_argument("--dense-quant", default="none", choices=["none", "q8", "q4"])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "ft-load-memory"))
    p.add_argument("--cgroup", action="store_true", help="run each phase under a cgroup-v1 cap of budget + floor + "
                   "--margin (needs a writable /sys/fs/cgroup/memory)")
    p.add_argument("--margin", default="64MB")
    p.add_argument("--phases", default="floor,cold,warm,full")
    p.add_argument("--json", action="store_true", help="print the report as JSON (progress lines go to stderr)")
    args = p.parse_args(argv)
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print  # noqa: E731
    args.budget_bytes = parse_bytes(args.budget)
    root = Path(args.folder)
    name = f"qwen3_moe-e{args.experts}-l{args.layers}-h{args.hidden}-i{args.inter}-a{args.heads}-{args.kv_heads}"
    model = write_bf16_checkpoint(root / name, args.experts, args.layers, args.hidden, args.inter,
                                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    cache = Path(tempfile.mkdtemp(prefix="ft-load-memory-cache-"))
    size = (model / "model.safetensors").stat().st_size
    say(f"checkpoint {model} ({size / 2**20:.0f} MiB), budget {args.budget}, quant {args.quant}")
    results: dict[str, dict[str, Any]] = {}
    floor = None
    for phase in args.phases.split(","):
        cap = None
        if args.cgroup and phase in ("cold", "warm") and floor is not None:
            cap = args.budget_bytes + floor + (parse_bytes(args.margin) if args.margin.strip("0MBmb. ") else 0)
        if phase == "full":  # the unbudgeted reference: same tokens expected
            saved, args.budget_bytes = args.budget_bytes, 0
            results[phase] = run_phase(phase, model, cache, args, None)
            args.budget_bytes = saved
        else:
            results[phase] = run_phase(phase, model, cache, args, cap)
        if phase == "floor":
            floor = results[phase].get("hwm")
        r = results[phase]
        mib = lambda k: f"{r[k] / 2**20:.0f} MiB" if k in r else "-"  # noqa: E731
        say(f"{phase:6s} cpu {r.get('cpu_s', '-')} s wall {r.get('wall_s', '-')} s load {r.get('load_s', '-')} s  "
              f"VmHWM {mib('hwm')}  peak anon {mib('anon_peak')}  peak VmData {mib('data_peak')}  "
              f"VmPeak {mib('vm_peak')}  cgroup peak {mib('cgroup_peak')}"
              + (f"  cap {cap / 2**20:.0f} MiB" if cap else "") + (f"  ERROR {r['error']}" if "error" in r else ""))
    toks = {k: v.get("tokens") for k, v in results.items() if "tokens" in v}
    same = len(set(map(tuple, toks.values()))) <= 1
    if not same:
        say(f"TOKENS DIFFER: {toks}")
    elif toks:
        say(f"same tokens in {', '.join(toks)}")
    if args.json:
        print(json.dumps({"checkpoint": str(model), "checkpoint_bytes": size, "budget_bytes": args.budget_bytes,
                          "quant": args.quant, "same_tokens": same,
                          "phases": {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in results.items()}},
                         indent=1))
    return 0



@row("load-memory", "host memory of a budgeted load: peak RSS of the floor, a cold and a warm --host-memory load plus a "
     "generation, each in a child process; flags are load_memory's", passthrough=True)
def load_memory_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())

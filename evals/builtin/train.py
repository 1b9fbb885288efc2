"""Train the built-in ``qwen3_moe`` model on agent sessions + stdlib code, on the CPU (a dev tool).

    python -m freetoken_agent.evals.builtin.train --out freetoken_agent/builtin --work-dir /tmp/builtin-run \\
        --max-minutes 90

Fine-tune the shipped model instead of starting from random weights (its tokenizer and architecture are kept):

    python -m freetoken_agent.evals.builtin.train --init-from freetoken_agent/builtin --out freetoken_agent/builtin \
        --work-dir /tmp/builtin-ft --max-minutes 20 --lr 5e-4 --warmup 20

Each step trains on ``--batch`` windows of the agent-session + stdlib stream and ``--chat-batch`` whole chat
conversations (:mod:`freetoken_agent.evals.builtin.chat`, scored on the assistant turns only). Seeded; resumable (``--work-dir`` keeps the tokenizer, the tokenized corpus, ``checkpoint.pt`` and
``loss_log.jsonl``; rerunning the same command continues from the last checkpoint); every checkpoint also
exports the Hugging Face folder to ``--out``, so an interrupted run still leaves a usable model. The learning
rate follows a cosine over whichever of ``--max-steps`` / ``--max-minutes`` runs out first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from freetoken_agent.evals.builtin.corpus import Corpus, build_corpus, chat_batch, sample_batch
from freetoken_agent.evals.builtin.data import DEFAULT_DATA_DIR
from freetoken_agent.evals.builtin.evaluate import chat_perplexity, perplexity
from freetoken_agent.evals.builtin.export import export_folder
from freetoken_agent.evals.builtin.model import ModelSize, build_model, describe, load_model
from tokenizers import Tokenizer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m freetoken_agent.evals.builtin.train", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder of *.traj.json sessions")
    p.add_argument("--out", type=Path, required=True, help="Hugging Face folder to write")
    p.add_argument("--work-dir", type=Path, required=True, help="tokenizer, corpus cache, checkpoint, loss log")
    p.add_argument("--init-from", type=Path, default=None,
                   help="exported model folder to continue from (its weights, tokenizer and size; size flags ignored)")
    p.add_argument("--chat-docs", type=int, default=4000, help="chat conversations generated for training")
    p.add_argument("--chat-batch", type=int, default=2, help="chat conversations per step (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--max-minutes", type=float, default=90.0, help="training wall budget (eval/export excluded)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--aux-loss", type=float, default=0.01, help="router load-balancing loss coefficient")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--stdlib-chars", type=int, default=3_000_000, help="stdlib Python source added as code text")
    p.add_argument("--holdout-every", type=int, default=10, help="hold out every N-th session (sorted by name)")
    p.add_argument("--save-minutes", type=float, default=10.0, help="checkpoint + export interval")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-windows", type=int, default=24, help="held-out windows scored at each checkpoint")
    for field, value in describe(ModelSize()).items():
        if field != "vocab":
            p.add_argument(f"--{field.replace('_', '-')}", type=int, default=value)
    return p.parse_args(argv)


def model_size(args: argparse.Namespace) -> ModelSize:
    fields = describe(ModelSize()).keys()
    return ModelSize(**{f: getattr(args, f) for f in fields if f != "vocab"}, vocab=args.vocab)


def lr_at(args: argparse.Namespace, step: int, elapsed_s: float) -> float:
    """Linear warm-up, then cosine to 10% over the fraction of the step or time budget used, whichever is larger."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    done = min(1.0, max(step / args.max_steps, elapsed_s / (60 * args.max_minutes)))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


class Trainer:
    """The training state (model, optimizer, sampler, counters) and its checkpoint round-trip."""

    def __init__(self, args: argparse.Namespace, corpus: Corpus) -> None:
        self.args, self.corpus = args, corpus
        if args.init_from is not None:
            self.model, self.size = load_model(args.init_from, args.aux_loss)
        else:
            self.size = model_size(args)
            self.model = build_model(self.size, args.seed, args.aux_loss)
        self.base: dict = {}  # for --init-from: the starting model's run record and its scores on this corpus
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        other = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                            {"params": other, "weight_decay": 0.0}],
                                           lr=args.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(args.seed)
        self.step, self.elapsed_s, self.tokens = 0, 0.0, 0
        self.ckpt = args.work_dir / "checkpoint.pt"
        self.log_path = args.work_dir / "loss_log.jsonl"

    def resume(self) -> bool:
        if not self.ckpt.exists():
            return False
        state = torch.load(self.ckpt, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gen.set_state(state["generator"])
        self.step, self.elapsed_s, self.tokens = state["step"], state["elapsed_s"], state["tokens"]
        self.base = state.get("base", {})
        return True

    def save(self, console: Console) -> dict:
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "generator": self.gen.get_state(), "step": self.step, "elapsed_s": self.elapsed_s,
                    "tokens": self.tokens, "base": self.base}, tmp)
        tmp.replace(self.ckpt)
        ppl, scored = perplexity(self.model, self.corpus.held_out, self.args.seq_len, self.args.eval_windows)
        info = {"step": self.step, "tokens_seen": self.tokens, "train_minutes": round(self.elapsed_s / 60, 2),
                "held_out_ppl_sample": round(ppl, 3), "held_out_tokens_scored": scored}
        if self.corpus.chat_held_out.ids:
            info["chat_held_out_ppl"] = round(chat_perplexity(self.model, self.corpus.chat_held_out)[0], 3)
        self.log(info)
        export_folder(self.model, self.corpus.tokenizer, self.args.out, self.provenance(info))
        console.print(f"checkpoint step {self.step}: held-out ppl (sample of {scored} tokens) {ppl:.2f}")
        return info

    def provenance(self, info: dict) -> dict:
        a = self.args
        return {"trained_by": "freetoken_agent.evals.builtin.train", "seed": a.seed, "size": describe(self.size),
                "batch": a.batch, "seq_len": a.seq_len, "lr": a.lr, "aux_loss": a.aux_loss,
                "chat_batch": a.chat_batch, "chat_docs": len(self.corpus.chat.ids),
                "train_tokens_in_corpus": self.corpus.train.numel(),
                "held_out_sessions": self.corpus.held_out_sessions, **({"base": self.base} if self.base else {}),
                **info}

    def log(self, record: dict) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def train_step(self) -> tuple[float, float, float | None]:
        """One optimizer step; ``(stream LM loss, router aux loss, chat LM loss or None)``."""
        a = self.args
        lr = lr_at(a, self.step, self.elapsed_s)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ids = sample_batch(self.corpus.train, a.batch, a.seq_len, self.gen)
        out = self.model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        self.tokens += ids.numel()
        chat = None
        if a.chat_batch > 0 and self.corpus.chat.ids:
            chat_ids, labels, mask = chat_batch(self.corpus.chat, a.chat_batch, self.gen)
            chat_out = self.model(input_ids=chat_ids, attention_mask=mask, labels=labels, output_router_logits=True)
            chat_out.loss.backward()
            self.tokens += int(mask.sum())
            chat = float(chat_out.loss.detach()) - a.aux_loss * float(chat_out.aux_loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        lm = float(out.loss.detach()) - a.aux_loss * float(out.aux_loss.detach())
        return lm, float(out.aux_loss.detach()), chat


def base_record(trainer: Trainer, args: argparse.Namespace) -> dict:
    """The starting model of ``--init-from``: its own run record (training.json, with its perplexity over all
    held-out tokens) and its scores on this corpus (the held-out sample that checkpoints report, the chat set)."""
    path = args.init_from / "training.json"
    before = json.loads(path.read_text()) if path.is_file() else {}
    ppl, scored = perplexity(trainer.model, trainer.corpus.held_out, args.seq_len, args.eval_windows)
    record = {"init_from": str(args.init_from), "held_out_ppl_sample": round(ppl, 3),
              "held_out_tokens_scored": scored,
              "run": {k: before[k] for k in ("step", "tokens_seen", "train_minutes", "held_out_ppl", "base")
                      if k in before}}
    if trainer.corpus.chat_held_out.ids:
        record["chat_held_out_ppl"] = round(chat_perplexity(trainer.model, trainer.corpus.chat_held_out)[0], 3)
    return record


def run(argv: list[str] | None = None) -> dict:
    """Train (or resume) and export; returns the final record (held-out perplexity over all held-out tokens)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    if not args.data_dir.is_dir():
        raise SystemExit(f"train: error: data folder {args.data_dir} does not exist (pass --data-dir)")
    tokenizer = None
    if args.init_from is not None:
        if not (args.init_from / "tokenizer.json").is_file():
            raise SystemExit(f"train: error: --init-from {args.init_from} is not an exported model folder "
                             "(no tokenizer.json)")
        tokenizer = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        args.vocab = tokenizer.get_vocab_size()
    corpus = build_corpus(args.data_dir, args.work_dir, args.vocab, args.stdlib_chars, args.holdout_every,
                          args.chat_docs, tokenizer)
    trainer = Trainer(args, corpus)
    resumed = trainer.resume()
    if args.init_from is not None and not resumed:
        trainer.base = base_record(trainer, args)
        trainer.log({"base": trainer.base})
        console.print(f"starting model: held-out perplexity (sample) {trainer.base['held_out_ppl_sample']:.2f}, "
                      f"chat held-out perplexity {trainer.base.get('chat_held_out_ppl')}")
    n_params = sum(p.numel() for p in trainer.model.parameters())
    console.print(f"{'resumed at step ' + str(trainer.step) if resumed else 'new run'}: {n_params / 1e6:.2f}M params, "
                  f"{corpus.train.numel()} train tokens, {corpus.held_out.numel()} held-out tokens")
    trainer.model.train()
    budget_s, last_save = 60 * args.max_minutes, trainer.elapsed_s
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("train", total=args.max_steps, completed=trainer.step)
        while trainer.step < args.max_steps and trainer.elapsed_s < budget_s:
            t0 = time.perf_counter()
            loss, aux, chat = trainer.train_step()
            trainer.elapsed_s += time.perf_counter() - t0
            progress.update(task, completed=trainer.step, description=f"loss {loss:.3f}")
            if trainer.step % args.log_every == 0 or trainer.step == 1:
                record = {"step": trainer.step, "loss": round(loss, 4), "aux": round(aux, 4),
                          "lr": lr_at(args, trainer.step, trainer.elapsed_s), "elapsed_s": round(trainer.elapsed_s, 1),
                          "tok_per_s": round(trainer.tokens / max(trainer.elapsed_s, 1e-9), 1),
                          **({"chat_loss": round(chat, 4)} if chat is not None else {})}
                trainer.log(record)
                if not console.is_terminal:
                    print(json.dumps(record), file=sys.stderr, flush=True)
            if trainer.elapsed_s - last_save >= 60 * args.save_minutes:
                trainer.save(console)
                last_save = trainer.elapsed_s
    info = trainer.save(console)
    ppl, scored = perplexity(trainer.model, corpus.held_out, args.seq_len)
    final = {**info, "held_out_ppl": round(ppl, 3), "held_out_tokens_scored": scored}
    trainer.log(final)
    export_folder(trainer.model, corpus.tokenizer, args.out, trainer.provenance(final))
    console.print(f"done: step {trainer.step}, held-out perplexity {ppl:.2f} over {scored} tokens -> {args.out}")
    return final


if __name__ == "__main__":
    run(sys.argv[1:])
    sys.exit(0)

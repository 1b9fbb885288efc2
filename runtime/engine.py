"""The engine API: load a Hugging Face MoE folder; submit requests; logits, generate (blocking or streaming), chat.

``Engine`` is a facade over the parts it builds at load: spec → weights → experts → ``ModelRunner`` (the one code
path that runs the layers, ``runtime/runner.py``) → ``Scheduler`` (continuous batching on the engine's own thread,
``runtime/scheduler.py``). ``submit(request) -> RequestHandle`` is safe from any thread or task; ``generate``,
``iter_generate``, ``stream``, ``chat`` and ``logits`` are thin wrappers over it, so concurrent callers share steps.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.runtime.checkpoint.reader import load_config
from freetoken_agent.runtime.errors import FreeTokenError, OptionError, TokenizerError
from freetoken_agent.runtime.generation.prompt import as_token_ids
from freetoken_agent.runtime.generation.sampling import SamplingParams
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.compressed import cached_width
from freetoken_agent.runtime.model.decoder import Decoder
from freetoken_agent.runtime.model.spec import ModelSpec
from freetoken_agent.runtime.model.weights import load_weights
from freetoken_agent.runtime.phase import Phase
from freetoken_agent.runtime.runner import ModelRunner
from freetoken_agent.runtime.scheduler import (
    ContextLengthError,
    Request,
    RequestCancelled,
    RequestHandle,
    RequestResult,
    Scheduler,
    TokenEvent,
)
from freetoken_agent.runtime.threads import configure_threads
from freetoken_agent.runtime.tokenizer.chat import ChatTemplate
from freetoken_agent.runtime.tokenizer.tokenizer import Tokenizer

__all__ = ["ContextLengthError", "Engine", "GenerationResult", "Request", "RequestCancelled", "RequestHandle",
           "TokenEvent"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
PREFILL_CHUNK = 512
"""Tokens per scheduler step (decode tokens of running sequences + prefill chunks): bounds the attention score
matrix and how long one step keeps other sessions waiting."""


@dataclass
class GenerationResult:
    """What ``generate``/``chat`` return."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, r: RequestResult) -> GenerationResult:
        return cls(r.token_ids, r.text, r.finish_reason, r.prompt_tokens, r.prefill_s, r.decode_s)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    """Prompt tokens actually prefilled (recomputation after a preemption included)."""
    generated_tokens: int = 0
    prefill_s: float = 0.0
    """Seconds of steps that prefilled (a step that mixes prefill chunks and decode tokens counts here)."""
    decode_s: float = 0.0
    requests: int = 0
    phase: str | None = None
    phase_hints: dict[str, int] = field(default_factory=dict)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise OptionError(f"unknown dtype {dtype!r}; use one of: float32, bfloat16, float16")
    return _DTYPES[dtype]


def check_device(device: str | torch.device) -> None:
    """An ``OptionError`` for a device torch cannot name or this machine does not have (before anything loads)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise OptionError(f"unknown device {device!r}; use cpu, or cuda (cuda:N for one GPU)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise OptionError(f"device {device!r} asked for, but torch sees no CUDA GPU here (use --device cpu)")
        if dev.index is not None and dev.index >= count:
            raise OptionError(f"device {device!r} asked for, but torch sees {count} CUDA GPU(s): "
                              f"cuda:0..cuda:{count - 1}")
    elif dev.type not in ("cpu", "meta"):
        available = getattr(getattr(torch, dev.type, None), "is_available", None)
        if available is None or not available():
            raise OptionError(f"device {device!r} is not available with this torch build and machine")


class Engine:
    """An MoE model loaded for inference on one device."""

    def __init__(
        self,
        spec: ModelSpec,
        decoder: Decoder,
        tokenizer: Tokenizer | None,
        chat_template: ChatTemplate | None,
        path: Path | None = None,
        generation_config: dict[str, Any] | None = None,
    ) -> None:
        self.spec, self.decoder, self.path = spec, decoder, path
        self._tokenizer, self._chat_template = tokenizer, chat_template
        self.generation_config = generation_config or {}
        self._stats = EngineStats()
        self.threads = torch.get_num_threads()
        self._kv: Any = None
        self.quant: Any = None  # runtime.kernels.apply.QuantReport when experts were quantized at load
        self.dense_quant: Any = None  # runtime.kernels.dense.DenseQuantReport with dense_quant="q8"/"q4"
        self.lock = threading.RLock()
        """Held by the scheduler thread for each step; KV and residency changes from other threads take it."""
        self.runner = ModelRunner(decoder)
        self.scheduler = Scheduler(
            self.runner, self.kv_manager, self.lock, tokenizer, self.eos_token_ids, spec.vocab_size,
            spec.max_position, token_budget=PREFILL_CHUNK, on_step=self._on_step,
        )
        self.phase_scheduler: Any = None  # runtime.experts.phase.PhaseScheduler once attached (issue 8)
        self.residency: Any = None  # runtime.experts.store.ExpertStore when loaded under a memory budget
        self.phase_listeners: list[Any] = []  # phase scheduling (issue 8): callables (phase, expected_s)

    @property
    def decode_torch_threads(self) -> int | None:
        """Torch threads during decode-only steps (None: unchanged); see ``ModelRunner``."""
        return self.runner.decode_torch_threads

    @decode_torch_threads.setter
    def decode_torch_threads(self, n: int | None) -> None:
        self.runner.decode_torch_threads = n

    # ------------------------------------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        require_tokenizer: bool = False,
        progress: bool | None = None,
        threads: int | None = None,
        quant: str = "none",
        budget: Any = None,
        residency: Any = None,
        dense_quant: str = "none",
        deterministic: bool = False,
    ) -> Engine:
        """Load a model folder (``config.json`` + ``*.safetensors``; tokenizer files when present).

        ``quant``: ``none``, ``q8`` or ``q4`` — routed experts quantized at load (Q8_0 / Q4_0 blocks, CPU kernels
        in ``runtime/kernels``); dense weights stay in ``dtype`` unless ``dense_quant`` (``q8``/``q4``) converts the
        attention projections, dense MLPs and lm_head too (``runtime/kernels/dense.py``).

        ``budget`` (``runtime.memory.Budget``) / ``residency`` (``runtime.experts.setup.ResidencyConfig``): keep
        routed experts in budgeted tiers (slots ← expert cache file) instead of loading them all; see
        ``runtime/experts/``. ``engine.residency`` is then the ``ExpertStore``.

        ``deterministic``: switch the kernels to their batch-invariant mode (process-wide,
        ``runtime.kernels.ops.set_deterministic``): each row's result is then independent of what shares its step
        and of how its prefix was chunked, so a greedy request returns the same tokens every time.

        ``threads``: CPU threads for torch (default: ``$FREETOKEN_THREADS``, else the cores free right now).
        Raises a ``FreeTokenError`` subclass with one clear line for every kind of bad input.
        """
        path = Path(path)
        from freetoken_agent.runtime.kernels.apply import check_quant, quantize_experts
        from freetoken_agent.runtime.kernels.dense import quantize_dense
        from freetoken_agent.runtime.kernels.mapped import load_quantized
        from freetoken_agent.runtime.kernels.mapped import supported as mapped_supported
        from freetoken_agent.runtime.quant.native import open_checkpoint

        quant = check_quant(quant)
        check_device(device)
        if deterministic:
            from freetoken_agent.runtime.kernels import ops as kernel_ops

            kernel_ops.set_deterministic(True)
        n_threads = configure_threads(threads)
        spec = spec_from_config(load_config(path))
        reader = open_checkpoint(path)  # FP8-block / MXFP4 tensors are decoded on read
        torch_dtype = _dtype(dtype)
        show = progress if progress is not None else reader.total_bytes() > 256 * 2**20
        managed = mapped = None
        if budget is not None or residency is not None:
            from freetoken_agent.runtime.experts.setup import load_managed

            managed = load_managed(spec, reader, path, torch_dtype, device, quant, budget, residency, dense_quant)
            weights, dense_report = managed.weights, managed.dense_quant
        elif quant != "none" and mapped_supported(spec, device):  # experts mapped from the expert cache file
            mapped = load_quantized(spec, reader, path, torch_dtype, device, quant, show)
            weights = mapped.weights
        elif show:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task(f"loading {path.name}", total=spec.num_layers)
                weights = load_weights(spec, reader, torch_dtype, device, on_layer=lambda i: bar.advance(task))
        else:
            weights = load_weights(spec, reader, torch_dtype, device)
        if managed is None:
            dense_report = quantize_dense(spec, weights, dense_quant)
        tokenizer = template = None
        try:
            tokenizer = Tokenizer.from_pretrained(path)
            template = ChatTemplate.from_pretrained(path)
        except TokenizerError:
            if require_tokenizer:
                raise
        gen_cfg: dict[str, Any] = {}
        if (path / "generation_config.json").is_file():
            try:
                gen_cfg = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                gen_cfg = {}
        engine = cls(spec, Decoder(spec, weights, device), tokenizer, template, path, gen_cfg)
        engine.threads = n_threads
        engine.dense_quant = dense_report
        from freetoken_agent.runtime.kernels import build, hugepages, ops

        # the C kernels carry quantized weights, and a decode step's fp32 GEMVs and norms (runtime/model/layers.py)
        if build.load() is not None:
            if device == "cpu" and managed is None:
                hugepages.adopt_dense(weights)  # the kernels stream these every token: 2 MiB pages
            if threads is not None or os.environ.get("FREETOKEN_THREADS"):
                ops.set_threads(n_threads)  # an explicit thread count sizes the kernels' pool too
            gqa_only = all(lay.recurrent is None and (lay.attention is None or lay.attention.kind == "gqa")
                           for lay in spec.layers)
            if device == "cpu" and (dense_report is not None or (torch_dtype == torch.float32 and gqa_only)):
                # the kernels' pool carries a decode step's big products (quantized, or fp32 through its GEMV and
                # its attention): torch's own ops are small. bf16 dense weights, MLA's latent attention and
                # recurrent mixers stay with torch's threads.
                engine.decode_torch_threads = 1
        if managed is not None:
            managed.install(engine.decoder)
            engine.residency = managed.store
        else:
            engine.quant = mapped.install(engine.decoder) if mapped else quantize_experts(engine.decoder, quant)
        return engine

    # ------------------------------------------------------------------------------------------------ text

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise TokenizerError(f"no tokenizer files (tokenizer.json or a tiktoken vocabulary) in {self.path}")
        return self._tokenizer

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template else None

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True, **kwargs: Any,
    ) -> str:
        if self._chat_template is None:
            raise TokenizerError(f"the model in {self.path} has no chat template (tokenizer_config.json)")
        return self._chat_template.render(messages, tools, add_generation_prompt, **kwargs)

    @property
    def eos_token_ids(self) -> list[int]:
        ids = list(self.spec.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
        if self._tokenizer is not None:
            ids += [e for e in self._tokenizer.eos_token_ids if e not in ids]
        return ids

    # ------------------------------------------------------------------------------------------------ compute

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request on the engine's scheduler; returns its handle at once (safe from any thread or task).

        Raises ``ContextLengthError`` for a prompt that does not fit the context (``max_new_tokens`` is clipped to
        what is left of it) and ``FreeTokenError`` for ids outside the vocabulary.
        """
        self._stats.requests += 1
        return self.scheduler.submit(request)

    def _on_step(self, sched: Scheduler, seconds: float, prefill: int, decode: int) -> None:
        self._follow_batch()
        s = self._stats
        s.prompt_tokens += prefill
        s.generated_tokens += decode
        if prefill:
            s.prefill_s += seconds
        else:
            s.decode_s += seconds

    def logits(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """One full forward without reuse: logits [T, vocab] in fp32 (for verification)."""
        result = self.submit(Request(as_token_ids(token_ids), kind="logits", reuse=False)).result()
        assert result.logits is not None
        return result.logits

    def sampling(self, params: SamplingParams | None, kwargs: dict[str, Any]) -> SamplingParams:
        """``params``, or ``SamplingParams`` built from keyword arguments (one clear error for bad values)."""
        if params is not None and kwargs:
            raise TypeError("pass either a SamplingParams or keyword arguments, not both")
        if params is not None:
            return params
        if "stop" in kwargs and kwargs["stop"] is not None:
            kwargs["stop"] = (kwargs["stop"],) if isinstance(kwargs["stop"], str) else tuple(kwargs["stop"])
        if kwargs.get("stop_token_ids") is not None:
            kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
        # a bad value raises SamplingError (a FreeTokenError) naming the field
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None or k == "stop_token_ids"})

    def _request(self, token_ids: list[int] | torch.Tensor, params: SamplingParams | None,
                 kwargs: dict[str, Any]) -> Request:
        phase = kwargs.pop("phase", None)
        return Request(as_token_ids(token_ids), self.sampling(params, kwargs),
                       phase=None if phase is None else Phase(phase).value)

    def iter_generate(
        self, token_ids: list[int] | torch.Tensor, params: SamplingParams | None = None, **kwargs: Any
    ) -> Iterator[TokenEvent]:
        """Blocking token stream: yields each ``TokenEvent`` as it is produced (stopping early cancels)."""
        handle = self.submit(self._request(token_ids, params, kwargs))
        try:
            yield from handle
        finally:
            handle.cancel()

    def generate(
        self, token_ids: list[int] | torch.Tensor, params: SamplingParams | None = None, **kwargs: Any
    ) -> GenerationResult:
        """Generate from a prompt of token ids (blocking). Keyword arguments are ``SamplingParams`` fields."""
        return GenerationResult.of(self.submit(self._request(token_ids, params, kwargs)).result())

    async def stream(
        self, token_ids: list[int] | torch.Tensor, params: SamplingParams | None = None, **kwargs: Any
    ) -> AsyncIterator[TokenEvent]:
        """Async variant of ``generate``: yields each token as the engine thread produces it, never blocking the
        event loop; leaving the loop early (or being cancelled) cancels the request."""
        handle = self.submit(self._request(token_ids, params, kwargs))
        try:
            async for ev in handle:
                yield ev
        finally:
            handle.cancel()

    def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None, **kwargs: Any,
    ) -> GenerationResult:
        """Render the conversation with the model's chat template and generate the assistant's reply."""
        prompt = self.render_chat(messages, tools, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt), params, **kwargs)

    def close(self) -> None:
        """Stop the engine thread; requests still in flight fail with ``RequestCancelled``."""
        self.scheduler.close()

    # ------------------------------------------------------------------------------------------------ phases, stats

    # ------------------------------------------------------------------------------------------------ sessions

    def kv_bytes_per_token(self) -> int:
        """KV bytes one position costs across all layers (GQA: keys + values; MLA: latent + rotary key)."""
        elsize = self.decoder.weights.embed.element_size()
        total = 0
        for layer in self.spec.layers:
            a = layer.attention
            if a.kv_source is not None:  # reads another layer's KV (Gemma 4)
                continue
            if a.kind == "mla":
                total += a.kv_lora_rank + a.qk_rope_dim
            elif a.kind == "shared_kv":  # DeepSeek-V4: window KV plus the compressor's per-position parts
                total += cached_width(a)
            else:  # GQA (plus Qwen4-Exp's raw indexer key per position)
                total += a.num_kv_heads * (a.head_dim + a.v_head_dim) + (a.qsa.head_dim if a.qsa else 0)
        return total * elsize

    def kv_manager(self, config: Any = None) -> Any:
        """The engine's KV manager (page pools, radix prefix cache), created on first use.

        Default sizing: ``$FREETOKEN_KV_BUDGET_MB`` (else 1024 MiB) of pages of 16 positions.
        """
        from freetoken_agent.runtime.kv.session import KVConfig, KVManager

        if self._kv is None or config is not None:
            if config is None:
                import os

                budget = int(os.environ.get("FREETOKEN_KV_BUDGET_MB", "1024")) * 2**20
                pages = max(16, budget // (16 * max(self.kv_bytes_per_token(), 1)))
                config = KVConfig(page_size=16, device_pages=int(pages))
            if self._kv is not None and (self.scheduler.running or self.scheduler.waiting):
                raise RuntimeError("cannot replace the KV manager while requests are in flight")
            stateful = bool(self.spec.state_layers())
            self._kv = KVManager(self.spec.num_layers, config, str(self.decoder.device), self._elastic_kv(config),
                                 stateful=stateful, lock=self.lock)
        return self._kv

    def _elastic_kv(self, config: Any) -> Any:
        """Under a memory budget, the KV pool shares its tier's ledger with the expert-slot pool."""
        store = self.residency
        if store is None or getattr(store, "ledgers", None) is None:
            return None
        from freetoken_agent.runtime.kv.session import ElasticKV

        tier = "device" if self.decoder.device.type != "cpu" else "host"
        ledger = store.ledgers[tier]
        reservation = ledger.reservations.get("kv") or ledger.reserve("kv")
        give_back = store.grow_host if tier == "host" else None
        return ElasticKV(reservation, config.page_size * max(self.kv_bytes_per_token(), 1), give_back)

    def session(self) -> Any:
        """A new multi-turn session: each turn prefills only what no cached prefix covers."""
        return self.kv_manager().new_session(self)

    def hint(self, phase: Phase | str, expected_s: float | None = None, session: Any = None) -> None:
        """The agent (of ``session``, when given) says which phase comes next; residency and KV policies act on it.

        With one agent, each hint switches expert residency to its phase (and the phase scheduler stages it). When
        other sessions' requests are in flight, residency follows the whole batch instead of the last hint: the
        phase with the most sequences in flight (this session counted in its new phase; an agent entering ``tool``
        runs nothing), ties going to the new hint. Only a change of that phase reaches the expert store.
        """
        name = Phase(phase).value
        with self.lock:  # staging touches the expert store: never in the middle of a step
            self._stats.phase_hints[name] = self._stats.phase_hints.get(name, 0) + 1
            others = self.scheduler.phase_mix(exclude=session) if session is not None else {}
            if not others:
                self._switch(name, expected_s)
                return
            if name != "tool":
                others[name] = others.get(name, 0) + 1
            target = max(others, key=lambda p: (others[p], p == name))
            if target != self._stats.phase:
                self._switch(target, expected_s if target == name else None)

    def _switch(self, name: str, expected_s: float | None) -> None:
        self._stats.phase = name
        if self.residency is not None:
            self.residency.on_phase(name)
        for listener in self.phase_listeners:  # phase scheduling (issue 8): staging, pause prefetch
            listener(name, expected_s)

    def _follow_batch(self) -> None:
        """After a step: when several agents are in flight and their majority phase is not the one residency is
        in (sessions finished, others arrived), switch to it."""
        mix = self.scheduler.phase_mix()
        if sum(mix.values()) < 2:
            return
        target = max(mix, key=lambda p: (mix[p], p == self._stats.phase))
        if target != self._stats.phase:
            self._switch(target, None)

    def stats(self) -> dict[str, Any]:
        s = self._stats
        sched = self.phase_scheduler
        phase = {"current": s.phase, **(sched.snapshot() if sched is not None else {}), "scheduler": sched is not None,
                 "ttft_s": [round(t, 5) for t in self._kv.stats.ttft_s[-64:]] if self._kv is not None else []}
        return {
            "model_type": self.spec.model_type,
            "threads": self.threads,
            "requests": s.requests,
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": self.scheduler.stats.reused_tokens,
            "generated_tokens": s.generated_tokens,
            "prefill_s": round(s.prefill_s, 4),
            "decode_s": round(s.decode_s, 4),
            "prefill_tok_s": round(s.prompt_tokens / s.prefill_s, 2) if s.prefill_s else None,
            "decode_tok_s": round(s.generated_tokens / s.decode_s, 2) if s.decode_s else None,
            "phase": phase,
            "phase_hints": dict(s.phase_hints),
            "scheduler": {**self.scheduler.snapshot(), "phase_mix": self.scheduler.phase_mix()},
            "kv": self._kv.snapshot() if self._kv is not None else None,
            "residency": self.residency.stats() if self.residency is not None else None,
        }

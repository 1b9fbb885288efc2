"""``QuantizedExperts``: the MoE layer's routed-expert backend over Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K / MXFP4 weights.

Legend: ``T`` tokens, ``K`` experts per token, ``E`` experts, ``D`` hidden size, ``I`` expert intermediate size.

Per layer it holds two expert-major byte tensors — ``w13 [E, bytes]`` (gate rows 0..I-1 and up rows I..2I-1 of
``[2I, D]``) and ``w2 [E, bytes]`` (down ``[D, I]``) — one contiguous blob per expert, so one read moves one
expert. Where the C kernels load the blobs are in their tile layout, else in plain GGUF block layout. Gate/up and
down may be in different formats (``fmt``, ``down_fmt``): a Q4_K_M GGUF file holds Q4_K gate/up and Q6_K down.

``forward`` picks a path per expert by the tokens routed to it: few tokens (decode) → one fused C call for all of
them (int8 activations); at least ``dequant_threshold`` tokens (prefill) → dequantize that expert to fp32 once and
use ``torch.mm``. Where that crossover lies depends on the CPU (on a first-generation Zen without VNNI the fp32 path
won from ~32-64 tokens; on a Zen 4 with AVX-512 VNNI the int8 kernel still wins at 256), so it is measured once per
process (``crossover_tokens``); ``$FREETOKEN_DEQUANT_THRESHOLD`` pins it.

``exact = True`` sends every expert through dequantize + fp32 (``ops.expert_f32`` for SiLU experts without biases,
else ``torch.mm``): activations are never rounded, so the layer equals the reference experts over the dequantized
weights (bitwise, where both take the fp32 kernel) (slower decode);
``set_mode`` (``EXPERT_MODES``) sets it and the threshold together. The backend says what it is through
``capabilities`` (``runtime/experts/capabilities.py``); ``runtime/experts/quantized.py`` builds it for a decoder.

Deterministic mode (``ops.set_deterministic``): no expert ever switches to dequantize + ``torch.mm`` by its token
count (``dequant_threshold`` is unbounded), so every token takes the int8 kernels, which are batch invariant (each
row quantized and summed on its own); ``exact`` experts and the no-kernel path multiply through
``invariant.linear`` instead of ``torch.mm``, activations through ``invariant.pointwise``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

from ..errors import FreeTokenError
from ..experts.capabilities import PLACEMENTS, Capabilities
from ..quant.blocks import BLOCK_BYTES, BlockQuantized, quantize
from ..quant.formats import block_format
from . import build, invariant, ops
from .torch_fallback import Int4Weight, int4_linear, int4pack

EXPERT_MODES = ("auto", "exact", "int8")
"""How quantized experts compute (``set_mode``): ``auto`` picks the int8-activation C kernels or dequantize + fp32
per expert by tokens routed; ``exact`` always dequantizes (matches ``reference.dequantized_reference`` to fp32
rounding); ``int8`` always uses the kernels (matches ``dequantized_reference(..., activations="int8")``)."""

MAX_DEQUANT_THRESHOLD = 1024
_crossover: list[int] = []


def crossover_tokens() -> int:
    """Tokens per expert from which dequantize + ``torch.mm`` beats the C kernel on this machine (measured once)."""
    env = os.environ.get("FREETOKEN_DEQUANT_THRESHOLD", "")
    if env.isdigit():
        return max(1, int(env))
    if _crossover:
        return _crossover[0]
    value = MAX_DEQUANT_THRESHOLD
    if build.load() is None:
        value = 1
    else:
        w = ops.PackedWeight.from_blocks(quantize(torch.randn(512, 1024), "q4", refine=False))
        buf = torch.empty(512, 1024)
        for m in (16, 64, 256):
            x = torch.randn(m, 1024)
            kernel = _best_of(lambda: ops.linear(w, x))
            dense = _best_of(lambda: torch.mm(x, ops.dequantize(w, buf).t()))
            if dense < kernel:
                value = m
                break
    _crossover.append(value)
    return value


def _best_of(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class QuantizedExperts:
    """Routed experts of one MoE layer in a block-quantized format; ``forward(x, ids, weights) -> [T, D]`` in
    ``x``'s dtype (computed in fp32)."""

    def __init__(
        self,
        fmt: str,
        w13: torch.Tensor,
        w2: torch.Tensor,
        hidden: int,
        intermediate: int,
        packed: bool,
        dequant_threshold: int | None = None,
        *,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        placement: str = "resident",
        down_fmt: str | None = None,
        gated: bool = True,
    ) -> None:
        """``w13``/``w2``: the expert-major byte tensors (``stored``); ``packed``: in the kernels' tile layout;
        ``fmt`` the gate/up blocks' format, ``down_fmt`` the down blocks' (default ``fmt``). ``gated`` False: the
        experts are down(act(up x)) and ``w13`` holds only the up rows ``[I, D]`` (an ``activation`` is then needed).

        ``activation`` (``[N, 2I] -> [N, I]``) replaces SiLU(gate)*up, and ``gate_up_bias [E, 2I]`` /
        ``down_bias [E, D]`` add biases; either one moves decode from the fused call to per-expert C calls.
        ``placement`` (``capabilities.PLACEMENTS``) says where the bytes live; a ``managed`` backend is a view of a
        slot pool whose contents change, so it keeps no torch int4 copies (``attach_int4``).
        """
        if placement not in PLACEMENTS:
            raise FreeTokenError(f"unknown placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")
        if not gated and activation is None:
            raise FreeTokenError("ungated experts need their activation (the default is SiLU(gate) * up)")
        self.gated = gated
        self.activation = activation
        self.int4: list[tuple[Int4Weight, Int4Weight]] | None = None  # torch int4 copies (no-compiler q4 only)
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        self.format = block_format(fmt)
        self.down_format = self.format if down_fmt is None else block_format(down_fmt)
        self.fmt, self.down_fmt = self.format.name, self.down_format.name
        if packed:  # the kernels compute in both; K-quant rows must be whole super-blocks
            ops.kernel_format(self.fmt, hidden)
            ops.kernel_format(self.down_fmt, intermediate)
        self.w13, self.w2 = w13, w2
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts = w13.shape[0]
        self.packed = packed
        self.placement = placement
        self._threshold = dequant_threshold
        self.exact = False
        """Every expert through dequantize + fp32 ``torch.mm`` (no int8 activations, no bf16 int4 fallback)."""
        self._codes: tuple[int, int] | None = None
        if placement != "managed":
            self.attach_int4()

    @property
    def rows13(self) -> int:
        """Rows of an expert's first projection: gate and up (2I), or up alone (I) for ungated experts."""
        return 2 * self.intermediate if self.gated else self.intermediate

    @property
    def capabilities(self) -> Capabilities:
        """What this backend is: its placement and format, computed by the C kernels when ``packed``; modes and
        dequantization always."""
        return Capabilities(self.placement, tuple(dict.fromkeys((self.fmt, self.down_fmt))), kernels=self.packed, modes=True, dequantize=True,
                            fused=self.fused, can_prefetch=False)

    def set_mode(self, mode: str) -> None:
        """How it computes: ``auto`` (by tokens per expert), ``exact`` (dequantize + fp32 always) or ``int8`` (the
        int8-activation kernels always; needs them)."""
        if mode not in EXPERT_MODES:
            raise FreeTokenError(f"unknown expert mode {mode!r}; expected one of {', '.join(EXPERT_MODES)}")
        if mode == "int8" and not self.packed:
            raise FreeTokenError("int8 expert mode needs the C kernels, which are unavailable here")
        self.exact = mode == "exact"
        self.dequant_threshold = 2**62 if mode == "int8" else None  # None: measured (or $FREETOKEN_DEQUANT_THRESHOLD)

    @property
    def dequant_threshold(self) -> int:
        """Tokens per expert from which an expert runs as dequantize + ``torch.mm`` (default: measured; never in
        deterministic mode)."""
        if ops.deterministic():
            return sys.maxsize
        if self._threshold is None:
            self._threshold = crossover_tokens()
        return self._threshold

    @dequant_threshold.setter
    def dequant_threshold(self, value: int | None) -> None:
        self._threshold = None if value is None else max(1, int(value))

    # ---------------------------------------------------------------- construction

    @staticmethod
    def quantize(gate_up: torch.Tensor, down: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Float experts ``gate_up [E, 2I, D]`` (ungated: up ``[E, I, D]``), ``down [E, D, I]`` → their ``fmt`` blocks
        ``[E, 2I or I, nb(D), P]``, ``[E, D, nb(I), P]`` (Q8_0 / Q4_0: the C quantizer where the kernels load, else
        the torch one, the same bytes; the K-quants and MXFP4: their plain-torch quantizers)."""
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
            raise FreeTokenError(
                f"experts need gate_up [E, 2I, D] (or up [E, I, D]) and down [E, D, I], "
                f"got {tuple(gate_up.shape)} and {tuple(down.shape)}"
            )
        e, two_i, d = gate_up.shape
        i = down.shape[2]
        if tuple(down.shape[:2]) != (e, d) or two_i not in (i, 2 * i):
            raise FreeTokenError(f"down must be [E, D, I] with gate_up [E, 2I, D] or up [E, I, D]; got "
                                 f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
        f = block_format(fmt)
        p = f.block_bytes
        # a few experts at a time: the quantizer's temporaries stay a few times one chunk, not the whole layer
        step = max(1, (64 << 20) // max(1, two_i * d * 4))

        def quant(w: torch.Tensor, fmt: str) -> BlockQuantized:
            if f.name not in BLOCK_BYTES:  # the K-quants and MXFP4: their plain-torch quantizers (C: Q8_0 / Q4_0)
                return BlockQuantized(f.name, (w.shape[0], w.shape[1]), f.quantize_rows(w))
            return ops.quantize_blocks(w, fmt)

        q13 = torch.cat([quant(gate_up[a : a + step].reshape(-1, d), fmt).blocks for a in range(0, e, step)])
        q2 = torch.cat([quant(down[a : a + step].reshape(-1, i), fmt).blocks for a in range(0, e, step)])
        return q13.reshape(e, two_i, -1, p), q2.reshape(e, d, -1, p)

    @staticmethod
    def stored(
        b13: BlockQuantized | torch.Tensor, b2: BlockQuantized | torch.Tensor, fmt: str, packed: bool,
        hidden: int | None = None, intermediate: int | None = None, down_fmt: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Expert blocks ``w13 [E, 2I, nb(D), P]`` (``fmt``) / ``w2 [E, D, nb(I), P]`` (``down_fmt``, default
        ``fmt``) → the byte tensors a backend holds, ``[E, bytes]`` each: the kernels' tiles when ``packed``, else
        the blocks as they are. With ``hidden`` and ``intermediate`` the block shapes are checked against them
        (blocks read from a file)."""
        f13 = block_format(fmt)
        f2 = f13 if down_fmt is None else block_format(down_fmt)
        b13 = b13.blocks if isinstance(b13, BlockQuantized) else b13
        b2 = b2.blocks if isinstance(b2, BlockQuantized) else b2
        e, two_i, _, p = b13.shape
        d, i = (b2.shape[1], two_i // 2) if hidden is None or intermediate is None else (hidden, intermediate)
        want13 = (e, two_i if two_i == i else 2 * i, f13.nb(d), f13.block_bytes)  # gate|up, or up alone
        want2 = (e, d, f2.nb(i), f2.block_bytes)
        if tuple(b13.shape) != want13 or tuple(b2.shape) != want2:
            raise FreeTokenError(
                f"{f13.name}/{f2.name} expert blocks have shapes {tuple(b13.shape)} / {tuple(b2.shape)}, expected "
                f"{want13} / {want2}"
            )
        return f13.storage(b13, packed).contiguous(), f2.storage(b2, packed).contiguous()

    @classmethod
    def from_blocks(
        cls, w13: BlockQuantized | torch.Tensor, w2: BlockQuantized | torch.Tensor, fmt: str, hidden: int,
        intermediate: int, use_kernels: bool | None = None, down_fmt: str | None = None,
    ) -> QuantizedExperts:  # fmt: skip
        """From GGUF blocks: ``w13 [E, 2I, nb(D), P]`` (``fmt``) and ``w2 [E, D, nb(I), P]`` (``down_fmt``, default
        ``fmt``) uint8 (e.g. read from a GGUF). Gated SiLU experts."""
        packed = build.load() is not None if use_kernels is None else use_kernels
        stored = cls.stored(w13, w2, fmt, packed, hidden, intermediate, down_fmt)
        return cls(fmt, *stored, hidden, intermediate, packed, down_fmt=down_fmt)

    def attach_int4(self) -> None:
        """No compiler, q4: keep torch int4 copies of the experts for its int4 op with bf16 activations."""
        if self.packed or self.fmt != "q4_0" or self.down_fmt != "q4_0":
            return
        b13, b2 = self.blocks()
        pairs = [(int4pack(b13[x]), int4pack(b2[x])) for x in range(self.num_experts)]
        if all(a is not None and b is not None for a, b in pairs):
            self.int4 = pairs  # type: ignore[assignment]

    @classmethod
    def from_float(
        cls, gate_up: torch.Tensor, down: torch.Tensor, fmt: str = "q4", use_kernels: bool | None = None
    ) -> QuantizedExperts:
        """Quantize float experts: ``gate_up [E, 2I, D]``, ``down [E, D, I]`` (fmt ``q4`` or ``q8``)."""
        b13, b2 = cls.quantize(gate_up, down, fmt)
        return cls.from_blocks(b13, b2, fmt, gate_up.shape[2], down.shape[2], use_kernels)

    # ---------------------------------------------------------------- views

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts as GGUF blocks: ``(w13 [E, 2I, nb(D), P], w2 [E, D, nb(I), P])``."""
        d, i = self.hidden, self.intermediate
        return (self.format.blocks(self.w13, self.rows13, d, self.packed),
                self.down_format.blocks(self.w2, d, i, self.packed))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 experts these bytes stand for: ``(gate_up [E, 2I or I, D], down [E, D, I])``."""
        b13, b2 = self.blocks()
        e, d, i, r = self.num_experts, self.hidden, self.intermediate, self.rows13
        g = self.format.dequantize_rows(b13.reshape(e * r, *b13.shape[2:]), d)
        w = self.down_format.dequantize_rows(b2.reshape(e * d, *b2.shape[2:]), i)
        return g.reshape(e, r, d), w.reshape(e, d, i)

    @property
    def nbytes(self) -> int:
        return self.w13.numel() + self.w2.numel()

    def _expert_float(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        d, i = self.hidden, self.intermediate
        if self.packed:  # the C dequantizer reads the tiles as they are
            g = ops.dequantize(ops.PackedWeight(self.fmt, self.rows13, d, self.w13[e]))
            w = ops.dequantize(ops.PackedWeight(self.down_fmt, d, i, self.w2[e]))
            return g, w
        return self.format.dequantize(self.w13[e], self.rows13, d), self.down_format.dequantize(self.w2[e], d, i)

    # ---------------------------------------------------------------- compute

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation is not None:
            return self.activation(h)
        gate = h[:, : self.intermediate]
        silu = torch.nn.functional.silu
        return (invariant.pointwise(silu, gate) if ops.deterministic() else silu(gate)) * h[:, self.intermediate :]

    def expert_dense(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens ``x [n, D]`` with fp32 weights (prefill, or no kernels) → ``[n, D]``."""
        deterministic = ops.deterministic()
        int4 = self.int4 is not None and not self.exact and not deterministic
        mm = invariant.linear if deterministic else lambda a, w: torch.mm(a, w.t())
        if int4:
            w13, w2 = self.int4[e]  # type: ignore[index]
            h = int4_linear(w13, x)
        else:
            gate_up, down = self._expert_float(e)
            if (self.activation is None and self.gate_up_bias is None and self.down_bias is None
                    and ops.moe_f32_takes(x, gate_up, down)):  # bitwise the dequantized TorchExperts
                return ops.expert_f32(gate_up, down, x)
            h = mm(x, gate_up)  # [n, 2I]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[e]
        a = self._act(h)
        y = int4_linear(w2, a) if int4 else mm(a, down)  # [n, D]
        return y if self.down_bias is None else y + self.down_bias[e]

    def expert_kernel(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens with the C GEMV (int8 activations) → ``[n, D]``."""
        d, i = self.hidden, self.intermediate
        h = ops.linear(ops.PackedWeight(self.fmt, self.rows13, d, self.w13[e]), x)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[e]
        y = ops.linear(ops.PackedWeight(self.down_fmt, d, i, self.w2[e]), self._act(h))
        return y if self.down_bias is None else y + self.down_bias[e]

    def one_token_call(self, top_k: int) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
        """``(format code, down format code, w13, w2)`` when a step of one token routed to ``top_k`` experts runs as
        one fused ``ops.moe`` call over bytes that stay where they are (resident or mapped; a ``managed`` view's slots
        change under it) — what ``forward`` then does, and what the fused decode step (``model/fused.py``) may run
        itself — else None."""
        if not (self.fused and self.placement != "managed" and not self.exact and top_k < self.dequant_threshold):
            return None
        if self._codes is None:  # formats are fixed at construction
            self._codes = (ops.FMT_CODE[ops.kernel_format(self.fmt, self.hidden)],
                           ops.FMT_CODE[ops.kernel_format(self.down_fmt, self.intermediate)])
        return self._codes[0], self._codes[1], self.w13, self.w2

    @property
    def fused(self) -> bool:
        """Whether decode runs as one fused C call per layer (SiLU experts without biases, kernels loaded)."""
        return self.packed and self.activation is None and self.gate_up_bias is None and self.down_bias is None

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x [T, D]``, ``topk_ids [T, K]`` int64, ``topk_weights [T, K]`` → ``[T, D]`` in ``x``'s dtype (the
        decoder may run in bf16; the experts compute in fp32)."""
        if x.dim() != 2 or x.shape[1] != self.hidden or topk_ids.shape != topk_weights.shape:
            raise FreeTokenError(
                f"experts forward: want x [T, {self.hidden}] and ids/weights [T, K], got {tuple(x.shape)}, "
                f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
            )
        w = topk_weights if topk_weights.dtype is torch.float32 else topk_weights.float()
        out = self._forward32(x if x.dtype is torch.float32 else x.float(), topk_ids, w)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _forward32(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``forward`` on fp32 ``x [T, D]`` and ``topk_weights [T, K]`` → fp32 ``[T, D]``."""
        threshold = 1 if self.exact or not self.packed else self.dequant_threshold
        if self.fused and topk_ids.numel() < threshold:  # decode: no expert can reach the threshold
            return ops.moe(self.fmt, self.w13, self.w2, (self.hidden, self.intermediate), x, topk_ids, topk_weights,
                           self.down_fmt)
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)  # [E]
        dense = (counts >= threshold).nonzero().flatten().tolist()
        if self.fused:
            light_ids = topk_ids
            if dense:
                is_dense = torch.zeros(self.num_experts, dtype=torch.bool)
                is_dense[dense] = True
                light_ids = torch.where(is_dense[topk_ids], torch.full_like(topk_ids, -1), topk_ids)
            if bool((light_ids >= 0).any()):
                out = ops.moe(self.fmt, self.w13, self.w2, (self.hidden, self.intermediate), x, light_ids, topk_weights,
                              self.down_fmt)
            else:
                out = torch.zeros_like(x)
            light: list[int] = []
        else:
            out = torch.zeros_like(x)
            light = ((counts > 0) & (counts < threshold)).nonzero().flatten().tolist()
        dense_set = set(dense)
        for e in dense + light:
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            y = self.expert_dense(e, x[tok]) if e in dense_set else self.expert_kernel(e, x[tok])
            out.index_add_(0, tok, y * topk_weights[tok, slot, None])
        return out

    __call__ = forward

"""``ModelSpec``: a frozen, typed description of a decoder-only MoE architecture.

Adapters (``adapters.py``) turn a Hugging Face ``config.json`` into a spec; the generic decoder reads only the spec.
Architecture quirks become fields here, never branches on a model-type string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Activation = str
"""A canonical name in ``activations.ACTIVATIONS``, or a fused form: ``swiglu_oai`` / ``silu_clamp``."""
RopeKind = Literal["default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "ntk_alpha"]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding of the attention's rotary part."""

    dim: int
    """Number of rotated channels per head (partial rotary rotates only the first ``dim``)."""
    theta: float = 10000.0
    kind: RopeKind = "default"
    style: Literal["half", "interleaved"] = "half"
    """``half``: GPT-NeoX rotate-half pairs (i, i+dim/2); ``interleaved``: adjacent pairs (2i, 2i+1)."""
    factor: float = 1.0
    original_max_position: int | None = None
    max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] | None = None
    """``longrope``: per-frequency divisors [R/2] up to ``original_max_position``; ``long_factor`` beyond it."""
    long_factor: tuple[float, ...] | None = None
    short_mscale: float | None = None
    """PhiMoE: cos/sin are scaled by ``short_mscale`` / ``long_mscale`` (by the step's length) instead of the
    ``longrope`` attention factor."""
    long_mscale: float | None = None
    alpha: float | None = None
    """``ntk_alpha`` (Hunyuan): the base is stretched to ``theta * alpha ** (R / (R - 2))``, whatever the length."""
    proportion: float = 1.0
    """``proportional``: ``dim`` is the whole head; only the first ``proportion * dim / 2`` frequency pairs turn
    (exponents 2i / dim), the rest have frequency 0."""
    frequency_update: bool = True
    """``dynamic`` and ``longrope`` frequencies follow the length of each forward (transformers'
    ``dynamic_rope_update``); False where the model computes them once at init (PhiMoE)."""


@dataclass(frozen=True)
class IndexerSpec:
    """The DeepSeek-V3.2 lightning indexer: relu(q_i·k_i) summed over heads with learned per-token weights."""

    num_heads: int
    head_dim: int
    topk: int
    rope_dim: int
    rope_style: Literal["half", "interleaved"] = "half"
    shared: bool = False
    """Reuse the top-k chosen by the most recent indexer layer of this forward (GLM-5 ``shared`` layers)."""
    rope_last: bool = False
    """The rotated channels are the last ``rope_dim`` of each head, not the first (HY-V4)."""
    k_norm_eps: float = 1e-6
    scale_after_relu: bool = False
    """Apply the 1/sqrt(Di) score scale to the head weights after the ReLU instead of before it (HY-V4)."""


@dataclass(frozen=True)
class BlockIndexerSpec:
    """MiniMax-M3 block-sparse selection: per KV head, max-pooled q_i·k_i scores over key blocks; each query keeps
    its top ``topk_blocks`` blocks plus its ``local_blocks`` most recent ones."""

    num_heads: int
    head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int


@dataclass(frozen=True)
class SparseIndexSpec:
    """Kolibri 1.1 indexed attention (``model/indexed.py``): each query attends to the ``topk`` keys that score
    highest against its first ``num_heads`` query heads (ReLU of the logits against key head 0, both rounded to
    NVFP4) among a pool of candidates, plus the first ``sinks`` and last ``local`` keys it sees. An indexer layer
    (``pool_source``) picks the pool: every key when the query sees at most ``pool_size``, else the ``compression``-key
    blocks whose NVFP4-rounded mean key scores highest; the following indexed layers reuse the latest indexer's pool.
    The attention itself reads NVFP4-rounded keys and values."""

    topk: int
    pool_size: int
    compression: int
    num_heads: int
    local: int
    sinks: int
    pool_source: bool


@dataclass(frozen=True)
class RelPosSpec:
    """Inkling's relative-position attention (``kind="relpos"``, no rotary): short causal convolutions on the keys
    and values (state kept per sequence), a learned bias per backward distance mixed per query and head from
    ``d_rel`` relative states, optional logarithmic query scaling. Implemented in ``model/relpos.py``."""

    d_rel: int
    extent: int
    """The bias applies to distances 0 <= d < ``extent`` (zero beyond)."""
    conv_kernel: int = 4
    variant: Literal["inkling", "inkling2"] = "inkling"
    """``inkling``: RMSNorm'd q/k, convs y = x + conv(x); ``inkling2``: learned-scale L2-clipped q/k/relative states,
    unit-RMS values, convs (x + conv(x)) / sqrt(K + 1) (dynamic taps on full layers), per-token sinks, output gate."""
    log_floor: int | None = None
    """If set, queries (and relative states / the bias) are scaled by 1 + alpha·log(max((pos+1)/floor, 1))."""
    log_alpha: float = 0.1
    dynamic_conv: bool = False
    """inkling2 full layers: key/value conv taps = static taps + per-token taps projected from the layer input."""
    qk_clip: float = 0.0
    rel_clip: float = 0.0


@dataclass(frozen=True)
class CompressorSpec:
    """DeepSeek-V4 compressed KV (``kind="shared_kv"``): every ``rate`` tokens are pooled (a per-channel softmax over
    gates) into one entry that later queries attend to beside their sliding window. Implemented in
    ``model/compressed.py``."""

    rate: int
    overlap: bool = False
    """CSA: each entry pools its own window and the previous one (two projection series, ``2·rate`` slots)."""
    indexer: IndexerSpec | None = None
    """CSA: a lightning indexer over compressed keys picks the ``topk`` entries each query sees."""


@dataclass(frozen=True)
class QSASpec:
    """Qwen4-Exp query-selected attention: an indexer scores mean-pooled blocks of ``ratio`` raw keys (relu(q·k)
    summed over its heads); each query sees the tokens of its top ``budget / ratio`` complete blocks plus the tokens
    after its last complete block (``model/qsa.py``)."""

    num_heads: int
    head_dim: int
    budget: int
    ratio: int


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention of one layer: GQA (incl. MHA/MQA) or MLA (DeepSeek compressed latent)."""

    kind: Literal["gqa", "mla", "moa", "relpos", "shared_kv", "cca"]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Query/key width per head (for MLA: nope + rope)."""
    v_head_dim: int
    scale: float
    """Softmax scale applied to q·k."""
    rope: RopeSpec | None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Literal["none", "head", "full", "head_unit"] = "none"
    """RMSNorm on q and k: per head (``head``, weight [head_dim]), over the whole projection (``full``), or per head
    without weights (``head_unit``, Llama 4's L2 norm)."""
    sinks: bool = False
    """A learned per-head logit that joins the softmax and is then dropped (GPT-OSS)."""
    clip_qkv: float | None = None
    sliding_window: int | None = None
    """Keys older than ``sliding_window`` positions are masked (None: full attention)."""
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    lora_bias: bool = False
    lora_norm_eps: float = 1e-6
    """Eps of the MLA ``q_a_layernorm`` / ``kv_a_layernorm`` (transformers builds them with the 1e-6 default,
    whatever the model's ``rms_norm_eps``)."""
    indexer: IndexerSpec | None = None
    block_indexer: BlockIndexerSpec | None = None
    """GQA + MiniMax-M3 block-sparse attention (see ``BlockIndexerSpec``)."""
    sparse_index: SparseIndexSpec | None = None
    """GQA + Kolibri 1.1 indexed attention (see ``SparseIndexSpec``)."""
    """MLA + DeepSeek sparse attention: each query attends only to the top-k keys chosen by a lightweight indexer."""
    qk_norm_after_rope: bool = False
    """Apply the per-head q/k norm after rotary instead of before (Hunyuan)."""
    v_scale: float = 1.0
    """Values are multiplied by this before attention (MiMo-V2)."""
    output_gate: Literal["none", "sigmoid", "softplus"] = "none"
    """The attention output (before ``o_proj``) is multiplied by act(gate(x)), x being the attention input."""
    output_gate_per_head: bool = False
    """The gate has one value per head (else one per output channel)."""
    output_gate_bias: bool = False
    """A learned per-head bias is added to the gate logits (Beam)."""
    mla_q_scale: float = 1.0
    """MLA: queries are multiplied by this (LongCat: sqrt(hidden / q_lora_rank))."""
    mla_q_latent_scale: float = 1.0
    """MLA: the normalized q latent is multiplied by this before ``q_b_proj`` and the indexer (dots3)."""
    k_rope_norm: bool = False
    """MLA: RMSNorm (``k_rope_only_layernorm``) on the shared rotary key before rotation (dots3)."""
    mla_q_gate: bool = False
    """MLA (A.X K2): ``q_b_proj`` reads [normed q latent | raw q latent] and also yields a per-channel output gate
    (sigmoid) after each head's query."""
    mla_kv_scale: float = 1.0
    """MLA: the normalized latent is multiplied by this before caching (LongCat: sqrt(hidden / kv_lora_rank))."""
    q_gate: bool = False
    """``q_proj`` holds per head [query | gate]; the output is multiplied by sigmoid(gate) (Qwen3-Next)."""
    q_scale_beta: float = 0.0
    """If > 0, queries are scaled by ``1 + beta * log(1 + floor(pos / q_scale_period))`` (Llama-4-style)."""
    q_scale_period: int = 1
    q_scale_offset: int = 0
    """Added to the position before the floor division (Llama 4 NoPE temperature tuning uses 1)."""
    q_scale_power: float = 0.0
    """If > 0 (and ``q_scale_beta`` is 0), queries are scaled by ``(1 + (pos + offset) / period) ** power`` (Beam's
    scalable softmax on NoPE layers)."""
    dynamic_mask: bool = False
    """Doge: a learned per-key bias exp(A · softplus(dt_proj(v))) per KV head is added to the scores; with more than
    ``keep_window`` keys only the ``keep_window`` largest-bias keys stay visible."""
    keep_window: int = 2048
    chunk_size: int | None = None
    """Chunked local attention: a query sees only keys in its own chunk of ``chunk_size`` positions (Llama 4)."""
    relpos: RelPosSpec | None = None
    """``kind="relpos"``: Inkling's relative-position attention (see ``RelPosSpec``)."""
    qsa: QSASpec | None = None
    """Qwen4-Exp: the keys each query sees are chosen by a block indexer (see ``QSASpec``)."""
    cca_kernels: tuple[int, int] = (0, 0)
    """``kind="cca"``: ZAYA's compressed convolutional attention (``model/cca.py``) with these (depthwise, grouped)
    q/k convolution widths."""
    compressor: CompressorSpec | None = None
    """``kind="shared_kv"`` (DeepSeek-V4: one KV head read as keys and values, trailing interleaved rope, sinks,
    sliding window): compressed entries beside the window (see ``CompressorSpec``)."""
    k_eq_v: bool = False
    """The values are the raw key projection (no ``v_proj``; Gemma 4 full-attention layers)."""
    v_norm: bool = False
    """Values are RMS-normalized per head, without weights (Gemma 4)."""
    kv_source: int | None = None
    """This layer has no key/value projections: it attends over the KV that layer ``kv_source`` cached (this forward
    included) with its own queries and mask (Gemma 4 KV sharing; ``model/gemma.py``)."""
    o_groups: int = 0
    """``shared_kv``: the output projection is grouped — heads split into ``o_groups`` groups, each projected to
    ``o_group_rank`` (``o_a_proj``), then mixed to the hidden size (``o_b_proj``)."""
    o_group_rank: int = 0


@dataclass(frozen=True)
class MLPSpec:
    """A gated dense MLP: down(act(gate(x)) * up(x))."""

    intermediate: int
    activation: Activation = "silu"
    bias: bool = False
    fused: bool = False
    """Granite-style ``input_linear`` [2I, D] (gate rows then up rows) and ``output_linear`` instead of three."""
    leaves: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Checkpoint names of (gate, up, down), e.g. ``("w1", "w3", "w2")``."""
    gated: bool = True
    """False: a plain two-layer MLP down(act(up(x))) without a gate projection (Nemotron-H)."""
    fused_names: tuple[str, str] = ("input_linear", "output_linear")
    """With ``fused``: names of the [2I, D] gate+up projection and the down projection."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    glu_clamp: bool = False
    """Before act(gate) · up, the gate is clamped to <= ``swiglu_limit`` and up to ±``swiglu_limit`` (DeepSeek-V4's
    shared expert, with any activation)."""
    out_scale: bool = False
    """A learned scalar ``global_scale`` multiplies the output (Inkling)."""


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts and how their outputs are weighted."""

    scoring: Literal["softmax", "sigmoid", "none", "sparsemixer", "sqrtsoftplus"] = "softmax"
    """Score function applied to the router logits; ``none`` with ``topk_before_scoring``: softmax over the top-k."""
    topk_before_scoring: bool = False
    """Pick top-k on raw logits, then softmax over the chosen k (Mixtral-style renormalization, GPT-OSS, Granite)."""
    norm_topk: bool = False
    norm_eps: float = 0.0
    """Added to the top-k sum before dividing (DeepSeek-V3: 1e-20)."""
    norm_p: float = 1.0
    """Top-k weights are divided by their p-norm (1: their sum; DBRX allows other p)."""
    norm_min: float | None = None
    """Clamp the top-k sum from below before dividing (Ernie)."""
    correction_bias: bool = False
    """A per-expert bias added to the scores for selection only (aux-loss-free balancing)."""
    n_group: int = 1
    topk_group: int = 1
    group_score: Literal["max", "top2_sum"] = "max"
    group_masked_value: float = 0.0
    """What masked-out groups' scores become before top-k (0 for DeepSeek-V2, -inf for V3-style)."""
    scaling: float = 1.0
    bias: bool = False
    """The router linear has a bias (GPT-OSS)."""
    correction_on_logits: bool = False
    """The correction bias is added to the raw logits (not the scores) for selection (Kolibri)."""
    jitter_eps: float = 0.01
    """``sparsemixer`` (PhiMoE, top-2): experts whose logit is relatively more than 2·eps below the max are masked
    before the softmax that weights the argmax; the second expert repeats this without the first."""
    logit_softcap: float = 0.0
    """If > 0, router logits become ``cap * tanh(logits / cap)`` before scoring."""
    shared_sink: int = 0
    """Inkling: the router's last ``shared_sink`` rows score the shared experts; the top-k and shared logits are
    normalized together (softmax of logsigmoid) so the shared experts act as a sink, and the shared experts (stored
    stacked [n, I, D]) are each weighted by their share."""
    global_scale: bool = False
    """A learned scalar ``{router}.global_scale`` multiplies the routing weights (Inkling)."""
    mlp_hidden: int = 0
    """If > 0: ZAYA's router (``model/mlp_router.py``), an MLP of this width over a state carried from the previous
    MoE layer's router, choosing among the experts plus a skip expert."""
    input_scale: bool = False
    """The router sees unit-RMS-normed rows times a learned per-channel ``scale`` [D] and 1/√D; ``scale`` sits beside
    the router projection (``{router}`` = ``router.proj`` → ``router.scale``; Gemma 4)."""
    expert_scale: bool = False
    """Routing weights are multiplied by a learned ``per_expert_scale`` [E] beside the router projection (Gemma 4)."""
    hash_table: bool = False
    """Experts are chosen by token id from a frozen table ``{router}.tid2eid`` [V, K] (DeepSeek-V4 hash layers);
    the scores still weight them."""


@dataclass(frozen=True)
class MoESpec:
    """A sparse MoE block: router, ``num_experts`` gated experts, optional shared experts."""

    num_experts: int
    top_k: int
    intermediate: int
    router: RouterSpec
    activation: Activation = "silu"
    """Any name in ``activations.ACTIVATIONS``: act(gate) * up (act(up) when not gated); ``swiglu_oai``: GPT-OSS
    clamped SwiGLU ``(clamp(up)+1) * g*sigmoid(alpha*g)`` with ``g = clamp(gate, max=limit)``;
    ``silu_clamp``: ``silu(clamp(gate, max=limit)) * clamp(up, ±limit)`` (HY-V4); ``softcap_swiglu``:
    ``softcap(gate) * sigmoid(gate) * softcap(up)`` with the caps in ``softcaps`` (Inkling 2)."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    glu_clamp: bool = False
    """Before act(gate) · up, the gate is clamped to <= ``swiglu_limit`` and up to ±``swiglu_limit`` (DeepSeek-V4's
    experts, with any activation)."""
    softcaps: tuple[float, float] = (0.0, 0.0)
    """``softcap_swiglu``: the (gate, up) caps, ``cap * tanh(x / cap)``."""
    expert_bias: bool = False
    shared: MLPSpec | None = None
    shared_gate: bool = False
    """Shared-expert output is scaled by sigmoid(linear(x)) (Qwen2-MoE)."""
    gated: bool = True
    """False: experts are down(act(up(x))); the normalized "gate_up" then holds only the up rows [I, D]."""
    output_bias: bool = False
    """A learned bias [D] added to the block output (JetMoE), stored at ``{moe_prefix}.bias``."""
    kind: Literal["routed", "product_key"] = "routed"
    """``product_key``: Doge's cross-domain MoE — rank-1 experts (``down_embed``/``up_embed`` rows) chosen by a
    product-key router, added to a dense gated MLP (``shared``)."""
    zero_experts: int = 0
    """Extra identity ("zero-computation") experts after the real ones: choosing one adds weight · x (LongCat)."""
    scale_input: bool = False
    """The routing weight scales the expert's input instead of its output (Llama 4)."""
    shared_average: bool = False
    """Routed and shared outputs are averaged instead of summed (Cohere 2 MoE)."""
    output_norm: bool = False
    expert_out_norm: bool = False
    """Each routed expert's output passes an RMSNorm with that expert's own weight row before the weighted sum
    (Ergo): weights [E, D] at ``{moe_prefix}.{names.expert_out_norm}.weight``. The backend then runs one route per
    row (each token repeated top-k times, weight 1), so any expert backend serves it."""
    shared_out_norm: bool = False
    """The shared expert's output passes an RMSNorm (Ergo), weight at ``{moe_prefix}.{names.shared}.norm.weight``."""
    latent: int = 0
    """If > 0 (Nemotron-H latent MoE): routed experts run in a space of this width, entered through
    ``{moe_prefix}.fc1_latent_proj`` and left through ``fc2_latent_proj`` (biases with ``latent_bias``); the router
    and the shared experts read the full hidden state."""
    latent_bias: bool = False
    """RMSNorm over the block output (routed + shared), weights at ``model.layers.{i}.{names.moe_output_norm}``."""


@dataclass(frozen=True)
class RecurrentSpec:
    """A recurrent sequence mixer used instead of attention in some layers of hybrid models."""

    kind: Literal["gated_deltanet", "short_conv", "mamba2", "mamba", "lightning", "kda"]
    num_k_heads: int
    """Gated DeltaNet: key heads; Mamba-2: groups of B/C; Mamba: time-step rank."""
    num_v_heads: int
    """Gated DeltaNet: value heads; Mamba-2: SSM heads; Mamba: inner channels."""
    head_k_dim: int
    """Gated DeltaNet: key head dim; Mamba-2 / Mamba: state size N."""
    head_v_dim: int
    """Gated DeltaNet: value head dim; Mamba-2: channels per head P."""
    conv_kernel: int = 4
    layout: Literal["grouped", "split", "fused"] = "grouped"
    """Gated DeltaNet projections: ``grouped`` = Qwen3-Next ``in_proj_qkvz``/``in_proj_ba`` grouped per key head;
    ``split`` = separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3.5); ``fused`` = one
    ``in_proj`` holding [qkv | z | b | a] rows."""
    norm: str = "norm"
    """Name of the gated output norm inside the mixer."""
    norm_groups: int = 1
    """Mamba-2: the gated RMSNorm normalizes this many equal channel groups separately."""
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    proj_bias: bool = False
    inner_norms: bool = False
    """Mamba (Jamba): RMSNorms on the time step, B and C."""
    gate_lowrank: bool = True
    """KDA: forget and output gates are low-rank (``f_a``/``f_b``, ``g_a``/``g_b``) rather than one projection."""
    safe_gate_bound: float | None = None
    """KDA "safe gate": log-decay = bound · sigmoid(exp(A_log) · f) instead of -exp(A_log) · softplus(f)."""
    out_proj: str = "o_proj"
    slopes: tuple[float, ...] = ()
    """Lightning attention: per-head decay rates (state *= exp(-slope) per token)."""
    norm_eps: float = 1e-6
    """Lightning attention: eps of its output RMSNorm."""
    conv_bias: bool = False
    activation: str = "silu"
    """Activation after the short convolution (Mamba, Mamba-2, Gated DeltaNet, KDA) or on the qkv projection
    (lightning): the config's ``hidden_act`` (Nemotron-H: ``mamba_hidden_act``); output gates stay SiLU/sigmoid."""
    gate_activation: Literal["silu", "sigmoid"] = "silu"
    """Gated DeltaNet: the activation of the output gate z in its gated RMSNorm (Qwen4-Exp may use sigmoid)."""


@dataclass(frozen=True)
class ExtraTensor:
    """A tensor read by an architecture's own module rather than the generic decoder (Inkling 2's residual queries
    and convolutions, Qwen4-Exp's hyper-connection gates): loaded into ``LayerWeights.norms`` (layer extras) or
    ``ModelWeights.extras`` (model extras) under ``name``."""

    name: str
    """Relative to the layer prefix (layer extras) or the full checkpoint name (model extras)."""
    shape: tuple[int, ...]
    fp32: bool = True
    """Kept in fp32 whatever the model dtype (where the reference keeps the module in fp32); else the model dtype."""


@dataclass(frozen=True)
class NGramSpec:
    """Qwen4-Exp per-layer embeddings (``model/ngram.py``): hashed n-gram embeddings gated into the streams."""

    ngram_size: int
    heads_per_ngram: int
    vocab_base: int
    """Each hashed head's vocabulary is a distinct prime after this."""
    divisor: int
    """The table's rows are padded to a multiple of this."""
    seed: int
    eos: int
    """Hashing restarts after this token (and pads the context before the first token)."""
    vocab: int
    dim: int
    """Width of all heads' embeddings together."""
    conv_kernel: int
    index: int
    """This layer's rank among the PLE layers (it numbers the primes and seeds the multipliers)."""
    shards: int
    """The table is stored as this many ``shard_{k}`` tensors (``torch.chunk`` along the rows)."""


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: a sequence mixer (attention, or ``recurrent`` when set) then a dense MLP or an MoE block."""

    attention: AttentionSpec
    mlp: MLPSpec | None = None
    moe: MoESpec | None = None
    recurrent: RecurrentSpec | None = None
    """When set, this layer mixes tokens with a recurrent mixer instead of ``attention`` (which is then unused)."""
    residual_scales: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    """(mixer residual α, mixer output β, FFN residual α, FFN output β): h = α·r + β·f(·) (MiniMax)."""
    moe_shortcut: Literal["none", "compute", "add"] = "none"
    """LongCat's shortcut MoE: ``compute`` runs this layer's MoE beside its dense MLP on the same input and holds
    the result; ``add`` adds the held result to the stream at the end of this layer."""
    prefix: str | None = None
    """Overrides ``{names.layers}.{i}`` as this layer's weight prefix (two sub-blocks stored in one HF layer)."""
    names: WeightNames | None = None
    """Overrides the model's weight names for this layer."""
    parts: Literal["both", "mixer", "ffn"] = "both"
    ple: NGramSpec | None = None
    """Qwen4-Exp: per-layer n-gram embeddings added to the streams before the mixer (weights ``{layer}.ple.*``)."""
    extras: tuple[ExtraTensor, ...] = ()
    """Further tensors of this layer for the code that owns them (see ``ExtraTensor``)."""
    moe_beside_mlp: bool = False
    """Gemma 4: the dense MLP reads the normed stream as usual (its output normed by ``mlp_out``), and the MoE block
    reads the raw residual — routed on it (``model/gemma.py``), its experts on ``moe_in``-normed rows, its output
    normed by ``moe_out``; the sum then takes the ``ffn_out`` norm."""
    post_conv: int = 0
    """If > 0 (the kernel width): the mixer's and the FFN's outputs each pass a residual causal depthwise convolution
    (``attn_sconv`` / ``mlp_sconv``, fp32, state kept per sequence) before the residual add (Inkling)."""
    """Single-sublayer blocks (Nemotron-H): ``mixer`` = only the token mixer, ``ffn`` = only the MLP/MoE."""


@dataclass(frozen=True)
class WeightNames:
    """Where an architecture keeps its tensors inside a layer (relative to ``model.layers.{i}.``)."""

    moe_prefix: str = "mlp"
    mlp: str = "mlp"
    """Prefix of a dense layer's MLP."""
    router: str = "gate"
    """Module holding the router weight (``{router}.weight``)."""
    correction_bias: str = "gate.e_score_correction_bias"
    shared: str = "shared_experts"
    shared_gate: str = "shared_expert_gate"
    gate_up_layout: Literal["concat", "concat_transposed", "interleaved", "interleaved_transposed", "dbrx"] = "concat"
    """Fused 3-D layout: ``concat`` = [E, 2I, D] gate rows then up rows; ``interleaved_transposed`` = [E, D, 2I]
    with gate/up alternating columns and down stored as [E, I, D] (GPT-OSS); ``concat_transposed`` = [E, D, 2I] with
    gate columns then up columns and down [E, I, D]; ``interleaved`` = [E, 2I, D] with gate/up alternating rows
    (Inkling 2); ``dbrx`` = ``experts.mlp.{w1,v1,w2}`` each [E·I, D] (gate, up,
    transposed down)."""
    fused_names: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
    """Names of fused 3-D expert tensors under the MoE prefix (without ``.weight``)."""
    shared_at_layer: bool = False
    """The shared expert lives at ``model.layers.{i}.{shared}`` rather than under the MoE prefix (Granite)."""
    attn_in_norm: str | None = "input_layernorm"
    """Norm applied to the residual stream before attention (None: no pre-attention norm)."""
    attn_out_norm: str | None = None
    """Norm applied to the attention output before the residual add (OLMo-2 style post-norm, sandwich norms)."""
    ffn_in_norm: str | None = "post_attention_layernorm"
    ffn_out_norm: str | None = None
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    embed: str = "model.embed_tokens"
    attn: str = "self_attn"
    fused_qkv: str | None = None
    """One projection holding q, k and v rows (in that order) instead of three (Bailing, DBRX)."""
    o_proj: str = "o_proj"
    sinks: str = "sinks"
    output_gate: str = "gate_proj"
    output_gate_bias: str = "gate_bias"
    moe_output_norm: str = "post_mlp_layernorm"
    embed_norm: str | None = None
    """An RMSNorm applied to the token embeddings, weight at ``{name}.weight`` (Inkling)."""
    embed_affine: str | None = None
    """The embeddings become (e + ``{name}_bias``) · ``{name}_scale`` (per channel; ZAYA's input scaling)."""
    residual_affine: tuple[str, str] | None = None
    """Per sub-layer (mixer, FFN) a learned affine residual: h = (f + hidden_states_bias) · hidden_states_scale +
    (h + residual_bias) · residual_scale, weights under ``{name}.`` (ZAYA)."""
    post_convs: tuple[str, str] = ("attn_sconv", "mlp_sconv")
    """With ``LayerSpec.post_conv``: the mixer-output and FFN-output convolutions (``{name}.conv1d.weight``)."""
    gated_norm_roles: tuple[str, ...] = ()
    """Norm roles (``attn_in``, ``ffn_in``, ...) that are gated RMSNorms: y = rms(x)·w, y · sigmoid(W_up silu(W_down y)),
    stored as ``{name}.norm.weight``, ``{name}.W_down.weight``, ``{name}.W_up.weight`` (A.X K2)."""
    residual_gates: tuple[str, str] | None = None
    """Per sub-layer (mixer, FFN) a learned residual gate ``{name}.weight`` w [D] (Ergo): h = sigmoid(w)·f +
    sqrt(1 + sigmoid(w))·exp(-softplus(w) / 2)·h, loaded as the affine residual of ``residual_affine``."""
    expert_out_norm: str = "experts.post_expert_norm"
    """With ``MoESpec.expert_out_norm``: the per-expert output norms' module under the MoE prefix."""
    residual_weights: tuple[str, str] | None = None
    """Learned per-channel residual scales (mixer, FFN) stored at ``model.layers.{i}.{name}`` (Doge)."""
    final_norm: str | None = "model.norm"
    """None: the model has no final norm (Qwen4-Exp's last hyper-connection mix replaces it)."""
    lm_head: str = "lm_head"
    """The output projection (``{lm_head}.weight``); DeepSeek-V4 checkpoints call it ``head``."""
    layers: str = "model.layers"
    recurrent: str = "linear_attn"
    """Prefix of a recurrent mixer's tensors inside a layer."""
    correction_at_layer: bool = False
    """The correction bias lives at ``model.layers.{i}.{correction_bias}`` rather than under the MoE prefix."""
    router_at_layer: bool = False
    """The router lives at ``model.layers.{i}.{router}`` rather than under the MoE prefix (Gemma 4)."""
    layer_scalar: str | None = None
    """A learned scalar [1] under the layer prefix that multiplies the layer's output (Gemma 4)."""
    layer_norms: tuple[tuple[str, str], ...] = ()
    """Further per-layer weights by (role in ``LayerWeights.norms``, checkpoint name under the layer prefix), all of
    the hidden size (Gemma 4's ``mlp_out`` / ``moe_in`` / ``moe_out`` norms)."""


@dataclass(frozen=True)
class AttnResidualSpec:
    """Inkling 2's block attention residuals (``model/attn_residual.py``): instead of one residual stream, each
    sub-layer reads a learned-query attention over the states saved at every ``block_layers``-th layer boundary plus
    the running partial sum; layers ``loop_start..loop_end`` may run ``loop_passes`` times (each pass its own KV and
    conv states: ``ModelSpec.layers`` lists every visit), later passes mixing in messages from the previous one."""

    block_layers: int
    weight_layers: int
    """Number of distinct decoder layers in the checkpoint (``ModelSpec.layers`` lists each loop pass's visits)."""
    loop_start: int = 0
    loop_end: int = 0
    loop_passes: int = 1
    loop_gate_rank: int = 0


@dataclass(frozen=True)
class GatedHyperSpec:
    """Qwen4-Exp gated-residual hyper-connections (``model/gated_hyper.py``): ``streams`` residual streams; each
    sub-layer reads a sigmoid-gated mean of the normed streams (a rank-``rank`` gate) and its output is injected into
    every stream with a learned weight; a last mix collapses the streams before the head (no final norm)."""

    streams: int
    rank: int


@dataclass(frozen=True)
class ModelSpec:
    """Everything the generic decoder needs to run an architecture. Frozen: never mutated after the adapter."""

    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    norm_eps: float = 1e-6
    norm_kind: Literal["rms", "layer"] = "rms"
    """Residual-stream norms: RMSNorm, or mean-centred LayerNorm (Cohere, PhiMoE)."""
    norm_bias: bool = False
    """LayerNorms have a bias (PhiMoE)."""
    residual_from_norm: bool = False
    """The residual is the *normed* input of each sub-layer, not the raw stream (MiniMax-01)."""
    parallel_block: bool = False
    """Attention and FFN both read the same normed input and are added together (Cohere)."""
    final_logit_softcap: float = 0.0
    """If > 0, logits become ``cap * tanh(logits / cap)`` (after the divisor)."""
    hyper_streams: int = 0
    """If > 0: hyper-connections with this many residual streams (HY-V4); weights ``hc_pre.hc_{attn,mlp}_layer``."""
    hyper_magnitude: float = 2.0
    hyper_eps: float = 1e-6
    hyper_sinkhorn_iters: int = 0
    """If > 0: manifold-constrained hyper-connections (DeepSeek-V4, ``model/mhc.py``): the streams are also mixed by
    an N×N matrix projected towards doubly stochastic with this many Sinkhorn iterations; weights
    ``hc_attn_{fn,base,scale}`` / ``hc_ffn_*`` per layer and ``model.hc_head.hc_*``."""
    per_layer_input: int = 0
    """If > 0: Gemma 4 per-layer inputs of this width (``model/gemma.py``): a token embedding per layer plus a
    projection of the embeddings, gated into the stream at the end of each layer, which is then scaled by its
    ``layer_scalar``."""
    per_layer_vocab: int = 0
    """Rows of the per-layer token embedding table."""
    norm_weight_offset: float = 0.0
    """Added to every RMSNorm weight at load time (zero-centered norms ``x·(1+w)``: Qwen3-Next, Gemma)."""
    tie_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    lm_head_bias: bool = False
    gated_hyper: GatedHyperSpec | None = None
    """Qwen4-Exp: gated-residual hyper-connections replace the residual stream (see ``GatedHyperSpec``)."""
    attn_residual: AttnResidualSpec | None = None
    """Inkling 2: block attention residuals replace the residual stream (see ``AttnResidualSpec``)."""
    extras: tuple[ExtraTensor, ...] = ()
    """Further model-level tensors for the code that owns them (see ``ExtraTensor``)."""
    lm_head_rows: int | None = None
    """Logits are produced for the first ``lm_head_rows`` tokens only (the checkpoint's head rows beyond are padding,
    dropped at load; Inkling's ``unpadded_vocab_size``)."""
    max_position: int = 4096
    names: WeightNames = field(default_factory=WeightNames)
    checkpoint_renames: tuple[tuple[str, str, bool], ...] = ()
    """Checkpoints in a model's original layout: (regex, replacement, stored transposed) rules rewriting each stored
    tensor name into the name this spec reads, applied in order (transformers' ``conversion_mapping`` for the type;
    ``CheckpointReader``)."""
    ignored_tensors: tuple[str, ...] = ()
    """Regexes of checkpoint tensors knowingly unused (e.g. DeepSeek multi-token-prediction layers)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def state_layers(self) -> list[int]:
        """Layers that keep a per-sequence state beside their KV (recurrent mixers, Inkling's and ZAYA's
        convolutions)."""
        conv = lambda a: a is not None and (a.relpos is not None or a.kind == "cca")  # noqa: E731
        return [i for i, layer in enumerate(self.layers)
                if layer.recurrent is not None or layer.post_conv or conv(layer.attention)]

    def moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.moe is not None]

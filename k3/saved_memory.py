"""``moonep bench k3-memory``: bytes K3 layers save for the backward, per token per layer, by module.

A forward of a real ``K3Model`` (one sequence) runs under ``torch.autograd.graph.saved_tensors_hooks``; every
tensor autograd keeps is charged to the innermost tagged module running when it was saved (``MODULES``: the
attention sublayer (``mla`` / ``kda``), the FFN (``moe`` / ``dense_mlp``), the two ``attn_res`` mixes, the two
layer ``norms``), each storage once (a view of a storage already counted adds nothing) and parameters not at
all. A tensor computed from parameters alone (a cast of a weight, a product of two gains) is made once per step
whatever the token count: it is reported apart as ``fixed_bytes``, so ``bytes_per_token`` is what grows with
the tokens. Not seen: what a custom autograd function keeps as a ``ctx`` attribute instead of through
``save_for_backward`` (moonep's routing plan).

Widths: ``scaled_config(m)`` is K3 with every width (hidden, heads, LoRA ranks, MLP and expert widths, latent,
expert count) at ``m / 32`` of the released one and the head widths and top-k kept, so each per-token count is
``a + b m`` and two widths fit it; ``m = 32`` is K3. An AttnRes mix saves in proportion to its sources
(``n`` = completed blocks + the partial sum), so each mix's bytes are fitted as ``a + b n`` and averaged over the
released layer schedule (93 layers, blocks of 12). JSON: ``{"config", "runs": [per width and sequence length:
"width", "hidden_size", "seq_len", "bytes_per_token" {module: bytes per token per layer}, "fixed_bytes"
{module: bytes}, "mixes" [[layer, sources, bytes per token]], "square" (shapes of saved tensors with two axes
of the sequence length)], "k3": [per sequence length: {module: bytes per token per layer at K3's widths},
"mla_layer", "kda_layer"]}``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from k3.config import K3Config, LinearAttnConfig
from k3.model import K3Model, build_model
from k3.parallelize import apply_ep

if TYPE_CHECKING:
    from collectives.base import Communicator

MODULES = ("mla", "kda", "moe", "dense_mlp", "attn_res", "norms")
K3_WIDTH = 32
"""``scaled_config(K3_WIDTH)`` has the released widths (every scaled width of K3 divides by 32)."""


def scaled_config(m: int, layers: int = 8, block: int = 2) -> K3Config:
    """K3 at ``m / 32`` of every width (see the module docstring); MLA at every 4th layer, layer 0 dense."""
    full = K3Config.preset("full")

    def w(x: int) -> int:
        return x * m // K3_WIDTH

    mla = [i for i in range(1, layers + 1) if i % 4 == 0]
    return dataclasses.replace(
        full,
        vocab_size=256,
        hidden_size=w(full.hidden_size),
        num_hidden_layers=layers,
        num_attention_heads=w(full.num_attention_heads),
        num_key_value_heads=w(full.num_key_value_heads),
        q_lora_rank=w(full.q_lora_rank),
        kv_lora_rank=w(full.kv_lora_rank),
        linear_attn_config=LinearAttnConfig(
            num_heads=w(full.linear_attn_config.num_heads),
            head_dim=full.linear_attn_config.head_dim,
            full_attn_layers=mla,
            kda_layers=[i for i in range(1, layers + 1) if i not in mla],
        ),
        intermediate_size=w(full.intermediate_size),
        num_experts=w(full.num_experts),
        moe_intermediate_size=w(full.moe_intermediate_size),
        routed_expert_hidden_size=w(full.routed_expert_hidden_size),
        attn_res_block_size=block,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def module_tags(model: K3Model) -> dict[nn.Module, tuple[str, int]]:
    """Module -> (``MODULES`` entry, layer index) for every sublayer of ``model``'s decoder layers."""
    tags = {}
    for i, layer in enumerate(model.layers):
        tags[layer.self_attn] = (layer.kind, i)
        tags[layer.mlp] = ("moe" if model.cfg.is_moe(i) else "dense_mlp", i)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            tags[norm] = ("norms", i)
        for mix in (layer.attn_res, layer.mlp_res):
            tags[mix] = ("attn_res", i)
    return tags


class _WeightCopies(TorchFunctionMode):
    """Knows the tensors computed from parameters alone (a cast, a transpose, a product of two gains): ``t in
    self``. Such a copy is made once per step whatever the token count, so it is no per-token cost."""

    def __init__(self, params) -> None:
        super().__init__()
        self._ids: set[int] = set()
        for p in params:
            self._mark(p)

    def _mark(self, t: torch.Tensor) -> None:
        if id(t) not in self._ids:
            self._ids.add(id(t))
            weakref.finalize(t, self._ids.discard, id(t))  # a dead tensor's id may be reused by an activation

    def __contains__(self, t: torch.Tensor) -> bool:
        return id(t) in self._ids

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = list(_tensors((args, kwargs)))
        if inputs and all(id(a) in self._ids for a in inputs):
            for o in _tensors(out):
                self._mark(o)
        return out


def _tensors(obj):
    """The tensors in ``obj``, a tensor or nested lists, tuples and dicts of them (an op's arguments or outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


@dataclasses.dataclass
class _Saved:
    """One storage the graph keeps: how many saved tensors hold it, and where it is charged."""

    holders: int
    """Saved tensors alive on this storage; at 0 the graph has dropped it (a branch whose result went unused)."""
    tag: tuple[str, int]
    """(``MODULES`` entry or ``other``, layer index) running when it was first saved."""
    nbytes: int
    """Bytes of the whole storage."""
    weight_copy: bool
    """Computed from parameters alone: charged to ``fixed``, not per token."""
    mix: int
    """Index into ``SavedBytes.mixes`` of the AttnRes call that saved it, or -1."""
    shape: tuple[int, ...]
    """Shape of the first tensor saved on it."""


class SavedBytes:
    """Context manager over one forward of ``model``: bytes the graph keeps for the backward when the forward
    ends (rules in the module docstring) as ``saved[(module, layer)]`` (what grows with the tokens) and
    ``fixed[module]`` (weight copies), ``mixes`` [[layer, sources, bytes]] per AttnRes call and ``shapes``
    [(module, shape)] of every counted storage."""

    def __init__(self, model: K3Model) -> None:
        self.model = model
        self.saved: dict[tuple[str, int], int] = {}
        self.fixed: dict[str, int] = {}
        self.mixes: list[list[int]] = []
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        self._stack: list[tuple[str, int]] = []
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._live: dict[int, _Saved] = {}  # storage address -> what holds it; live storages never share one
        self._weights = _WeightCopies(model.parameters())
        self._handles = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or storage.nbytes() == 0:
            return t
        if ptr not in self._live:
            tag = self._stack[-1] if self._stack else ("other", -1)
            mix = len(self.mixes) - 1 if tag[0] == "attn_res" else -1
            self._live[ptr] = _Saved(0, tag, storage.nbytes(), t in self._weights, mix, tuple(t.shape))
        self._live[ptr].holders += 1
        # the graph holds what it saved; when a dropped branch frees t, its address may serve a later tensor
        weakref.finalize(t, self._release, ptr)
        return t

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is not None:
            entry.holders -= 1
            if entry.holders == 0:
                del self._live[ptr]

    def _enter(self, tag: tuple[str, int], args) -> None:
        self._stack.append(tag)
        if tag[0] == "attn_res":
            blocks = args[0]
            self.mixes.append([tag[1], len(blocks) + 1, 0])

    def _leave(self) -> None:  # a forward hook that returns something replaces the module's output
        self._stack.pop()

    def __enter__(self) -> SavedBytes:
        for module, tag in module_tags(self.model).items():
            pre = module.register_forward_pre_hook(lambda mod, args, tag=tag: self._enter(tag, args))
            post = module.register_forward_hook(lambda mod, args, out: self._leave())
            self._handles += [pre, post]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._weights.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._weights.__exit__(*exc)
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        live, self._live = self._live, {}  # the totals as the forward leaves the graph; later frees are the backward's
        for entry in live.values():
            self.shapes.append((entry.tag[0], entry.shape))
            if entry.weight_copy:
                self.fixed[entry.tag[0]] = self.fixed.get(entry.tag[0], 0) + entry.nbytes
                continue
            self.saved[entry.tag] = self.saved.get(entry.tag, 0) + entry.nbytes
            if entry.mix >= 0:
                self.mixes[entry.mix][2] += entry.nbytes

    def by_module(self, tokens: int) -> dict[str, float]:
        """Module -> saved bytes per token, averaged over the layers that have it (``attn_res``: both mixes)."""
        out = {}
        for name in MODULES:
            layers = {i for (n, i) in module_tags(self.model).values() if n == name}
            total = sum(b for (n, _), b in self.saved.items() if n == name)
            if layers:
                out[name] = total / tokens / len(layers)
        return out


def build(cfg: K3Config, dtype: torch.dtype, comm: Communicator | None = None, tokens: int = 0) -> K3Model:
    """``build_model(cfg)`` in ``dtype``; with ``comm`` its MoE layers run moonep's EP step over a Buffer of
    ``tokens`` rows (what training runs, at any world size), else the all-local loop (``k3.naive``)."""
    model = build_model(cfg, seed=0, dtype=dtype)
    if comm is not None:
        apply_ep(model, comm, tokens=tokens, dtype=dtype)
    return model


def measure(model: K3Model, seq: int) -> dict:
    """One forward of ``model`` on one [1, seq] row of tokens under ``SavedBytes``; ``square``: the shapes of
    saved tensors with two axes of length ``seq`` (a [T, T] mask or score matrix)."""
    tokens = torch.randint(0, model.cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    with SavedBytes(model) as saved:
        logits = model(tokens)
    del logits  # the graph, and every tensor it saved, goes here
    return {
        "seq_len": seq,
        "bytes_per_token": saved.by_module(seq),
        "fixed_bytes": dict(sorted(saved.fixed.items())),
        "mixes": [[layer, n, b / seq] for layer, n, b in saved.mixes],
        "square": [list(shape) for _, shape in saved.shapes if sum(d == seq for d in shape) >= 2],
    }


def mix_sources(cfg: K3Config) -> list[list[int]]:
    """Per layer of ``cfg``, the source count of each AttnRes mix it runs (``DecoderLayer.forward``'s schedule:
    layer 0 reads the embedding alone; a layer at a block boundary closes the block after its first mix)."""
    out, blocks = [], 0
    for i in range(cfg.num_hidden_layers):
        first = [blocks + 1] if blocks else []
        blocks += i % cfg.attn_res_block_size == 0
        out.append(first + [blocks + 1])
    return out


def fit_mixes(mixes: list[list[float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of bytes per token = a + b * sources over the mixes of layers >= 1 (layer 0's
    mix is the first to keep the embedding, a once-per-model cost)."""
    pts = [(n, b) for layer, n, b in mixes if layer >= 1]
    mean_n, mean_b = sum(n for n, _ in pts) / len(pts), sum(b for _, b in pts) / len(pts)
    var = sum((n - mean_n) ** 2 for n, _ in pts)
    slope = sum((n - mean_n) * (b - mean_b) for n, b in pts) / var if var else 0.0
    return mean_b - slope * mean_n, slope


def at_k3(small: dict, large: dict, m_small: int, m_large: int) -> dict[str, float]:
    """Bytes per token per layer by module at K3's widths, linear in the width from two ``measure`` results;
    ``attn_res`` averaged over the released 93-layer schedule; ``mla_layer`` / ``kda_layer``: MoE layer totals."""
    grow = (K3_WIDTH - m_small) / (m_large - m_small)

    def line(lo: float, hi: float) -> float:
        return lo + (hi - lo) * grow

    lo, hi = small["bytes_per_token"], large["bytes_per_token"]
    out = {name: line(lo[name], hi[name]) for name in MODULES if name != "attn_res"}
    (a0, b0), (a1, b1) = fit_mixes(small["mixes"]), fit_mixes(large["mixes"])
    a, b = line(a0, a1), line(b0, b1)
    per_layer = [sum(a + b * n for n in layer) for layer in mix_sources(K3Config.preset("full"))]
    out["attn_res"] = sum(per_layer) / len(per_layer)
    common = out["moe"] + out["norms"] + out["attn_res"]
    out["mla_layer"], out["kda_layer"] = out["mla"] + common, out["kda"] + common
    return out


def check_bench_args(widths, seq_lens) -> None:
    """ValueError naming the flag unless there are two or more different widths (the fit needs two) and every
    width and sequence length is >= 1 (>= 2 tokens)."""
    if len(set(widths)) < 2 or min(widths) < 1:
        raise ValueError(f"--widths: give two or more different widths >= 1, got {','.join(map(str, widths))}")
    if not seq_lens or min(seq_lens) < 2:
        raise ValueError(f"--seq-lens: every sequence length must be >= 2, got {','.join(map(str, seq_lens))}")


def run_memory_bench(
    comm: Communicator | None = None, widths=(2, 4), seq_lens=(120, 240), dtype: str = "bfloat16"
) -> dict:
    """``measure`` at every width and sequence length (a fresh model each), then ``at_k3`` per sequence length
    from the two smallest widths."""
    check_bench_args(widths, seq_lens)
    torch.manual_seed(0)
    runs = []
    for m in widths:
        for seq in seq_lens:
            model = build(scaled_config(m), getattr(torch, dtype), comm, tokens=seq)
            runs.append({"width": m, "hidden_size": model.cfg.hidden_size, **measure(model, seq)})
    by = {(r["width"], r["seq_len"]): r for r in runs}
    m0, m1 = sorted(widths)[:2]
    k3 = [{"seq_len": seq, **at_k3(by[m0, seq], by[m1, seq], m0, m1)} for seq in seq_lens]
    config = {"widths": list(widths), "seq_lens": list(seq_lens), "dtype": dtype, "moe": "ep" if comm else "local"}
    return {"config": config, "runs": runs, "k3": k3}


def memory_bench_rank(comm: Communicator, **kwargs) -> dict:
    """``run_memory_bench`` on one launched rank (world size 1: the EP step with every expert local)."""
    torch.set_num_threads(1)
    return run_memory_bench(comm, **kwargs)


def format_table(out: dict) -> list[str]:
    """The bench as text: measured bytes per token per layer by module, each width and sequence length, then
    the K3-width extrapolation per sequence length."""
    cols = [*MODULES, "mla_layer", "kda_layer"]
    lines = [f"{'bytes/token/layer':<22}" + "".join(f"{c:>11}" for c in cols)]
    for r in out["runs"]:
        row = r["bytes_per_token"]
        label = f"d={r['hidden_size']} T={r['seq_len']}"
        lines.append(f"{label:<22}" + "".join(f"{row[c]:>11.0f}" if c in row else f"{'':>11}" for c in cols))
    for r in out["k3"]:
        label = f"K3 d=7168 T={r['seq_len']}"
        lines.append(f"{label:<22}" + "".join(f"{r[c]:>11.0f}" for c in cols))
    return lines

"""LoRA adapters: read from a GGUF that llama.cpp's ``convert_lora_to_gguf.py`` wrote or from a PEFT folder, checked
against the base model, and held by the compact decoder as stacked low-rank weights per linear (``LoraSlots``).

An adapter adds ``scale * B @ (A @ x)`` to a linear's output for the tokens of the rows that use it, A [rank, in]
and B [out, rank] as both formats store them. The scale is llama.cpp's: the adapter's alpha over the tensor's rank
(alpha 0: 1), times the request's scale; a PEFT folder's own rule where llama.cpp's converter drops it (an
``alpha_pattern``'s alpha, and ``use_rslora``: alpha over the square root of the rank). Tensors are named as
llama.cpp names the base model's (``blk.N.attn_q``); a PEFT module's name is mapped to that name with gguf-py's
``TensorNameMap``. Each name lands on one of the decoder's linears (``targets``): q, k and v on the fused qkv, gate
and up on the fused gate/up, each at its rows. A GGUF adapter's q and k rows of a family whose converter permuted
them are put back in the order the decoder's rotary reads (as the base weights are).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .families import Family, describe
from .lora_files import GGUF_MAGIC, PEFT_CONFIG, PEFT_WEIGHTS

ROLES = ("qkv", "o", "gate_up", "down")  # the compact decoder's linears, in a layer's order


@dataclass(frozen=True)
class Target:
    """Where one of the base model's tensors sits in the decoder: its linear (a ROLES entry), its first output
    row there, its shape, and the heads whose q or k rows a GGUF's converter permuted (None: as they are)."""

    role: str
    offset: int
    rows: int
    cols: int
    heads: int | None = None


def targets(config, family: Family) -> dict[str, Target]:
    """Every tensor an adapter may target, by llama.cpp's name (``blk.N.attn_q``), for a model of this config: q, k
    and v apart or fused (a family that names a fused qkv, or one whose MLP and attention run in parallel, whose
    files hold attn_qkv), gate and up apart or fused (a family that names a fused gate/up, or an ungated MLP's up)."""
    spec = describe(config)
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "ffn_hidden_size", None) or 4 * hidden
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    permuted = family.permuted_qk
    out: dict[str, Target] = {}
    for i in range(config.num_hidden_layers):
        p = f"blk.{i}."
        if family.names["qkv"] or family.parallel:
            out[p + "attn_qkv"] = Target("qkv", 0, q + 2 * kv, hidden)
        else:
            out[p + "attn_q"] = Target("qkv", 0, q, hidden, spec.heads if permuted else None)
            out[p + "attn_k"] = Target("qkv", q, kv, hidden, spec.kv_heads if permuted else None)
            out[p + "attn_v"] = Target("qkv", q + kv, kv, hidden)
        out[p + "attn_output"] = Target("o", 0, hidden, q)
        if family.names["gate_up"]:
            out[p + "ffn_up"] = Target("gate_up", 0, 2 * inter, hidden)
        elif not family.gated:
            out[p + "ffn_up"] = Target("gate_up", 0, inter, hidden)
        else:
            out[p + "ffn_gate"] = Target("gate_up", 0, inter, hidden)
            out[p + "ffn_up"] = Target("gate_up", inter, inter, hidden)
        out[p + "ffn_down"] = Target("down", 0, hidden, inter)
    return out


@dataclass
class LoraWeight:
    """One tensor's pair: A [rank, in], B [out, rank] (rows in the decoder's order), and alpha / rank."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class LoraAdapter:
    name: str
    path: str
    alpha: float
    weights: dict[str, LoraWeight] = field(default_factory=dict)  # by llama.cpp's tensor name (blk.N.attn_q)

    @property
    def rank(self) -> int:
        """The largest rank of its tensors (a PEFT rank_pattern may give some another)."""
        return max(w.a.shape[0] for w in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.weights.values() for t in (w.a, w.b))


def load_adapter(name: str, path: str | Path, config, family: Family, gguf_arch: str) -> LoraAdapter:
    """An adapter for a model of this config and family (llama.cpp's architecture name ``gguf_arch``): a GGUF file
    or a PEFT folder. ValueError naming the file and why when it is neither, or does not fit the model."""
    p = Path(path)
    if p.is_dir():
        if not (p / PEFT_CONFIG).is_file():
            raise ValueError(f"LoRA adapter {str(p)!r}: a folder without {PEFT_CONFIG} (not a PEFT adapter)")
        if family.gguf_only:  # (falcon: llama.cpp's converter lays its fused qkv out anew, the adapter's B with it)
            raise ValueError(
                f"LoRA adapter {str(p)!r}: a PEFT folder of a {family.model_type} model is read only as llama.cpp's "
                f"convert_lora_to_gguf.py converts it (its fused rows are laid out anew)"
            )
        return _read_peft(name, p, targets(config, family), config.num_hidden_layers, gguf_arch)
    if not p.is_file():
        raise ValueError(f"LoRA adapter {str(p)!r}: no such file or folder")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"LoRA adapter {str(p)!r}: unknown format (expected a GGUF from convert_lora_to_gguf.py, or a PEFT "
            f"folder with {PEFT_CONFIG} and {PEFT_WEIGHTS})"
        )
    return _read_gguf(name, p, targets(config, family), gguf_arch)


def _refuse_unknown(path: Path, tensor: str, known: dict[str, Target]) -> None:
    """The clear refusal of a tensor the decoder cannot take an adapter on."""
    if tensor in ("token_embd", "output"):
        what = "the token embedding" if tensor == "token_embd" else "the output head (lm_head)"
        raise ValueError(f"LoRA adapter {str(path)!r}: it adapts {what}, which this server does not (only linears)")
    if tensor not in known:
        raise ValueError(f"LoRA adapter {str(path)!r}: it targets {tensor!r}, which this model does not have")


def _check(path: Path, tensor: str, target: Target, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"LoRA adapter {str(path)!r}: {tensor}'s A {tuple(a.shape)} and B {tuple(b.shape)} are not a rank-r pair"
        )
    if a.shape[1] != target.cols or b.shape[0] != target.rows:
        raise ValueError(
            f"LoRA adapter {str(path)!r}: {tensor} is [{b.shape[0]}, {a.shape[1]}] in the adapter but "
            f"[{target.rows}, {target.cols}] in the model (an adapter of another base model?)"
        )


def _read_gguf(name: str, path: Path, known: dict[str, Target], gguf_arch: str) -> LoraAdapter:
    """A GGUF adapter as llama.cpp's llama_adapter_lora_init reads it: general.type adapter, adapter.type lora, the
    base model's architecture, adapter.lora.alpha, and ``<tensor>.weight.lora_a`` / ``.lora_b`` pairs."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from .gguf_model import unpermute_rows

    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: not a readable GGUF ({exc})") from None

    def field_value(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind, lora, arch = field_value("general.type"), field_value("adapter.type"), field_value("general.architecture")
    if kind != "adapter" or lora != "lora":
        raise ValueError(
            f"LoRA adapter {str(path)!r}: general.type {kind!r} and adapter.type {lora!r} (expected 'adapter' and "
            f"'lora': a file from convert_lora_to_gguf.py)"
        )
    if arch != gguf_arch:
        raise ValueError(f"LoRA adapter {str(path)!r}: made for architecture {arch!r}, the model is {gguf_arch!r}")
    alpha = float(field_value("adapter.lora.alpha", 0.0) or 0.0)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, part = t.name.rpartition(".weight.lora_")
        if part not in ("a", "b"):
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {t.name!r} is not a lora_a or lora_b weight")
        data = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        pairs.setdefault(base, {})[part] = torch.from_numpy(data.copy()).float()
    adapter = LoraAdapter(name, str(path), alpha)
    for tensor, pair in pairs.items():
        _refuse_unknown(path, tensor, known)
        if set(pair) != {"a", "b"}:
            raise ValueError(f"LoRA adapter {str(path)!r}: {tensor} lacks its lora_{'a' if 'a' not in pair else 'b'}")
        target = known[tensor]
        a, b = pair["a"], pair["b"]
        _check(path, tensor, target, a, b)
        if target.heads:  # convert_hf_to_gguf permuted B's q or k rows as it permutes the weight's
            b = unpermute_rows(b, target.heads)
        adapter.weights[tensor] = LoraWeight(a, b, alpha / a.shape[0] if alpha else 1.0)
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {str(path)!r}: it holds no LoRA tensors")
    return adapter


def _pattern(patterns: dict, module: str, default):
    """A PEFT rank_pattern / alpha_pattern entry for a module, matched as PEFT matches its keys (the key at the end
    of the module's name, after a dot)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_peft(name: str, folder: Path, known: dict[str, Target], layers: int, gguf_arch: str) -> LoraAdapter:
    """A PEFT LoRA folder: adapter_config.json (peft_type LORA, r, lora_alpha, alpha_pattern, use_rslora) and
    adapter_model.safetensors, its modules named as llama.cpp names the model's tensors."""
    import gguf
    from safetensors.torch import load_file

    path = folder / PEFT_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: not JSON ({exc})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {str(path)!r}: DoRA adapters are not supported (use_dora)")
    if cfg.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {str(path)!r}: it replaces whole modules ({', '.join(cfg['modules_to_save'])}), which "
            f"only linears' low-rank weights can do here"
        )
    weights_file = folder / PEFT_WEIGHTS
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {str(folder)!r}: no {PEFT_WEIGHTS}")
    tensors = load_file(str(weights_file))
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(gguf_arch)
    if arch is None:
        raise ValueError(f"LoRA adapter {str(folder)!r}: gguf-py does not know architecture {gguf_arch!r}")
    names = gguf.get_tensor_name_map(arch, layers)
    alpha = float(cfg.get("lora_alpha", 8))  # (PEFT's default)
    adapter = LoraAdapter(name, str(folder), alpha)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if ".lora_embedding_" in key or key.endswith(("embed_tokens.weight", "lm_head.weight")):
            _refuse_unknown(folder, "token_embd" if "embed" in key else "output", known)
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {str(folder)!r}: tensor {key!r} is not a lora_A or lora_B weight")
        pairs.setdefault(module.removeprefix("base_model.model."), {})[part[0]] = t.float()
    for module, pair in pairs.items():
        tensor = names.get_name(module)
        if tensor is None:
            raise ValueError(f"LoRA adapter {str(folder)!r}: module {module!r} is no tensor of a {gguf_arch} model")
        _refuse_unknown(folder, tensor, known)
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {str(folder)!r}: {module} lacks its lora_{'A' if 'A' not in pair else 'B'}")
        a, b = pair["A"], pair["B"]
        _check(folder, tensor, known[tensor], a, b)
        rank = a.shape[0]
        mod_alpha = float(_pattern(cfg.get("alpha_pattern"), module, alpha))
        scale = mod_alpha / math.sqrt(rank) if cfg.get("use_rslora") else mod_alpha / rank
        adapter.weights[tensor] = LoraWeight(a, b, scale)
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {str(folder)!r}: it holds no LoRA tensors")
    return adapter


@dataclass
class _Stack:
    """One linear's low-rank weights of every loaded adapter, stacked: A [adapters, rank, in] (each tensor's A
    times its alpha / rank, its tensors' ranks one after another, zero past them) and B [adapters, rank, out] (each
    tensor's B transposed, at its rows' place in the linear's output, zero elsewhere)."""

    a: torch.Tensor
    b: torch.Tensor


# the kernels' pieces of a layer: (linear: its place in ROLES_FUSED, A [adapters, rank, in], B [adapters, rank, rows]
# in float16, the first of the linear's output columns B's rows add to): one per tensor, so none of B is zeros
ROLES_FUSED = ("qkv", "o", "gate_up", "down")
KernelPiece = tuple[int, torch.Tensor, torch.Tensor, int]


class LoraSlots:
    """The adapters a compact decoder holds, each in a slot (a small integer the engine gives rows), and every
    linear's stacked weights over them (rebuilt when one is added or removed: rare, between steps).

    On the CPU kernels each tensor an adapter targets adds every (token, adapter, scale) pair's term in one call
    (``lora_add``: each token's own dot products, the same numbers whatever else the step holds), its weights held
    in float16 (half the bytes a step reads; the sums stay float32). Elsewhere a forward's adapter tokens are grouped
    by adapter (``plan``), and each linear adds their terms in two batched matmuls: each group's inputs times its
    adapter's A, scaled per token by the request's scale, times its B, added to those tokens' outputs alone. A
    token of several adapters gets each one's term."""

    def __init__(self, model_targets: dict[str, Target], layers: int, device, dtype: torch.dtype, kernels=None):
        """``kernels``: the CPU kernels where the model runs on them (CompactLM.kernels; the plan's cpu_kernels,
        which pre-flight counts by), else None."""
        self.targets, self.layers, self.device, self.dtype = model_targets, layers, device, dtype
        self.kernels = kernels
        self.adapters: dict[int, LoraAdapter] = {}
        self.position: dict[int, int] = {}  # slot -> its place in the stacks
        self.stacks: list[dict[str, _Stack]] = [{} for _ in range(layers)]  # (the matmuls' form)
        self.pieces: list[list[KernelPiece]] = [[] for _ in range(layers)]  # (the kernels' form)
        self.generation = 0  # how many times the stacks were built
        self._by_linear: dict[tuple[int, str], list[str]] = {}  # (layer, role) -> its tensors' names
        for tensor, t in model_targets.items():
            self._by_linear.setdefault((int(tensor.split(".")[1]), t.role), []).append(tensor)

    def add(self, adapter: LoraAdapter) -> int:
        """Hold an adapter; returns its slot (the lowest free)."""
        slot = next(i for i in range(len(self.adapters) + 1) if i not in self.adapters)
        self.adapters[slot] = adapter
        self._restack()
        return slot

    def remove(self, slot: int) -> None:
        self.adapters.pop(slot, None)
        self._restack()

    @property
    def zero_place(self) -> int:
        """The matmuls' stacks' place of all zeros (one past the adapters): a row without adapters in a
        ``LoraRows`` plan."""
        return len(self.adapters)

    def _restack(self) -> None:
        self.generation += 1  # (what a captured step read is gone: DecodeGraphs captures the adapter steps again)
        slots = sorted(self.adapters)
        self.position = {s: i for i, s in enumerate(slots)}
        self.stacks = [{} for _ in range(self.layers)]
        self.pieces = [[] for _ in range(self.layers)]
        for (layer, role), tensors in self._by_linear.items():
            used = [[(n, self.adapters[s].weights[n]) for n in tensors if n in self.adapters[s].weights] for s in slots]
            if not any(used):
                continue
            if self.kernels is not None:
                self.pieces[layer].extend(self._pieces(ROLES_FUSED.index(role), tensors, slots))
                continue
            cols = self.targets[tensors[0]].cols
            out = max(self.targets[n].offset + self.targets[n].rows for n in tensors)
            rank = max(sum(w.a.shape[0] for _, w in u) for u in used)
            a = torch.zeros(len(slots) + 1, rank, cols)  # (one past the adapters: zeros, ``zero_place``)
            b = torch.zeros(len(slots) + 1, rank, out)
            for i, u in enumerate(used):
                r = 0
                for n, w in u:
                    t, k = self.targets[n], w.a.shape[0]
                    a[i, r : r + k] = w.a * w.scale
                    b[i, r : r + k, t.offset : t.offset + t.rows] = w.b.T
                    r += k
            self.stacks[layer][role] = _Stack(a.to(self.device, self.dtype), b.to(self.device, self.dtype))

    def _pieces(self, linear: int, tensors: list[str], slots: list[int]) -> list[KernelPiece]:
        """The kernels' pieces of one linear: each tensor some adapter targets, its A and B over every slot (zero
        for an adapter without it, and past an adapter's rank up to the largest)."""
        out = []
        for n in tensors:
            weights = [self.adapters[s].weights.get(n) for s in slots]
            rank = max((w.a.shape[0] for w in weights if w is not None), default=0)
            if not rank:
                continue
            t = self.targets[n]
            a = torch.zeros(len(slots), rank, t.cols, dtype=torch.float16)
            b = torch.zeros(len(slots), rank, t.rows, dtype=torch.float16)
            for i, w in enumerate(weights):
                if w is not None:
                    a[i, : w.a.shape[0]] = w.a * w.scale
                    b[i, : w.a.shape[0]] = w.b.T
            out.append((linear, a, b, t.offset))
        return out

    @property
    def nbytes(self) -> int:
        held = [t for s in self.stacks for st in s.values() for t in (st.a, st.b)]
        held += [t for layer in self.pieces for _, a, b, _ in layer for t in (a, b)]
        return sum(t.numel() * t.element_size() for t in held)

    def plan(self, pairs: list[tuple[int, int, float]], tokens: int) -> LoraPlan | None:
        """A forward's adapter terms from its pairs (token index among its ``tokens`` real tokens, slot, scale): on
        the kernels the pairs themselves, by adapter (``LoraPairs``); else the tokens grouped by adapter
        (``LoraGroups``). None without any pair."""
        if not pairs:
            return None
        for _, slot, _ in pairs:
            if slot not in self.position:
                raise ValueError(f"LoRA slot {slot} holds no adapter")
        if self.kernels is not None:
            places, index, scales = zip(*sorted((self.position[slot], token, scale) for token, slot, scale in pairs))
            return LoraPairs(torch.tensor(index), torch.tensor(places), torch.tensor(scales, dtype=torch.float32))
        groups: dict[int, list[tuple[int, float]]] = {}
        for token, slot, scale in pairs:
            groups.setdefault(self.position[slot], []).append((token, scale))
        used = sorted(groups)
        longest = max(len(g) for g in groups.values())
        index = torch.tensor([[t for t, _ in groups[p]] + [groups[p][0][0]] * (longest - len(groups[p])) for p in used])
        scales = torch.tensor([[s for _, s in groups[p]] + [0.0] * (longest - len(groups[p])) for p in used])
        return LoraGroups(
            None if used == list(range(len(self.adapters))) else torch.tensor(used, device=self.device),
            index.to(self.device),
            None if bool((scales == 1).all()) else scales[..., None].to(self.device, self.dtype),
            whole=len(used) == 1 and index[0].tolist() == list(range(tokens)),
        )

    def add_delta(self, layer: int, role: str, x: torch.Tensor, y: torch.Tensor, plan: LoraPlan) -> torch.Tensor:
        """y (a linear's output for the real tokens x, [N, out]) plus each adapter token's scale * B (A x), in place;
        the other tokens' outputs untouched."""
        if isinstance(plan, LoraPairs):  # (made only where the kernels add them)
            assert self.kernels is not None
            linear = ROLES_FUSED.index(role)
            for k, a, b, offset in self.pieces[layer]:
                if k == linear:
                    y_cols = y.narrow(1, offset, b.shape[2])
                    self.kernels.lora_add(x.contiguous(), a, b, plan.index, plan.places, plan.scales, y_cols)
            return y
        stack = self.stacks[layer].get(role)
        if stack is None:
            return y
        if isinstance(plan, LoraRows):  # each token's own adapter's A and B (the zeros for a row without)
            h = torch.bmm(stack.a.index_select(0, plan.places), x.to(stack.a.dtype)[:, :, None])  # [N, rank, 1]
            h = h.mul_(plan.scales[:, :, None]).transpose(1, 2)
            return y.add_(torch.bmm(h, stack.b.index_select(0, plan.places))[:, 0].to(y.dtype))
        a, b = stack.a[: self.zero_place], stack.b[: self.zero_place]
        a = a.transpose(1, 2)  # [adapters, in, rank]
        if plan.used is not None:  # only the adapters this forward uses
            a, b = a.index_select(0, plan.used), b.index_select(0, plan.used)
        if plan.whole and y.dtype == a.dtype:  # one adapter, every token: its terms straight onto y
            h = torch.mm(x.to(a.dtype), a[0])
            return y.addmm_(h if plan.scales is None else h.mul_(plan.scales[0]), b[0])
        flat = plan.index.view(-1)
        xs = x.index_select(0, flat).view(*plan.index.shape, -1).to(a.dtype)  # [groups, longest, in]
        h = torch.bmm(xs, a)
        delta = torch.bmm(h if plan.scales is None else h.mul_(plan.scales), b)  # [groups, longest, out]
        return y.index_add_(0, flat, delta.view(flat.shape[0], -1).to(y.dtype))


@dataclass
class LoraPairs:
    """The CPU kernels' plan: each (token, adapter, scale) pair, sorted by adapter."""

    index: torch.Tensor  # [P] the pairs' tokens, as indices into the real tokens
    places: torch.Tensor  # [P] their adapters' places in the stacks
    scales: torch.Tensor  # [P] float32


@dataclass
class LoraGroups:
    """The batched matmuls' plan: the adapter tokens grouped by adapter."""

    used: torch.Tensor | None  # the stacks' places of the adapters used (None: every adapter held, in order)
    index: torch.Tensor  # [groups, longest] each group's tokens, as indices into the real tokens
    scales: torch.Tensor | None  # [groups, longest, 1] each token's scale for its group's adapter (padding: 0); None: 1
    whole: bool = False  # one adapter takes every token, in order


@dataclass
class LoraRows:
    """A static decode step's plan (CUDA graphs): each token's adapter place in the matmuls' stacks (``zero_place``
    for none) and scale; one adapter a token at most. Its tensors are the captured step's inputs."""

    places: torch.Tensor  # [N] long
    scales: torch.Tensor  # [N, 1] float32


LoraPlan = LoraPairs | LoraGroups | LoraRows

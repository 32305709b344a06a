"""LoRA adapters on the lean decoder: unmerged, many at once, each batch row with its own.

An adapter is what peft saves (`adapter_config.json`, `adapter_model.safetensors`): for each
adapted linear layer, A (r, in) and B (out, r). peft's layer computes
    y = W x + scaling * B (A x),   scaling = lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora)
(dropout sits on x before A and is the identity at inference). `read_adapter` loads such a
folder, refusing with the field named what this runner does not do (DoRA, LoRA biases,
fan_in_fan_out, modules_to_save, per-module rank or alpha patterns, layers other than the
seven projections of a Llama-style block); scaling is folded into B once.

`Resident` is an adapter laid out for one decoder: per layer, the pair (A, B) of each fused
projection the decoder runs. q/k/v and gate/up are fused there, so their A's are stacked,
(r_q + r_k + r_v, in), and their B's set block-diagonally, (out_q + out_k + out_v, r_q + r_k +
r_v): one pair of matmuls gives the three deltas in the fused layout. A projection the adapter
leaves alone contributes rank 0.

Per-row application (`RowGroups`): each token gets `delta = (x A^T) B^T` of its row's adapter
added into the base output, rows without an adapter untouched: what vLLM's punica kernels
compute. With several adapters in a decode step the tokens are grouped by adapter and each
group multiplied by its own adapter's A and B, all groups in two batched matmuls. Shapes:
x (N, in) and out (N, out) with N = B * S tokens, row b's tokens at [b * S, (b + 1) * S).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from flywheel.models.loading import is_adapter_folder  # noqa: F401 - part of this module's API

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
# the decoder's projections an adapter adds to, and the model's modules each holds: q/k/v fused
# (their B block-diagonal), SwiGLU's gate and up apart (each delta added before the activation)
PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate": ("gate_proj",), "up": ("up_proj",),
         "down": ("down_proj",)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter folder this runner cannot use; the message names the file and field."""


@dataclass(frozen=True)
class Adapter:
    """One adapter as read: per (layer, module name), (A (r, in), B (out, r) * scaling)."""

    name: str
    rank: int
    scaling: float
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    config: dict  # adapter_config.json as saved

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.pairs.values())


def adapter_base(path: str | Path) -> str:
    """The model folder an adapter folder was trained on (its config's base_model_name_or_path)."""
    cfg_path = Path(path) / "adapter_config.json"
    try:
        base = json.loads(cfg_path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{cfg_path}: {e}") from None
    if not base or not Path(base).is_dir():
        raise AdapterError(f"{cfg_path}: base_model_name_or_path={base!r} is not a model folder here")
    return base


def read_adapter(folder: str | Path, name: str | None = None) -> Adapter:
    """The adapter peft saved in `folder` (its config checked, B scaled)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path = folder / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no adapter_config.json (not a peft adapter folder)") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_path}: not JSON ({e})") from None
    _check_config(cfg, cfg_path)
    rank = int(cfg["r"])
    scaling = cfg["lora_alpha"] / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.exists():
        raise AdapterError(f"{folder}: no adapter_model.safetensors")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(f"{weights_path}: tensor {key!r} is not the lora_A/lora_B of one of {list(TARGETS)}")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    pairs = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_path}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{weights_path}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} "
                               f"do not have rank r={rank}")
        pairs[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    if not pairs:
        raise AdapterError(f"{weights_path}: no LoRA weights")
    return Adapter(name or folder.name, rank, scaling, pairs, cfg)


def _check_config(cfg: dict, path: Path) -> None:
    def refuse(field: str, why: str) -> None:
        raise AdapterError(f"{path}: {field}={cfg.get(field)!r}: {why}")

    if cfg.get("peft_type") != "LORA":
        refuse("peft_type", "only LoRA adapters are served")
    for field in ("r", "lora_alpha"):
        if not isinstance(cfg.get(field), (int, float)) or cfg[field] <= 0:
            refuse(field, "must be a positive number")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        refuse("bias" if cfg.get("bias", "none") != "none" else "lora_bias", "adapters with biases are not served")
    for field in ("use_dora", "fan_in_fan_out"):
        if cfg.get(field):
            refuse(field, "not supported by the engine's LoRA runner")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters"):
        if cfg.get(field):
            refuse(field, "not supported by the engine's LoRA runner (one rank and alpha for the seven "
                          "projections)")


@dataclass(frozen=True)
class Layout:
    """What a decoder's fused projections hold: output sizes per module, the input size of
    each, and the layers; `qkv_order`, where the decoder's kernels emit the fused q/k/v rows in
    another order than the model's: row i of their output is the model's row qkv_order[i]
    (the packed kernels' RoPE pairs), so an adapter's B rows are taken in that order too."""

    layers: int
    out: dict[str, int]  # module -> out features
    inp: dict[str, int]  # module -> in features
    qkv_order: torch.Tensor | None = None  # (out_q + out_k + out_v,) or None: the model's order


def check_fits(adapter: Adapter, layout: Layout) -> None:
    """AdapterError naming the first layer and module whose A or B does not fit the decoder.
    Shapes only: no tensor work (adapters.py checks a folder on the registering thread)."""
    for layer, module in adapter.pairs:
        a, b = adapter.pairs[(layer, module)]
        if layer >= layout.layers or a.shape[1] != layout.inp[module] or b.shape[0] != layout.out[module]:
            raise AdapterError(f"adapter {adapter.name!r}: layer {layer} {module} has A {tuple(a.shape)}, "
                               f"B {tuple(b.shape)}; the model's {module} is {layout.inp[module]} -> "
                               f"{layout.out[module]} in {layout.layers} layers")


class Resident:
    """An adapter laid out for one decoder: `parts[layer][projection]` = (A, B) or None.
    `serial`: unique per Resident made in this process, so what was computed with these weights
    (an engine's cached prefixes) is never taken for a later reading of the same name."""

    _made = itertools.count(1)

    def __init__(self, adapter: Adapter, layout: Layout, dtype: torch.dtype, device: torch.device):
        self.name = adapter.name
        self.serial = next(Resident._made)
        check_fits(adapter, layout)
        self.parts: list[dict[str, tuple[torch.Tensor, torch.Tensor] | None]] = []
        for layer in range(layout.layers):
            parts = {}
            for part, modules in PARTS.items():
                got = [adapter.pairs.get((layer, m)) for m in modules]
                if all(g is None for g in got):
                    parts[part] = None
                    continue
                a = torch.cat([g[0] if g else torch.zeros(0, layout.inp[m]) for g, m in zip(got, modules)])
                b = torch.block_diag(*[g[1] if g else torch.zeros(layout.out[m], 0) for g, m in zip(got, modules)])
                if part == "qkv" and layout.qkv_order is not None:
                    b = b[layout.qkv_order]
                parts[part] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
            self.parts.append(parts)
        self.nbytes = sum(t.numel() * t.element_size() for p in self.parts for ab in p.values() if ab for t in ab)


class RowGroups:
    """Each row's adapter in one forward (None: the base model), ready to add the deltas.

    One adapter for every row: out += (x A^T) B^T. Several, in a decode step (one token a row):
    the tokens are laid out on a grid of n adapters x G slots (G the largest group), adapter
    g's tokens in row g; with the adapters' A's and B's stacked and zero-padded to one rank R,
        delta (n * G, out) = bmm(bmm(x[grid] (n, G, in), A_all (n, in, R)), B_all (n, R, out)),
    and each token takes its own cell: out += delta[cell] (`index_add_` at the adapter rows
    when base rows are mixed in). A token costs its own adapter's arithmetic, not every
    adapter's (S-LoRA's and Punica's gather-matmul-scatter); an empty slot points at token 0
    and its result is never read. The stacks of a set of adapters are built once and kept
    (`_STACKS`), keyed by the set whatever the rows' order: in continuous batching a request
    joins or leaves almost every step. Several in a prefill (many tokens a row, a set seen
    once): per adapter, its tokens' delta is added at their rows (`index_add_`), with no stack
    to build; where an adapter's rows are side by side (a prefill's, decode.py) its tokens are
    one slice, and the delta is added in place on views, with no gather or scatter."""

    def __init__(self, row_adapters: Sequence[Resident | None], tokens_per_row: int, device: torch.device):
        present: dict[int, Resident] = {}
        for adapter in row_adapters:
            if adapter is not None:
                present.setdefault(id(adapter), adapter)
        self.adapters = list(present.values())
        self.single = self.adapters[0] if len(self.adapters) == 1 and all(row_adapters) else None
        self.stack = None
        self.groups: list[tuple[Resident, torch.Tensor | slice]] = []  # prefill: (adapter, its tokens)
        if not self.adapters or self.single is not None:
            return
        if tokens_per_row == 1:
            self.adapters.sort(key=id)  # the stack of a set, whatever the rows' order
            self.stack = _stack(tuple(self.adapters))
            group = {id(a): g for g, a in enumerate(self.adapters)}
            filled = [0] * len(self.adapters)
            cells = []  # token n's cell in the flattened grid, before G is known: (group, slot)
            for adapter in row_adapters:
                if adapter is None:
                    cells.append(None)
                    continue
                g = group[id(adapter)]
                cells.append((g, filled[g]))
                filled[g] += 1
            G = max(filled)
            grid = [0] * (len(self.adapters) * G)  # empty slots: token 0, never read
            for n, cell in enumerate(cells):
                if cell is not None:
                    grid[cell[0] * G + cell[1]] = n
            self.grid = torch.tensor(grid, device=device)  # (n * G,)
            self.slots = G
            self.adapter_rows = None if all(c is not None for c in cells) else \
                torch.tensor([n for n, c in enumerate(cells) if c is not None], device=device)
            self.cell = torch.tensor([c[0] * G + c[1] for c in cells if c is not None], device=device)
            return
        S = tokens_per_row
        for adapter in self.adapters:
            rows = [b for b, a in enumerate(row_adapters) if a is adapter]
            if rows[-1] - rows[0] + 1 == len(rows):  # side by side (decode.py sorts a prefill's prompts so)
                self.groups.append((adapter, slice(rows[0] * S, (rows[-1] + 1) * S)))
                continue
            rows_t = torch.tensor(rows, device=device)
            self.groups.append((adapter, (rows_t[:, None] * S + torch.arange(S, device=device)).reshape(-1)))

    def __bool__(self) -> bool:
        return bool(self.adapters)

    def add(self, layer: int, part: str, x_N_in: torch.Tensor, out_N_out: torch.Tensor) -> None:
        """out += each token's adapter delta (x A^T) B^T, in place."""
        if self.single is not None:
            ab = self.single.parts[layer][part]
            if ab is not None:
                out_N_out.addmm_(x_N_in @ ab[0].T, ab[1].T)
            return
        if self.stack is None:
            for adapter, tokens in self.groups:
                ab = adapter.parts[layer][part]
                if ab is None:
                    continue
                if isinstance(tokens, slice):  # contiguous rows: views, no gather or scatter
                    out_N_out[tokens].addmm_(x_N_in[tokens] @ ab[0].T, ab[1].T)
                else:
                    out_N_out.index_add_(0, tokens, (x_N_in.index_select(0, tokens) @ ab[0].T) @ ab[1].T)
            return
        stacked = self.stack[layer][part]
        if stacked is None:
            return
        a_all, b_all = stacked  # (n, in, R), (n, R, out)
        x = x_N_in.index_select(0, self.grid).view(len(self.adapters), self.slots, -1)  # (n, G, in)
        delta = torch.bmm(torch.bmm(x, a_all), b_all).view(-1, out_N_out.shape[1])  # (n * G, out)
        if self.adapter_rows is None:
            out_N_out.add_(delta.index_select(0, self.cell))
        else:
            out_N_out.index_add_(0, self.adapter_rows, delta.index_select(0, self.cell))


# the stacks of the adapter sets seen last: (A_all (n, in, R), B_all (n, R, out)) per layer and projection
_STACKS: dict[tuple, tuple[tuple, list[dict[str, tuple[torch.Tensor, torch.Tensor] | None]]]] = {}
_STACKS_KEPT = 2  # each holds a copy of its adapters' weights


def _stack(adapters: tuple[Resident, ...]):
    key = tuple(id(a) for a in adapters)
    hit = _STACKS.get(key)
    if hit is not None and all(x is y for x, y in zip(hit[0], adapters)):
        return hit[1]
    layers = []
    for layer in range(len(adapters[0].parts)):
        parts = {}
        for part in PARTS:
            pairs = [a.parts[layer][part] for a in adapters]
            present = [ab for ab in pairs if ab is not None]
            if not present:
                parts[part] = None
                continue
            rank = max(a.shape[0] for a, _ in present)
            inp, out = present[0][0].shape[1], present[0][1].shape[0]
            a_all = present[0][0].new_zeros(len(adapters), inp, rank)
            b_all = present[0][0].new_zeros(len(adapters), rank, out)
            for g, ab in enumerate(pairs):
                if ab is not None:  # an adapter without this projection keeps zeros: no delta
                    a_all[g, :, :ab[0].shape[0]] = ab[0].T
                    b_all[g, :ab[1].shape[1], :] = ab[1].T
            parts[part] = (a_all, b_all)
        layers.append(parts)
    while len(_STACKS) >= _STACKS_KEPT:
        _STACKS.pop(next(iter(_STACKS)))
    _STACKS[key] = (adapters, layers)  # the adapters themselves: an id reused after one is freed never matches
    return layers

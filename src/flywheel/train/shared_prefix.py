"""Logits at loss positions only, computing the tokens that trajectories share once.

A GRPO group's samples share their prompt, and a warm-started policy often repeats itself
beyond it. `plan_batch` picks, by an estimate of the work (tokens through the linear layers
plus query-key pairs through attention), the cheapest of three ways to the same numbers:
`PlainPlan` (one forward over the rows), `SharedPrefixPlan` (each group's common prefix once,
then the rows' suffixes on its KV cache: for long completions) and `PrefixTreePlan` (the rows'
token tries packed under an ancestor mask, every distinct prefix once: for short completions).
The graph is kept throughout, so logprobs and gradients equal the plain forward's up to float
reassociation (tests/unit/test_shared_prefix.py).

Notation: B rows, G groups. Position j of a row predicts token j + 1; a loss position is a j
whose token j + 1 has loss_mask 1; the N loss positions are in row-major order of
`loss_mask[:, 1:]` (`mask_B_T.nonzero()` in train/rl_step.py). A plan computes logits for
Nn <= N nodes and maps each loss position to its node with `src_N`. Shared plans need a
Hugging Face causal LM taking a custom 4-D mask (`supports_shared_prefix`); others get PlainPlan.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from flywheel.train.forward import logits_at


@dataclass
class _Nodes:
    """What every plan holds besides its inputs: `src_N` (N,), the node of each loss position;
    `targets_N` (N,), the token each loss position predicts; `cost`, the plan's work estimate."""

    src_N: torch.Tensor
    targets_N: torch.Tensor
    cost: float


@dataclass
class PlainPlan(_Nodes):
    """One forward over the rows, cut after the last needed input position.

    ids_B_S / attention_mask_B_S: (B, S) inputs, S = 1 + the largest loss position j.
    keep_B_S: (B, S) bool, True at the N loss positions (nodes = loss positions here).
    """

    ids_B_S: torch.Tensor
    attention_mask_B_S: torch.Tensor
    keep_B_S: torch.Tensor

    def logits(self, model) -> torch.Tensor:
        """(Nn, V) logits at the kept positions, row-major."""
        return logits_at(model, self.keep_B_S, input_ids=self.ids_B_S, attention_mask=self.attention_mask_B_S,
                         use_cache=False)


@dataclass
class SharedPrefixPlan(_Nodes):
    """Prefix forward once per group, then the rows' suffixes on the expanded cache: the prefix
    forward gives a KV cache (G', H, P, D), `reorder_cache(group_of_row)` expands it to
    (B, H, P, D), and the suffix forward runs on it with a 4-D mask (B, 1, C, P + C) by which a
    suffix slot sees its group's L_g prefix slots and the suffix slots up to itself. Attention
    work stays per row. L_g is the longest common prefix of the group's ids cut at the first loss
    token of any row (later turns of a multi-turn row are not shared here; PrefixTreePlan shares
    them where the token paths agree). Autograd-safe: DynamicCache grows by torch.cat and
    reorder_cache is an index_select (both out of place); the backward of the expansion sums the
    rows' gradients into the prefix.

    prefix_ids_G_P / prefix_attn_G_P: (G', P) right-padded shared prefixes (G' prefix groups).
    prefix_len_G: (G',) L_g >= 1.  group_of_row_B: (B,) the prefix group of each row.
    suffix_ids_B_C / suffix_pos_B_C: (B, C) right-padded suffix inputs and their position ids
    (L_g + k); C may be 0 (every row's only loss token follows the prefix).
    suffix_keep_B_C: (B, C) bool, True where the slot is a loss position (N_s of them).
    Nodes: cat([last prefix slot of each group (G'), kept suffix slots (N_s)]).
    """

    prefix_ids_G_P: torch.Tensor
    prefix_attn_G_P: torch.Tensor
    prefix_len_G: torch.Tensor
    group_of_row_B: torch.Tensor
    suffix_ids_B_C: torch.Tensor
    suffix_pos_B_C: torch.Tensor
    suffix_keep_B_C: torch.Tensor

    def logits(self, model) -> torch.Tensor:
        """(G' + N_s, V) node logits; gradients flow through the prefix."""
        G, P = self.prefix_ids_G_P.shape
        keep_G_P = torch.zeros(G, P, dtype=torch.bool, device=self.prefix_ids_G_P.device)
        keep_G_P[torch.arange(G, device=keep_G_P.device), self.prefix_len_G - 1] = True
        out = {}
        prefix_G_V = logits_at(model, keep_G_P, out=out, input_ids=self.prefix_ids_G_P,
                               attention_mask=self.prefix_attn_G_P, use_cache=True)
        B, C = self.suffix_ids_B_C.shape
        if C == 0 or not bool(self.suffix_keep_B_C.any()):
            return prefix_G_V
        cache = out["cache"]
        cache.reorder_cache(self.group_of_row_B)  # (G', H, P, D) -> (B, H, P, D), differentiable
        dev = self.suffix_ids_B_C.device
        sees_prefix_B_P = torch.arange(P, device=dev)[None, :] < self.prefix_len_G[self.group_of_row_B][:, None]
        causal_C_C = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
        allowed = torch.cat([sees_prefix_B_P[:, None, None, :].expand(B, 1, C, P),
                             causal_C_C[None, None].expand(B, 1, C, C)], dim=-1)  # (B, 1, C, P + C)
        suffix_Ns_V = logits_at(model, self.suffix_keep_B_C, input_ids=self.suffix_ids_B_C,
                                attention_mask=attention_mask_4d(allowed, model), position_ids=self.suffix_pos_B_C,
                                use_cache=True, **{_cache_kwarg(model): cache})
        return torch.cat([prefix_G_V, suffix_Ns_V])


@dataclass
class PrefixTreePlan(_Nodes):
    """Token tries packed one per row: R rows of K nodes (right-padded), one trie per bin of
    groups. A node attends to its ancestors only, at position id = its depth, so every distinct
    prefix is computed once, duplicates included, in one forward; attention is dense over K, so
    bins are capped (`max_row_tokens`). The node gathers are indexing ops whose backward
    accumulates.

    ids_R_K / pos_R_K: (R, K) node tokens and position ids (= depth; 0 on padding).
    allowed_R_K_K: (R, K, K) bool, node k sees node i iff i is k or one of its ancestors;
    a padding slot sees only itself.
    keep_R_K: (R, K) bool, True on nodes that are some row's loss position (Nn of them).
    """

    ids_R_K: torch.Tensor
    pos_R_K: torch.Tensor
    allowed_R_K_K: torch.Tensor
    keep_R_K: torch.Tensor

    def logits(self, model) -> torch.Tensor:
        """(Nn, V) logits of the kept nodes, row-major."""
        return logits_at(model, self.keep_R_K, input_ids=self.ids_R_K, position_ids=self.pos_R_K,
                         attention_mask=attention_mask_4d(self.allowed_R_K_K[:, None], model), use_cache=False)


Plan = PlainPlan | SharedPrefixPlan | PrefixTreePlan


def attention_mask_4d(allowed: torch.Tensor, model) -> torch.Tensor:
    """A (B, 1, Q, K) "may attend" mask in the form the model's attention takes: bool for
    sdpa, additive (0 / dtype min) for eager."""
    if model.config._attn_implementation == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _unwrapped(model):
    """The Hugging Face model under a peft wrapper (whose forward passes keyword arguments
    through to it), else the model itself: what the checks below read."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports_shared_prefix(model) -> bool:
    """A causal LM whose attention takes a custom 4-D mask ("sdpa" or "eager") and explicit
    position ids, with full-attention layers only (a peft-wrapped one: its base's)."""
    model = _unwrapped(model)
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "is_encoder_decoder", False):
        return False
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return False
    return "position_ids" in inspect.signature(model.forward).parameters


def plan_kinds(model) -> tuple[str, ...]:
    """The sharing plans `model` can run: none, the prefix tree, and the KV-cache prefix plan
    where the model returns a cache we can expand (not under gradient checkpointing, which
    turns the cache off)."""
    if not supports_shared_prefix(model):
        return ()
    inner = _unwrapped(model)
    checkpointing = (inner.is_activation_checkpointing if hasattr(type(inner), "is_activation_checkpointing")
                     else getattr(inner, "is_gradient_checkpointing", False))  # transformers 5 renamed it
    if checkpointing or _cache_kwarg(model) is None:
        return ("tree",)
    return ("tree", "prefix")


def attention_cost(model) -> float:
    """Work of one query-key pair relative to one token through the linear layers: 4h flops per
    pair against ~32h^2 per token for a 4x MLP, so 1 / (8h)."""
    hidden = getattr(getattr(_unwrapped(model), "config", None), "hidden_size", None) or 256
    return 1.0 / (8.0 * hidden)


def _cache_kwarg(model) -> str | None:
    """transformers 5 names the cache argument `cache`; 4.x called it `past_key_values`."""
    params = inspect.signature(_unwrapped(model).forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


# ---------------------------------------------------------------------------------- planning

def plan_batch(ids: list[list[int]], loss_mask: list[list[int]], groups: list[list[int]], pad_id: int,
               device, share: bool = True, attn_cost: float = 1.0 / 2048, min_saving: float = 0.1,
               max_row_tokens: int | None = None, kinds: tuple[str, ...] = ("tree", "prefix")) -> Plan:
    """Plan the logits of one batch. ids / loss_mask: one list per row (B rows); groups: row
    indices per group (a partition of range(B); rows are only shared within a group for the
    prefix plan, within a bin of whole groups for the tree plan). Returns the cheapest plan
    of `kinds` if `share` and it saves at least `min_saving` of the plain plan's work,
    else the plain plan. attn_cost: `attention_cost(model)`."""
    B = len(ids)
    last = [max((t for t in range(1, len(m)) if m[t]), default=0) for m in loss_mask]  # 0: no loss token
    pos = [(b, t - 1) for b in range(B) for t in range(1, len(ids[b])) if loss_mask[b][t]]
    targets = torch.tensor([ids[b][j + 1] for b, j in pos], dtype=torch.long, device=device)
    S = max((j for _, j in pos), default=0) + 1
    plain_cost = B * S + B * S * S * attn_cost
    best = (plain_cost, None)
    if share and pos:
        if max_row_tokens is None:
            max_row_tokens = max(64, int(0.25 / attn_cost))  # attention <= 1/4 of the linear work
        for kind in kinds:
            plan = {"tree": _tree_plan, "prefix": _prefix_plan}[kind](
                ids, loss_mask, last, pos, groups, attn_cost, max_row_tokens)
            if plan is not None and plan[0] <= (1.0 - min_saving) * plain_cost and plan[0] < best[0]:
                best = plan
    if best[1] is None:
        return _plain_plan(ids, pos, targets, S, pad_id, device, plain_cost)
    return best[1](targets, pad_id, device)


def _plain_plan(ids, pos, targets, S, pad_id, device, cost) -> PlainPlan:
    B = len(ids)
    rows = [r[:S] for r in ids]
    ids_B_S = torch.tensor([r + [pad_id] * (S - len(r)) for r in rows], dtype=torch.long).reshape(B, S)
    attn = torch.tensor([[1] * len(r) + [0] * (S - len(r)) for r in rows], dtype=torch.long).reshape(B, S)
    keep = torch.zeros(B, S, dtype=torch.bool)
    if pos:
        b, j = zip(*pos)
        keep[list(b), list(j)] = True
    return PlainPlan(ids_B_S=ids_B_S.to(device), attention_mask_B_S=attn.to(device), keep_B_S=keep.to(device),
                     src_N=torch.arange(len(pos), device=device), targets_N=targets, cost=cost)


def _common_prefix(rows: list[list[int]], limit: int) -> int:
    n = 0
    while n < limit and all(len(r) > n and r[n] == rows[0][n] for r in rows):
        n += 1
    return n


def _prefix_plan(ids, loss_mask, last, pos, groups, attn_cost, max_row_tokens):
    """(cost, build(targets, pad_id, device) -> SharedPrefixPlan), or None."""
    B = len(ids)
    first = [next((t for t in range(1, len(m)) if m[t]), len(m)) for m in loss_mask]
    pgroups: list[tuple[list[int], int]] = []  # (rows, L >= 1)
    for rows in groups:
        L = _common_prefix([ids[b] for b in rows], min(first[b] for b in rows))
        if L >= 1:
            pgroups.append((rows, L))
        else:  # the rows differ from the first token on: each row is its own prefix
            pgroups += [([b], first[b]) for b in rows if first[b] >= 1]
    group_of_row, length_of_row = [-1] * B, [0] * B
    for g, (rows, L) in enumerate(pgroups):
        for b in rows:
            group_of_row[b], length_of_row[b] = g, L
    if any(g < 0 for g in group_of_row):
        return None
    G, P = len(pgroups), max(L for _, L in pgroups)
    # suffix of row b: its inputs L .. last - 1 (none if it has no loss token after the prefix)
    suffix = [ids[b][length_of_row[b]:last[b]] for b in range(B)]
    C = max(len(s) for s in suffix)
    cost = G * P + G * P * P * attn_cost + B * C + B * C * (P + C) * attn_cost

    def build(targets, pad_id, device) -> SharedPrefixPlan:
        prefix_ids = torch.full((G, P), pad_id, dtype=torch.long)
        prefix_attn = torch.zeros(G, P, dtype=torch.long)
        for g, (rows, L) in enumerate(pgroups):
            prefix_ids[g, :L] = torch.tensor(ids[rows[0]][:L])
            prefix_attn[g, :L] = 1
        suffix_ids = torch.tensor([s + [pad_id] * (C - len(s)) for s in suffix], dtype=torch.long).reshape(B, C)
        suffix_pos = torch.tensor(length_of_row)[:, None] + torch.arange(C)[None, :]
        suffix_keep = torch.zeros(B, C, dtype=torch.bool)
        for b, j in pos:
            if j >= length_of_row[b]:
                suffix_keep[b, j - length_of_row[b]] = True
        slot = torch.full((B, C), -1, dtype=torch.long)  # node index of each kept suffix slot
        slot[suffix_keep] = torch.arange(int(suffix_keep.sum())) + G
        src = [group_of_row[b] if j == length_of_row[b] - 1 else int(slot[b, j - length_of_row[b]]) for b, j in pos]
        return SharedPrefixPlan(
            prefix_ids_G_P=prefix_ids.to(device), prefix_attn_G_P=prefix_attn.to(device),
            prefix_len_G=torch.tensor([L for _, L in pgroups], device=device),
            group_of_row_B=torch.tensor(group_of_row, device=device),
            suffix_ids_B_C=suffix_ids.to(device), suffix_pos_B_C=suffix_pos.to(device),
            suffix_keep_B_C=suffix_keep.to(device), src_N=torch.tensor(src, dtype=torch.long, device=device),
            targets_N=targets, cost=cost)
    return cost, build


def _tree_plan(ids, loss_mask, last, pos, groups, attn_cost, max_row_tokens):
    """(cost, build(targets, pad_id, device) -> PrefixTreePlan), or None."""
    # bins of whole groups, each one trie: node = (parent node, token), inputs 0 .. last - 1
    bins: list[dict] = []
    node_of_row: dict[int, list[int]] = {}  # row -> its path of nodes (bin-local indices)
    bin_of_row: dict[int, int] = {}

    def new_bin() -> dict:
        return {"index": {}, "token": [], "depth": [], "parent": []}

    cur = new_bin()
    for rows in groups:
        trial = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in cur.items()}
        paths = {b: _insert(trial, ids[b][:last[b]]) for b in rows}
        if len(trial["token"]) > max_row_tokens and cur["token"]:
            bins.append(cur)
            cur = new_bin()
            paths = {b: _insert(cur, ids[b][:last[b]]) for b in rows}
        else:
            cur = trial
        for b in rows:
            node_of_row[b], bin_of_row[b] = paths[b], len(bins)
    bins.append(cur)
    R, K = len(bins), max(len(bn["token"]) for bn in bins)
    if K == 0:
        return None
    cost = R * K + R * K * K * attn_cost

    def build(targets, pad_id, device) -> PrefixTreePlan:
        tok = torch.full((R, K), pad_id, dtype=torch.long)
        depth = torch.zeros(R, K, dtype=torch.long)
        # a node sees itself (padding slots too: finite garbage) and what its parent sees;
        # filled level by level, so one tensor op per depth instead of a loop over pairs
        allowed = torch.eye(K, dtype=torch.bool).repeat(R, 1, 1)
        for r, bn in enumerate(bins):
            n = len(bn["token"])
            tok[r, :n] = torch.tensor(bn["token"], dtype=torch.long)
            depth[r, :n] = torch.tensor(bn["depth"], dtype=torch.long)
            parent = torch.tensor(bn["parent"], dtype=torch.long)
            order = torch.argsort(depth[r, :n], stable=True)
            per_level = torch.bincount(depth[r, :n]).tolist()
            start = per_level[0]
            for count in per_level[1:]:
                nodes = order[start:start + count]
                allowed[r, nodes] |= allowed[r, parent[nodes]]
                start += count
        flat = [bin_of_row[b] * K + node_of_row[b][j] for b, j in pos]  # node of each loss position
        keep = torch.zeros(R * K, dtype=torch.bool)
        keep[flat] = True
        rank = torch.cumsum(keep.long(), 0) - 1  # row-major index among kept nodes
        src = rank[torch.tensor(flat, dtype=torch.long)]
        return PrefixTreePlan(ids_R_K=tok.to(device), pos_R_K=depth.to(device), allowed_R_K_K=allowed.to(device),
                              keep_R_K=keep.reshape(R, K).to(device), src_N=src.to(device), targets_N=targets,
                              cost=cost)
    return cost, build


def _insert(trie: dict, tokens: list[int]) -> list[int]:
    """Add a token path to a trie (index: (parent, token) -> node); returns its nodes."""
    path, parent = [], -1
    for d, t in enumerate(tokens):
        node = trie["index"].get((parent, t))
        if node is None:
            node = len(trie["token"])
            trie["index"][(parent, t)] = node
            trie["token"].append(t)
            trie["depth"].append(d)
            trie["parent"].append(parent)
        path.append(node)
        parent = node
    return path


SFT_MIN_SAVING = 0.5  # SFT shares only where it halves the work (see shared_nll_sum)


def shared_nll_sum(model, ids: list[list[int]], loss_mask: list[list[int]], pad_id: int, device
                   ) -> tuple[torch.Tensor, int] | None:
    """(sum over the rows' loss positions of -log p(target), N): SFT's loss numerator with the
    rows' common prefixes computed once (`plan_batch` with every row in one group: a system
    prompt and tool schemas that every row repeats are run once, not per row). Equal to the
    plain forward's sum up to float reassociation. None where sharing saves less than
    SFT_MIN_SAVING of the work: the caller runs its plain loss, so short rows that share a few
    tokens (the tiny models' arithmetic) train exactly as before, and no reassociation moves
    an abrupt learner's trajectory for a small gain."""
    plan = plan_batch(ids, loss_mask, [list(range(len(ids)))], pad_id, device, attn_cost=attention_cost(model),
                      min_saving=SFT_MIN_SAVING, kinds=plan_kinds(model))
    if isinstance(plan, PlainPlan):
        return None
    logits_Nn_V = plan.logits(model).float()
    logz_Nn = torch.logsumexp(logits_Nn_V, -1)
    nll_N = logz_Nn[plan.src_N] - logits_Nn_V[plan.src_N, plan.targets_N]
    return nll_N.sum(), int(plan.targets_N.numel())

"""A lean plain-torch forward for the common decoder family (Llama, Mistral, Qwen2, Qwen3).

Hugging Face's forward is general; on small batches its per-layer Python and mask
building cost as much as the matmuls. This runner reuses the model's own parameters and
does only what a pre-norm RoPE decoder needs: fused QKV and gate/up projections (kernels.py),
RoPE from the model's own `rotary_emb` (so every RoPE variant it was configured with
applies), one preallocated KV tensor for all layers, and `scaled_dot_product_attention`.

Fusion without copies: q/k/v (and gate/up) weights are moved into one contiguous tensor
and the HF parameters become views of it, so memory does not grow and a weight update
written into the HF parameters is seen by the dense kernels at once (packed kernels are
rebuilt by `refresh()`). Parameters pointed at tensors that already lie back to back (a
shared-memory segment laid out by `fusion_groups`) are fused as views of those: dense
kernels then run on the shared buffer itself. The engine owns its model.

THREADS: the kernels are built by the first forward, not by the constructor, so that the thread
that runs the forwards (a server's scheduler thread, say) is the one that builds them: a process
keeps its parallel torch work on one thread (flywheel/threads.py says why;
bench/openmp_teams.py measures it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flywheel.inference.kernels import dense_kernels, fuse, packed_available, packed_kernels, packed_qkv_order
from flywheel.inference.lora import Layout, RowGroups

SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
# A oneDNN call has a fixed cost over F.linear whatever its size, so below this hidden size the
# packed kernels lose to the dense ones (docs/benchmarks.md, "Measurements behind choices in
# the code").
PACKED_MIN_HIDDEN = 256


def unsupported_reason(model) -> str | None:
    """None if the lean forward can run `model`, else why not (the engine falls back to HF)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {sorted(SUPPORTED_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "dynamic":  # inv_freq would change with sequence length
        return "dynamic RoPE scaling"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "unexpected module layout"
    return None


def fusion_groups(model) -> list[list[str]]:
    """Names of the parameters the lean decoder fuses, per fused tensor in order (q/k/v
    weights, their biases, gate/up weights, their biases): a weight segment that lays each
    group out back to back (SharedMemoryTransport.create(adjacent=...)) can be fused without a
    copy."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for layer in model.model.layers:
        for linears in ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                        [layer.mlp.gate_proj, layer.mlp.up_proj]):
            groups.append([names[id(m.weight)] for m in linears])
            if all(m.bias is not None for m in linears):
                groups.append([names[id(m.bias)] for m in linears])
    return groups


class KVCache:
    """Keys and values of every layer in one tensor (layers, 2, B, KV_heads, capacity, head_dim),
    so dropping or repeating rows is a single copy; `length` columns are filled."""

    def __init__(self, kv: torch.Tensor, length: int = 0):
        self.kv, self.length = kv, length

    @property
    def batch(self) -> int:
        return self.kv.shape[2]

    def select(self, rows: torch.Tensor) -> "KVCache":
        """Keep (or repeat) rows, in the order given."""
        return KVCache(self.kv.index_select(2, rows), self.length)


class SharedPrefix:
    """Keys and values of L tokens that every row of a prefill continues, computed before (a
    system prompt, tool schemas). One 1-row cache per owner of keys and values, the base model
    or a LoRA adapter (an adapter's deltas change them); row b continues `caches[rows_B[b]]`
    (rows_B None: every row the one cache). A cache may hold more than L columns: keys and
    values of a position depend on the tokens up to it only, so its first L are the prefix's."""

    def __init__(self, caches: list[KVCache], length: int, rows_B: torch.Tensor | None = None):
        if rows_B is None and len(caches) != 1:
            raise ValueError(f"{len(caches)} prefix caches need rows_B, each row's cache")
        if any(c.length < length for c in caches):
            raise ValueError(f"a prefix of {length} tokens from caches of {min(c.length for c in caches)}")
        self.caches, self.length, self.rows_B = caches, length, rows_B

    def keys_values(self, layer: int, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of the prefix for B rows at `layer`: each (B, KV heads, L, head dim)."""
        L = self.length
        if self.rows_B is None:
            kv = self.caches[0].kv[layer, :, :1, :, :L]  # (2, 1, KV, L, D)
            return kv[0].expand(B, -1, -1, -1), kv[1].expand(B, -1, -1, -1)
        kv = torch.cat([c.kv[layer, :, :1, :, :L] for c in self.caches], 1).index_select(1, self.rows_B)
        return kv[0], kv[1]


class LeanDecoder:
    def __init__(self, model, packed: bool | None = None):
        """packed: oneDNN kernels on pre-packed weights (CPU fp32 only; None = when available
        and hidden_size >= PACKED_MIN_HIDDEN), see kernels.py. They are copies, rebuilt by
        `refresh()` after the weights change."""
        cfg = model.config
        inner = model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.float()  # (D/2,)
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self._rope_table: torch.Tensor | None = None  # (positions, D/2) angles
        if packed is None:
            packed = packed_available(self.embed) and cfg.hidden_size >= PACKED_MIN_HIDDEN
        self.packed = packed
        if self.packed and not packed_available(self.embed):
            raise ValueError("packed kernels need a CPU fp32 model and oneDNN")
        self._inner = inner
        self._modules = []  # per layer, the modules whose parameters the kernels read (looked up once)
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            self._modules.append((
                dict(qkv=[att.q_proj, att.k_proj, att.v_proj], o=att.o_proj,
                     **{k: getattr(att, k) for k in ("q_norm", "k_norm") if getattr(att, k, None) is not None}),
                dict(gate_up=[mlp.gate_proj, mlp.up_proj], down=mlp.down_proj), layer))
        self._final_norm = inner.norm.weight
        self._lm_head = (model.lm_head.weight, getattr(model.lm_head, "bias", None))
        self._scratch: dict = {}  # packed: reused buffers of the norm-folded weights
        self.sliding_window = getattr(cfg, "sliding_window", None) if (
            getattr(cfg, "use_sliding_window", True) and cfg.model_type != "qwen3") else None
        # the kernels: built by the first forward, on the thread that runs the forwards (see
        # THREADS in the module docstring), then by `refresh()` after each weight change
        self.layers: list[dict] | None = None
        self.top: dict | None = None
        self._refresh_failed = False

    def _collect(self) -> list[dict]:
        """Per layer: the HF parameters (or views of the fused tensors) the kernels read."""
        weights = []
        for att, mlp, layer in self._modules:
            q_norm, k_norm = att.get("q_norm"), att.get("k_norm")
            weights.append(dict(
                qkv=fuse(att["qkv"]), o=(att["o"].weight, att["o"].bias),
                gate_up=fuse(mlp["gate_up"]), down=(mlp["down"].weight, mlp["down"].bias),
                ln_in=layer.input_layernorm.weight, ln_post=layer.post_attention_layernorm.weight,
                q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
                ffn=mlp["gate_up"][0].out_features))
        return weights

    def refresh(self) -> None:
        """(Re)build the kernels from the model's current parameters: after their values change
        (packed kernels are copies) or after they were pointed at other tensors (a zero-copy
        pickup: dense kernels then read those, packed ones are reordered straight from them).
        If it raises there are no kernels left (forward refuses): never a mix of old and new
        weights. Callers hold the engine's update lock, so no forward runs meanwhile."""
        try:  # the old packed copies stay until the new ones exist: freeing them first made the
            # allocator hand pages back and fault them in again (docs/benchmarks.md)
            weights = self._collect()
            if self.packed:
                kernels = packed_kernels(weights, self._final_norm, self._lm_head, self.eps,
                                         self.n_heads, self.n_kv, self.head_dim, self._scratch)
            else:
                kernels = dense_kernels(weights, self._final_norm, self._lm_head, self.eps)
        except BaseException:
            self.layers = self.top = None
            self._refresh_failed = True
            raise
        self.layers, self.top = kernels
        self._refresh_failed = False

    def layout(self) -> Layout:
        """The projections' sizes, what a LoRA adapter is laid out for (inference/lora.py)."""
        att, mlp, _ = self._modules[0]
        mods = dict(zip(("q_proj", "k_proj", "v_proj"), att["qkv"]), o_proj=att["o"],
                    **dict(zip(("gate_proj", "up_proj"), mlp["gate_up"])), down_proj=mlp["down"])
        order = packed_qkv_order(self.n_heads, self.n_kv, self.head_dim) if self.packed else None
        return Layout(len(self._modules), {k: m.out_features for k, m in mods.items()},
                      {k: m.in_features for k, m in mods.items()}, qkv_order=order)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        shape = (len(self._inner.layers), 2, batch, self.n_kv, capacity, self.head_dim)
        return KVCache(torch.empty(shape, dtype=self.embed.dtype, device=self.embed.device))

    def _angles(self, positions_B_S: torch.Tensor) -> torch.Tensor:
        """RoPE angles (B, S, D/2) for the positions, from a table grown on demand."""
        need = int(positions_B_S.max()) + 1
        if self._rope_table is None or self._rope_table.shape[0] < need:
            size = max(need, 256 if self._rope_table is None else 2 * self._rope_table.shape[0])
            t = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            self._rope_table = torch.outer(t, self.inv_freq)
        return self._rope_table[positions_B_S]

    def _rotation(self, positions_B_S: torch.Tensor):
        """What `_rope` multiplies by, computed once per forward: (B, S, 1, D/2) complex for
        interleaved kernels, else (cos, sin) of shape (B, 1, S, D) in HF's rotate-half layout."""
        angles = self._angles(positions_B_S)  # (B, S, D/2)
        if self.top["interleaved"]:
            return torch.polar(torch.full_like(angles, self.rope_scale), angles)[:, :, None]
        emb = torch.cat([angles, angles], -1)[:, None]
        dt = self.embed.dtype
        return (emb.cos() * self.rope_scale).to(dt), (emb.sin() * self.rope_scale).to(dt)

    def _rope(self, qk_N_hD: torch.Tensor, rotation, B: int, S: int) -> torch.Tensor:
        """Rotate queries and keys, (N, heads * D) -> (B, heads, S, D)."""
        D = self.head_dim
        heads = qk_N_hD.shape[-1] // D
        if self.top["interleaved"]:  # RoPE pairs adjacent: one complex multiply
            pairs = torch.view_as_complex(qk_N_hD.view(B, S, heads, D // 2, 2))
            return torch.view_as_real(pairs * rotation).view(B, S, heads, D).transpose(1, 2)
        cos, sin = rotation
        qk = qk_N_hD.view(B, S, heads, D).transpose(1, 2)
        half = D // 2
        return qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], -1) * sin

    @torch.inference_mode()
    def forward(self, tokens_B_S: torch.Tensor, positions_B_S: torch.Tensor, cache: KVCache,
                key_valid_B_T: torch.Tensor | None, causal: bool,
                cache_rows: torch.Tensor | None = None, lora: RowGroups | None = None,
                prefix: SharedPrefix | None = None, layout_B_T: torch.Tensor | None = None) -> torch.Tensor:
        """Run S new tokens per row, writing their keys/values at cache columns
        [cache.length, cache.length + S). Returns the last position's logits (B, V).

        key_valid_B_T (T = cache.length + S): False for padding columns; None if none.
        causal: apply a causal mask among the S new tokens (prefill).
        cache_rows (R,): prefill fan-out into an empty cache of R rows; cache row r gets the
          keys/values of batch row cache_rows[r] (n samples of a prompt share one prefill).
        prefix, layout_B_T (with cache_rows): every batch row continues the same L tokens,
          whose keys/values `prefix` holds (SharedPrefix: computed once for the base and for
          each adapter among the rows: a system prompt and tool schemas all prompts repeat),
          the rows' own adapters (`lora`) applied to their new tokens. The S new tokens attend to
          [prefix, new] (T = L + S, key_valid_B_T over those columns), and cache row r gets
          L + S columns: column j of batch row b holds source column layout_B_T[b, j] of
          [prefix, new], so a row's left padding can move ahead of its prefix.
        lora: the LoRA adapter of each row (inference/lora.py), unmerged, on either kernel set.
        """
        if self.layers is None:
            if self._refresh_failed:
                raise RuntimeError("the decoder has no kernels: rebuilding them after a weight change failed")
            with torch.inference_mode(False):  # the fused weights stay ordinary tensors, writable by updates
                self.refresh()
        B, S = tokens_B_S.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        if cache_rows is not None and cache.length != 0:
            raise ValueError("cache_rows is only for a prefill into an empty cache")
        if prefix is not None and (cache_rows is None or layout_B_T is None):
            raise ValueError("a shared prefix is for a fanned-out prefill (cache_rows, layout_B_T)")
        shared = prefix.length if prefix is not None else 0
        c0, c1 = cache.length + shared, cache.length + shared + S
        mask = None
        if key_valid_B_T is not None or (causal and S > 1 and c0 > 0):
            mask = self._mask(key_valid_B_T, B, S, c0, c1, causal)
            is_causal = False
        else:
            is_causal = causal and S > 1
        lora = lora or None
        rotation = self._rotation(positions_B_S)
        x = F.embedding(tokens_B_S.reshape(B * S), self.embed)  # (N, hidden), N = B S
        for li, L in enumerate(self.layers):
            h = L["norm_attn"](x)
            qkv = L["qkv"](h)  # (N, (H + 2 KV) D)
            if lora is not None:
                lora.add(li, "qkv", L["lora_in_attn"](h), qkv)
            qk = qkv[:, :(H + KV) * D]
            if L["q_norm"] is not None:  # Qwen3: RMSNorm per head before RoPE
                qk = qk.view(B * S, H + KV, D)
                qk = torch.cat([F.rms_norm(qk[:, :H], (D,), L["q_norm"], self.eps),
                                F.rms_norm(qk[:, H:], (D,), L["k_norm"], self.eps)], 1).view(B * S, -1)
            qk = self._rope(qk, rotation, B, S)  # (B, H + KV, S, D)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + KV) * D:].view(B, S, KV, D).transpose(1, 2)  # (B, KV, S, D)
            if cache_rows is None:
                cache.kv[li, 0, :, :, c0:c1] = k
                cache.kv[li, 1, :, :, c0:c1] = v
                k, v = cache.kv[li, 0, :, :, :c1], cache.kv[li, 1, :, :, :c1]
            elif prefix is None:  # attend within the prompt, store fanned out
                cache.kv[li, 0, :, :, :c1] = k.index_select(0, cache_rows)
                cache.kv[li, 1, :, :, :c1] = v.index_select(0, cache_rows)
            else:  # attend to [prefix, prompt], store each row's columns in its layout, fanned out
                k_prefix, v_prefix = prefix.keys_values(li, B)
                k = torch.cat([k_prefix, k], 2)  # (B, KV, L + S, D)
                v = torch.cat([v_prefix, v], 2)
                where = layout_B_T[:, None, :, None].expand(B, KV, c1, D)
                cache.kv[li, 0, :, :, :c1] = k.gather(2, where).index_select(0, cache_rows)
                cache.kv[li, 1, :, :, :c1] = v.gather(2, where).index_select(0, cache_rows)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                 enable_gqa=KV != H)  # (B, H, S, D)
            att = att.transpose(1, 2).reshape(B * S, H * D)
            x = L["o_residual"](att, x)  # x + att W_o^T
            if lora is None:
                x = L["down_residual"](L["swiglu"](L["norm_mlp"](x)), x)
                continue
            lora.add(li, "o", att, x)
            h = L["norm_mlp"](x)
            h_in = L["lora_in_mlp"](h)
            gate, up = L["gate"](h), L["up"](h)  # (N, F) each: the deltas added in place, no concatenation
            lora.add(li, "gate", h_in, gate)
            lora.add(li, "up", h_in, up)
            m = F.silu(gate, inplace=True).mul_(up)
            x = L["down_residual"](m, x)
            lora.add(li, "down", m, x)
        cache.length = c1
        last = x.view(B, S, -1)[:, -1]
        return self.top["lm_head"](self.top["norm_final"](last)).float()

    def _mask(self, key_valid_B_T, B, S, c0, c1, causal) -> torch.Tensor:
        """Boolean (B, 1, S, T) mask: True = attend. A query always sees its own column, so
        no row is fully masked (fully masked rows would give NaN, and 0 * NaN leaks)."""
        dev = self.embed.device
        cols = torch.arange(c1, device=dev)
        rows = torch.arange(c0, c1, device=dev)
        allowed = cols[None, :] <= rows[:, None] if causal else torch.ones(S, c1, dtype=torch.bool, device=dev)
        allowed = allowed[None].expand(B, S, c1)
        if key_valid_B_T is not None:
            allowed = allowed & key_valid_B_T[:, None, :]
        allowed = allowed | (cols[None, None, :] == rows[None, :, None])
        if self.sliding_window is not None and c1 > self.sliding_window:
            allowed = allowed & (cols[None, None, :] > rows[None, :, None] - self.sliding_window)
        return allowed[:, None]

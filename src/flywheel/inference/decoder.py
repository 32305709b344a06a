"""A lean plain-torch forward for the common decoder family (Llama, Mistral, Qwen2, Qwen3).

Hugging Face's forward is general; on small batches its per-layer Python and mask
building cost as much as the matmuls. This runner reuses the model's own parameters and
does only what a pre-norm RoPE decoder needs: fused QKV and gate/up projections, RoPE from
the model's own `rotary_emb` (so every RoPE variant it was configured with applies), a
preallocated KV cache, and `scaled_dot_product_attention`.

Fusion without copies: q/k/v (and gate/up) weights are moved into one contiguous tensor
and the HF parameters become views of it, so memory does not grow and a weight update
written into the HF parameters is seen here at once. The engine owns its model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


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


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dim; make each
    module's parameter a view of the fused tensor. Returns (weight, bias or None)."""
    weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
    has_bias = [m.bias is not None for m in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([m.bias.detach() if m.bias is not None else
                          torch.zeros(m.out_features, dtype=weight.dtype, device=weight.device)
                          for m in linears]).contiguous()
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight.data = weight[start:end]
        if m.bias is not None:
            m.bias.data = bias[start:end]
        start = end
    return weight, bias


class KVCache:
    """Per-layer key/value tensors (B, KV_heads, capacity, head_dim); `length` columns used."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v, self.length = k, v, 0

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def select(self, rows: torch.Tensor) -> "KVCache":
        """Keep (or repeat) rows, in the order given."""
        out = KVCache([k.index_select(0, rows) for k in self.k], [v.index_select(0, rows) for v in self.v])
        out.length = self.length
        return out


class LeanDecoder:
    def __init__(self, model):
        cfg = model.config
        self.model = model
        inner = model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.float()  # (D/2,)
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self._rope_cos = self._rope_sin = None
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            w_qkv, b_qkv = _fuse([att.q_proj, att.k_proj, att.v_proj])
            w_gu, b_gu = _fuse([mlp.gate_proj, mlp.up_proj])
            q_norm = getattr(att, "q_norm", None)
            k_norm = getattr(att, "k_norm", None)
            self.layers.append(dict(
                ln_in=layer.input_layernorm.weight, w_qkv=w_qkv, b_qkv=b_qkv,
                w_o=att.o_proj.weight, b_o=att.o_proj.bias,
                q_norm=None if q_norm is None else q_norm.weight,
                k_norm=None if k_norm is None else k_norm.weight,
                ln_post=layer.post_attention_layernorm.weight, w_gu=w_gu, b_gu=b_gu,
                w_down=mlp.down_proj.weight, b_down=mlp.down_proj.bias,
                ffn=mlp.gate_proj.out_features,
            ))
        self.sliding_window = getattr(cfg, "sliding_window", None) if (
            getattr(cfg, "use_sliding_window", True) and cfg.model_type != "qwen3") else None

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        shape = (batch, self.n_kv, capacity, self.head_dim)
        dt, dev = self.embed.dtype, self.embed.device
        return KVCache([torch.empty(shape, dtype=dt, device=dev) for _ in self.layers],
                       [torch.empty(shape, dtype=dt, device=dev) for _ in self.layers])

    def _rope(self, positions_B_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (B, 1, S, D), HF's rotate-half layout."""
        need = int(positions_B_S.max()) + 1
        if self._rope_cos is None or self._rope_cos.shape[0] < need:
            size = max(need, 256 if self._rope_cos is None else 2 * self._rope_cos.shape[0])
            t = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            self._rope_cos = (emb.cos() * self.rope_scale).to(self.embed.dtype)
            self._rope_sin = (emb.sin() * self.rope_scale).to(self.embed.dtype)
        return self._rope_cos[positions_B_S][:, None], self._rope_sin[positions_B_S][:, None]

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    @torch.inference_mode()
    def forward(self, tokens_B_S: torch.Tensor, positions_B_S: torch.Tensor, cache: KVCache,
                key_valid_B_T: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """Run S new tokens per row, writing their keys/values at cache columns
        [cache.length, cache.length + S). Returns the last position's logits (B, V).

        key_valid_B_T (T = cache.length + S): False for padding columns; None if none.
        causal: apply a causal mask among the S new tokens (prefill).
        """
        B, S = tokens_B_S.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        c0, c1 = cache.length, cache.length + S
        mask = None
        if key_valid_B_T is not None or (causal and S > 1 and c0 > 0):
            mask = self._mask(key_valid_B_T, B, S, c0, c1, causal)
            is_causal = False
        else:
            is_causal = causal and S > 1
        cos, sin = self._rope(positions_B_S)
        x = F.embedding(tokens_B_S, self.embed)  # (B, S, hidden)
        for li, L in enumerate(self.layers):
            h = self._rms(x, L["ln_in"])
            qkv = F.linear(h, L["w_qkv"], L["b_qkv"])  # (B, S, (H + 2 KV) D)
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            q = q.view(B, S, H, D)
            k = k.view(B, S, KV, D)
            if L["q_norm"] is not None:
                q, k = self._rms(q, L["q_norm"]), self._rms(k, L["k_norm"])
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, S, KV, D).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin  # (B, H, S, D)
            k = k * cos + _rotate_half(k) * sin
            cache.k[li][:, :, c0:c1] = k
            cache.v[li][:, :, c0:c1] = v
            att = F.scaled_dot_product_attention(
                q, cache.k[li][:, :, :c1], cache.v[li][:, :, :c1], attn_mask=mask,
                is_causal=is_causal, enable_gqa=KV != H)  # (B, H, S, D)
            x = x + F.linear(att.transpose(1, 2).reshape(B, S, H * D), L["w_o"], L["b_o"])
            h = self._rms(x, L["ln_post"])
            gate, up = F.linear(h, L["w_gu"], L["b_gu"]).split(L["ffn"], dim=-1)
            x = x + F.linear(F.silu(gate) * up, L["w_down"], L["b_down"])
        cache.length = c1
        last = self._rms(x[:, -1], self.final_norm)
        return F.linear(last, self.lm_head).float()

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

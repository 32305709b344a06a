"""Per-layer kernels of the lean decoder, in two interchangeable sets.

Each set gives, per layer: `norm_attn`, `qkv`, `o_residual`, `norm_mlp`, `swiglu`,
`down_residual` (callables on 2-D activations (N, features)), the Qwen3 `q_norm` / `k_norm`
weights, and, for LoRA rows (inference/lora.py): `gate` and `up` (SwiGLU's two projections
apart, (N, F) each, so an adapter's deltas are added in place before the activation), and
`lora_in_attn` / `lora_in_mlp`, what an adapter's q/k/v and gate/up A's multiply: the norm's
output with its weight applied (the packed set folds that weight into the projection
instead). For the model: `norm_final`, `lm_head`, and whether q/k come out with their head
dimension *interleaved* (RoPE pairs adjacent) or in HF's rotate-half layout (an adapter's q/k
rows of B are permuted to match: decoder.py `layout`).

- dense: `F.linear` on the model's own parameters (any device, any dtype).
- packed (CPU, fp32): oneDNN matmuls on weights reordered once into its blocked layout
  (`mkldnn._linear_pointwise`, what torch.compile emits on CPU); `F.linear` re-packs a weight
  on every call, which at batch 64 costs as much as the multiply. The packed copies also
  fold work away: the layers' RMSNorm weights are multiplied into the following projection,
  SiLU and the gate multiply and the residual adds run as oneDNN post-ops, and q/k rows are
  permuted so each RoPE pair is adjacent and RoPE is one complex multiply. Attention scores
  are unchanged by that permutation because q and k share it; values are not permuted.
  The reorder is the one copy a weight pickup makes (a blocked transpose, several times
  slower than a memcpy of the same bytes on CPU; docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases) of `linears` concatenated along the output dim: (weight, bias
    or None). Where they already lie back to back in one storage (fused by an earlier call, or
    bound to a shared-memory segment laid out so) this is a view and nothing is copied;
    otherwise they are copied into one new tensor and each module's parameter becomes a view
    of it."""
    weight = adjacent_view([m.weight for m in linears])
    if weight is None:
        weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
        _repoint(linears, "weight", weight)
    if all(m.bias is None for m in linears):
        return weight, None
    bias = adjacent_view([m.bias for m in linears]) if all(m.bias is not None for m in linears) else None
    if bias is None:
        bias = torch.cat([m.bias.detach() if m.bias is not None else
                          torch.zeros(m.out_features, dtype=weight.dtype, device=weight.device)
                          for m in linears]).contiguous()
        _repoint(linears, "bias", bias)
    return weight, bias


def adjacent_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor viewing `tensors` concatenated along dim 0, if they are contiguous, of one
    dtype and trailing shape, and lie back to back in one storage; else None."""
    first = tensors[0].detach()
    rows, end = 0, first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.device != first.device or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.data_ptr() != end):
            return None
        rows, end = rows + t.shape[0], end + t.numel() * t.element_size()
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _repoint(linears: list[torch.nn.Linear], attr: str, fused: torch.Tensor) -> None:
    """Make each module's `attr` parameter a view of its rows of `fused` (a module without a
    bias keeps none; its rows of a fused bias are zeros)."""
    start = 0
    for m in linears:
        end = start + m.out_features
        if getattr(m, attr) is not None:
            getattr(m, attr).data = fused[start:end]
        start = end


def packed_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# ---------------------------------------------------------------- dense


def dense_kernels(layers: list[dict], final_norm: torch.Tensor, lm_head, eps: float) -> tuple[list[dict], dict]:
    out = []
    for L in layers:
        ffn = L["ffn"]
        w_qkv, b_qkv = L["qkv"]
        w_gu, b_gu = L["gate_up"]
        w_o, b_o = L["o"]
        w_down, b_down = L["down"]

        def swiglu(h, w_gu=w_gu, b_gu=b_gu, ffn=ffn):
            gu = F.linear(h, w_gu, b_gu)  # (N, 2 F)
            return F.silu(gu[:, :ffn]) * gu[:, ffn:]

        out.append(dict(
            norm_attn=_rms(L["ln_in"], eps), norm_mlp=_rms(L["ln_post"], eps),
            qkv=lambda h, w=w_qkv, b=b_qkv: F.linear(h, w, b),
            o_residual=lambda a, x, w=w_o, b=b_o: x + F.linear(a, w, b),
            swiglu=swiglu,
            gate=lambda h, w=w_gu[:ffn], b=None if b_gu is None else b_gu[:ffn]: F.linear(h, w, b),
            up=lambda h, w=w_gu[ffn:], b=None if b_gu is None else b_gu[ffn:]: F.linear(h, w, b),
            lora_in_attn=_same, lora_in_mlp=_same,
            down_residual=lambda m, x, w=w_down, b=b_down: x + F.linear(m, w, b),
            q_norm=L["q_norm"], k_norm=L["k_norm"]))
    w_head, b_head = lm_head
    model = dict(norm_final=_rms(final_norm, eps), lm_head=lambda h: F.linear(h, w_head, b_head),
                 interleaved=False)
    return out, model


def _same(h: torch.Tensor) -> torch.Tensor:
    return h


def _rms(weight: torch.Tensor, eps: float):
    return lambda x: F.rms_norm(x, (x.shape[-1],), weight, eps)


# ---------------------------------------------------------------- packed (oneDNN, fp32)


def packed_kernels(layers: list[dict], final_norm: torch.Tensor, lm_head, eps: float,
                   n_heads: int, n_kv: int, head_dim: int,
                   scratch: dict | None = None) -> tuple[list[dict], dict]:
    """Reorder every projection once into oneDNN's layout: one read of each weight wherever it
    lives (the model's parameters, or a leased shared-memory buffer), no other copy kept.
    Norm weights are folded into the q/k/v and gate/up projections through `scratch` (reused
    buffers of the folded weights, one per shape: in cache when reordered); the final norm's is
    applied to the activations instead, which spares a pass over the largest matrix."""
    pack = torch.ops.mkldnn._reorder_linear_weight
    linear = torch.ops.mkldnn._linear_pointwise
    scratch = {} if scratch is None else scratch
    perm_D = interleave_permutation(head_dim)
    D, n_qk = head_dim, (n_heads + n_kv) * head_dim
    out = []
    for L in layers:
        ffn = L["ffn"]
        w_qkv, b_qkv = (t.detach() if t is not None else None for t in L["qkv"])
        ln_in = L["ln_in"].detach()
        folded = _scratch(scratch, w_qkv)
        # q/k rows: each head's (2, D/2) halves -> (D/2, 2) pairs, as a strided view, scaled in one pass
        torch.mul(w_qkv[:n_qk].view(-1, 2, D // 2, w_qkv.shape[1]).transpose(1, 2), ln_in,
                  out=folded[:n_qk].view(-1, D // 2, 2, w_qkv.shape[1]))
        torch.mul(w_qkv[n_qk:], ln_in, out=folded[n_qk:])
        w_qkv = pack(folded)
        if b_qkv is not None:
            b_qkv = torch.cat([b_qkv[:n_qk].view(-1, 2, D // 2).transpose(1, 2).reshape(-1), b_qkv[n_qk:]])
        w_gu, b_gu = L["gate_up"]
        ln_post = L["ln_post"].detach()
        w_gate, w_up = (pack(torch.mul(w, ln_post, out=_scratch(scratch, w)))
                        for w in (w_gu.detach()[:ffn], w_gu.detach()[ffn:]))
        b_gate, b_up = (None, None) if b_gu is None else (b_gu[:ffn].detach(), b_gu[ffn:].detach())
        w_o, b_o = pack(L["o"][0].detach()), _detach(L["o"][1])
        w_down, b_down = pack(L["down"][0].detach()), _detach(L["down"][1])

        def swiglu(h, w_gate=w_gate, b_gate=b_gate, w_up=w_up, b_up=b_up):
            gate = linear(h, w_gate, b_gate, "swish", [], "")  # silu(h W_g^T)
            return linear.binary(h, gate, w_up, b_up, "mul")  # (h W_u^T) * gate

        out.append(dict(
            norm_attn=_unit_rms(eps), norm_mlp=_unit_rms(eps),
            qkv=lambda h, w=w_qkv, b=b_qkv: linear(h, w, b, "none", [], ""),
            o_residual=lambda a, x, w=w_o, b=b_o: linear.binary(a, x, w, b, "add"),
            swiglu=swiglu,
            gate=lambda h, w=w_gate, b=b_gate: linear(h, w, b, "none", [], ""),
            up=lambda h, w=w_up, b=b_up: linear(h, w, b, "none", [], ""),
            lora_in_attn=lambda h, w=ln_in: h * w, lora_in_mlp=lambda h, w=ln_post: h * w,
            down_residual=lambda m, x, w=w_down, b=b_down: linear.binary(m, x, w, b, "add"),
            q_norm=None if L["q_norm"] is None else L["q_norm"].detach()[perm_D],
            k_norm=None if L["k_norm"] is None else L["k_norm"].detach()[perm_D]))
    w_head, b_head = lm_head
    w_head = pack(w_head.detach())
    b_head = _detach(b_head)
    model = dict(norm_final=_unit_rms(eps, final_norm.detach()),
                 lm_head=lambda h: linear(h, w_head, b_head, "none", [], ""), interleaved=True)
    return out, model


def _scratch(scratch: dict, like: torch.Tensor) -> torch.Tensor:
    key = (tuple(like.shape), like.dtype, like.device)
    if key not in scratch:
        scratch[key] = torch.empty_like(like, memory_format=torch.contiguous_format)
    return scratch[key]


def interleave_permutation(head_dim: int) -> torch.Tensor:
    """New order of a head's dims so that HF's rotate-half RoPE pairs (j, j + D/2) become
    adjacent (2j, 2j + 1): [0, D/2, 1, D/2 + 1, ...]."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).reshape(-1)


def packed_qkv_order(n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """Row i of the packed kernels' fused q/k/v output is the model's row order[i]: each q/k
    head's dims in `interleave_permutation` order, v as it is. ((H + 2 KV) D,)"""
    n_qk = (n_heads + n_kv) * head_dim
    qk = (torch.arange(n_heads + n_kv)[:, None] * head_dim + interleave_permutation(head_dim)[None]).reshape(-1)
    return torch.cat([qk, torch.arange(n_qk, n_qk + n_kv * head_dim)])


def _unit_rms(eps: float, weight: torch.Tensor | None = None):
    """x / rms(x), the weight being folded into the next matmul (or multiplied after, when
    given): 4 kernels instead of F.rms_norm's 7 on CPU."""
    eps_t = torch.tensor(eps, dtype=torch.float32)

    def norm(x):
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # sqrt(sum x^2), (N, 1)
        x = x * torch.addcmul(eps_t, n, n, value=1.0 / x.shape[-1]).rsqrt_()
        return x if weight is None else x * weight
    return norm


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()

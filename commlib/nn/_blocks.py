"""Per-block attention math: one registered implementation per device type, and the merge.

Every implementation works on ``(batch, heads, seq, head_dim)`` views (strided views of the
``(batch, seq, heads, head_dim)`` tensors users pass, no copies), takes K/V with ``h_kv`` heads
where ``h`` is a multiple of ``h_kv`` (query head i reads KV head ``i // (h // h_kv)``, torch's
``enable_gqa`` convention), and returns:

* ``forward(q, k, v, causal, scale) -> (out, lse)``: softmax(q kᵀ·scale) v for this block and the
  natural-log log-sum-exp of the scaled scores, ``(batch, heads, seq_q)`` in float32;
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``: the block's share of the
  gradients given the *final* out and lse of the whole row (no rescaling needed: the blocks' shares
  add up to the exact gradient).

``causal`` is the top-left-aligned lower triangle and is only used with seq_q == seq_k.

Implementations: ``cpu`` (torch's fused flash kernel for CPU, GQA native), ``cuda`` (torch's
memory-efficient kernel, which returns the lse; KV heads expanded locally for GQA) and ``math``
(plain torch, any device and dtype: the definition of the semantics).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["BlockOps", "BLOCK_OPS", "block_ops", "merge_", "math_grads_from_p"]


class BlockOps(NamedTuple):
    forward: Callable
    backward: Callable


BLOCK_OPS: dict[str, BlockOps] = {}


def _register(name: str, forward: Callable, backward: Callable) -> None:
    BLOCK_OPS[name] = BlockOps(forward, backward)


def block_ops(device: torch.device, dtype: torch.dtype) -> BlockOps:
    """The implementation for tensors on ``device``: the fused kernel of its device type when
    there is one for ``dtype``, else ``math``."""
    ops = BLOCK_OPS.get(device.type)
    if ops is not None and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        if not (device.type == "cuda" and dtype is torch.float64):
            return ops
    return BLOCK_OPS["math"]


# ----- math: the definition --------------------------------------------------------------
def _group(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[1] // k.shape[1]


def _scores(q, k, causal, scale):
    """float32 (or float64) scores (b, h_kv, g, sq, sk) and the causal mask applied."""
    b, h, sq, d = q.shape
    hk = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, hk, h // hk, sq, d).to(acc)
    s = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        sk = k.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    b, h, sq, d = q.shape
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.to(p.dtype).unsqueeze(2))
    return out.reshape(b, h, sq, -1).to(q.dtype), lse.reshape(b, h, sq)


def math_grads_from_p(p, dout, q, k, v, delta, scale):
    """Gradients of one block from its probabilities ``p`` (b, h_kv, g, sq, sk) and
    ``delta = rowsum(dout * out)`` (b, h, sq): dv = pᵀ dO, dS = p (dO vᵀ - delta), dq = scale dS k,
    dk = scale dSᵀ q (GQA: summed over the query heads of each KV head)."""
    b, h, sq, d = q.shape
    hk = k.shape[1]
    acc = p.dtype
    do = dout.reshape(b, hk, h // hk, sq, -1).to(acc)
    qg = q.reshape(b, hk, h // hk, sq, d).to(acc)
    kk, vv = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta.reshape(b, hk, h // hk, sq, 1).to(acc))
    dq = (torch.matmul(ds, kk) * scale).reshape(b, h, sq, d)
    dk = (torch.matmul(ds.transpose(-1, -2), qg) * scale).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    b, h, sq, d = q.shape
    hk = k.shape[1]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.reshape(b, hk, h // hk, sq, 1).to(s.dtype))
    delta = (dout.to(s.dtype) * out.to(s.dtype)).sum(-1)
    return math_grads_from_p(p, dout, q, k, v, delta, scale)


_register("math", _math_forward, _math_backward)


# ----- cpu: torch's fused flash kernel (returns the lse, handles GQA) -----------------------
_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _cpu_forward(q, k, v, causal, scale):
    return _cpu_fwd(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return _cpu_bwd(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


_register("cpu", _cpu_forward, _cpu_backward)


# ----- cuda: torch's memory-efficient kernel (returns the lse; no GQA: expand KV locally) --
def _expand(q, t):
    g = _group(q, t)
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _cuda_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand(q, k), _expand(q, v), None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[:, :, : q.shape[2]].float()  # the kernel may pad lse's last dim


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    g = _group(q, k)
    ke, ve = _expand(q, k), _expand(q, v)
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, ke, ve, None, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale)[:3]
    if g > 1:
        b, h, sk, d = dk.shape
        dk = dk.reshape(b, h // g, g, sk, d).sum(2)
        dv = dv.reshape(b, h // g, g, sk, -1).sum(2)
    return dq, dk, dv


_register("cuda", _cuda_forward, _cuda_backward)


# ----- merging partial results ---------------------------------------------------------------
def merge_(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor) -> None:
    """Merge the partial result (out2, lse2) of more keys into (out, lse), in place, in the dtype
    of ``out``/``lse`` (float32 or wider):

        out = out - sigmoid(lse2 - lse) * (out - out2)      lse = logaddexp(lse, lse2)

    A row that has seen no key yet (lse = -inf) takes out2; a block with no visible key for a row
    (lse2 = -inf) leaves it unchanged; a row with neither stays (0, -inf) instead of NaN."""
    w = torch.sigmoid(lse2 - lse)
    w = torch.nan_to_num_(w, nan=0.0).unsqueeze(-1)  # -inf - -inf: neither side has a key
    out.lerp_(out2.to(out.dtype), w)  # the same formula in one pass over out, no temporary
    torch.logaddexp(lse, lse2, out=lse)

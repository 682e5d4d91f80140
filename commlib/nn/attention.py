"""``SequenceParallelAttention``: multi-head (GQA) self-attention on sequence-sharded activations."""

from __future__ import annotations

import torch
from torch import nn

from commlib.errors import CommTypeError, arg_error

from . import functional as F

__all__ = ["SequenceParallelAttention"]

# algorithm -> (function, the layouts it accepts, default layout)
_ALGORITHMS = {
    "ring": (lambda q, k, v, **kw: F.ring_attention(q, k, v, algorithm="ring", **kw),
             ("zigzag", "contiguous"), "zigzag"),
    "rsa": (lambda q, k, v, **kw: F.ring_attention(q, k, v, algorithm="rsa", **kw),
            ("zigzag", "contiguous"), "zigzag"),
    "ulysses": (lambda q, k, v, layout, **kw: F.ulysses_attention(q, k, v, **kw),
                ("contiguous",), "contiguous"),
}


class SequenceParallelAttention(nn.Module):
    """Self-attention with Q/K/V/output projections whose input ``x`` is this rank's shard of
    the sequence, ``(batch, seq_local, embed_dim)``, sharded with
    ``commlib.nn.functional.shard_sequence(x, dim=1, layout=module.layout)``.

    The projections are replicated: every rank holds the same weights and computes gradients for
    its own tokens, so sum the weight gradients over the group after backward (``all_reduce``),
    exactly as in data parallelism.

    Args:
        embed_dim, num_heads: model width and query heads (``embed_dim % num_heads == 0``).
        num_kv_heads: KV heads for GQA (default ``num_heads``); must divide ``num_heads``.
        causal: causal mask in global sequence order.
        group: the sequence-parallel group (default world).
        algorithm: ``"ring"`` (default), ``"rsa"`` or ``"ulysses"``.
        layout: how the sequence is sharded: ``"zigzag"`` (default for ring/rsa) or
            ``"contiguous"`` (the only one for ulysses).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *,
                 causal: bool = False, group=None, algorithm: str = "ring",
                 layout: str | None = None, bias: bool = True, device=None, dtype=None):
        super().__init__()
        fn = "nn.SequenceParallelAttention"
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for arg, val in (("embed_dim", embed_dim), ("num_heads", num_heads),
                         ("num_kv_heads", num_kv_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise arg_error(fn, arg, val, "must be a positive int", f"pass {arg}=<int > 0>",
                                CommTypeError)
        if embed_dim % num_heads:
            raise arg_error(fn, "num_heads", num_heads, f"must divide embed_dim={embed_dim}",
                            "choose a head count that divides the model width")
        if num_heads % num_kv_heads:
            raise arg_error(fn, "num_kv_heads", num_kv_heads, f"must divide num_heads={num_heads}",
                            "choose a KV head count that divides the query head count")
        if algorithm not in _ALGORITHMS:
            raise arg_error(fn, "algorithm", algorithm, f"must be one of {sorted(_ALGORITHMS)}",
                            "pass algorithm='ring'")
        attend, layouts, default = _ALGORITHMS[algorithm]
        layout = default if layout is None else layout
        if layout not in layouts:
            raise arg_error(fn, "layout", layout, f"algorithm {algorithm!r} takes {list(layouts)}",
                            f"pass layout={default!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.group, self.algorithm, self.layout = causal, group, algorithm, layout
        self._attend = attend
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.embed_dim:
            raise arg_error("nn.SequenceParallelAttention.forward", "x",
                            f"<{type(x).__name__} shape={tuple(getattr(x, 'shape', ()))}>",
                            f"must be (batch, seq_local, embed_dim={self.embed_dim})",
                            "pass this rank's shard of the activations")
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        out = self._attend(q, k, v, causal=self.causal, group=self.group, layout=self.layout)
        return self.out_proj(out.reshape(b, s, self.embed_dim))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, causal={self.causal}, "
                f"algorithm={self.algorithm!r}, layout={self.layout!r}")

"""The rest of a 2D tensor-parallel transformer (Optimus, Xu et al. 2021) around ``Linear2D``:
:class:`LayerNorm2D`, :class:`Embedding2D`, :func:`cross_entropy_2d`, :class:`TransformerBlock2D`
and its dense single-process twin :class:`TransformerBlock`.

**Layout** (``tensor_parallel_2d.py``): on an (r, c) ``commlib.Mesh`` rank (i, j) holds rows
block i of dim 0 and block j of the last dim: a global ``(N, ..., H)`` activation is
``(N/r, ..., H/c)``. The *row group* is the c ranks of row i (``grid.row``), the *column group*
the r ranks of column j (``grid.col``). Token ids and targets, which have no feature dim, are
held as rows block i on every rank of row i: ``(N/r, ...)``.

**Gradients.** Each rank's loss is its own term and the total is their sum: a parameter block's
``.grad`` is the same block of the dense gradient of the total. Blocks replicated along a mesh
column (the layer norm's scale and shift, block j of H) are summed over the column in backward,
so every replica holds the full dense block gradient. :func:`cross_entropy_2d` is the exception
that makes the convention usable: it returns the *mean* loss of the global batch, the same
scalar on every rank, and its backward gives every rank its logits block of the gradient of that
one loss; ``loss.backward()`` on every rank then trains once (not r*c times), because what flows
back into the layers is exactly the sum convention's per-block gradient.

**Communication** per call, bytes sent by one rank (``commlib.nn.functional.traffic()``'s
convention; T = tokens of the global batch, s = the element size, s_f = 4 for float32, bfloat16
and float16 statistics, 8 for float64):

* ``LayerNorm2D``: forward one all-gather along the row of (mean, correction, M2) per token:
  ``(c-1) * 3 (T/r) s_f``; backward one all-reduce along the row of the two per-token sums
  ``2(c-1) * 2 (T/r) s_f / c`` and, with the affine parameters, one along the column of their
  two gradient blocks ``2(r-1) * 2 (H/c) s / r``.
* ``Embedding2D``: forward all-gather of the ids along the column ``(r-1) (T/r) 8`` and a
  reduce-scatter of the looked-up rows ``(r-1) T (H/c) s / r``; backward an all-gather of the
  output gradient along the column ``(r-1) (T/r) (H/c) s``.
* ``cross_entropy_2d``: forward an all-reduce MAX along the row ``2(c-1) (T/r) s_f / c``, one
  fused all-reduce SUM along the row ``2(c-1) * 2 (T/r) s_f / c``, one along the column of three
  float64 scalars ``2(r-1) * 24 / r``; backward nothing.
* ``TransformerBlock2D``: attention is local to a rank (dim 0 is the batch); two LayerNorm2D and
  four Linear2D (SUMMA).

**Initialization.** A layer built directly draws its whole dense module from the default
generator and keeps its blocks: seed every rank alike. ``from_dense`` keeps the blocks of a given
module (no communication); ``to_dense()`` is collective over the mesh.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from commlib.api.entry import checked_call
from commlib.errors import CommTypeError, arg_error

from . import _traffic
from . import functional as F
from ._cross_entropy_2d import _stat_dtype, cross_entropy_2d
from ._grid import assemble, divisible, gather_blocks, grid_of
from ._summa import _LOW
from .tensor_parallel import _options, _positive
from .tensor_parallel_2d import Linear2D, _check_block, block_param, column_vector, dense_params

__all__ = ["LayerNorm2D", "Embedding2D", "cross_entropy_2d", "TransformerBlock2D",
           "TransformerBlock"]

# ----- LayerNorm2D ------------------------------------------------------------------------------
def _merge_moments(table: torch.Tensor, h: int):
    """Chan et al.'s parallel merge of the c blocks' moments for equal counts ``h``.

    ``table`` (c, T, 3) holds per block and token the mean as a float ``hi`` plus the correction
    ``lo`` (the mean of ``x - hi``: the corrected two-pass algorithm), and M2 about that mean.
    The mean is kept as hi + lo because far from zero one float cannot hold it: at mean 1e4 a
    float32 is 1e-3 apart from the next, a tenth of a 1e-2 spread. Returns (hi, lo, M2), (T,)."""
    hi_k, lo_k, m2_k = table.unbind(-1)
    hi = hi_k.mean(0)
    off = hi_k - hi  # exact where the block means lie within a factor 2 of each other
    lo = (off + lo_k).mean(0)
    delta = (off - lo) + lo_k
    return hi, lo, m2_k.sum(0) + h * delta.square().sum(0)


class _LayerNorm2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, grid, features, eps):
        h = x.shape[-1]
        sd = _stat_dtype(x.dtype)
        xs = x.detach().reshape(-1, h).to(sd)
        hi = xs.mean(-1)
        d = xs - hi[:, None]
        lo = d.mean(-1)
        d -= lo[:, None]
        stats = torch.stack((hi, lo, d.square().sum(-1)), -1)  # mean = hi + lo, and M2
        table = stats.new_empty((grid.c,) + tuple(stats.shape))
        _traffic.all_gather(table, stats, grid.row)
        hi, lo, m2 = _merge_moments(table, h)
        rstd = torch.rsqrt(m2 / features + eps)
        y = ((xs - hi[:, None]) - lo[:, None]) * rstd[:, None]
        if weight is not None:
            y = y * weight.detach().to(sd)
        if bias is not None:
            y = y + bias.detach().to(sd)
        ctx.save_for_backward(x, weight, hi, lo, rstd)
        ctx.args = (grid, features, bias is not None)
        return y.to(x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, hi, lo, rstd = ctx.saved_tensors
        grid, features, has_bias = ctx.args
        h, sd = x.shape[-1], hi.dtype
        dy2 = dy.reshape(-1, h).to(sd)
        xhat = ((x.detach().reshape(-1, h).to(sd) - hi[:, None]) - lo[:, None]) * rstd[:, None]
        dwb = work = None
        if weight is not None and any(ctx.needs_input_grad[1:3]):
            # the blocks are replicated down the column: each row's tokens add their part
            parts = [(dy2 * xhat).sum(0)] + ([dy2.sum(0)] if has_bias else [])
            dwb = torch.stack(parts).to(weight.dtype)
            work = _traffic.all_reduce(dwb, grid.col, async_op=True)
        dx = None
        if ctx.needs_input_grad[0]:
            gx = dy2 * weight.detach().to(sd) if weight is not None else dy2
            sums = torch.stack((gx.sum(-1), (gx * xhat).sum(-1)), -1)  # over H: the row's blocks
            _traffic.all_reduce(sums, grid.row)
            dx = (rstd[:, None] * (gx - (sums[:, :1] + xhat * sums[:, 1:]) / features))
            dx = dx.to(x.dtype).view(x.shape)
        if work is not None:
            work.wait()
        dw = dwb[0] if dwb is not None and ctx.needs_input_grad[1] else None
        db = dwb[1] if dwb is not None and has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def _features(fn: str, normalized_shape) -> int:
    shape = normalized_shape
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1:
        shape = shape[0]
    if isinstance(shape, bool) or not isinstance(shape, int) or shape <= 0:
        raise arg_error(fn, "normalized_shape", normalized_shape,
                        "must be one positive int: the last dim H, normalized over the mesh's "
                        "row (several normalized dims are not supported)",
                        "pass normalized_shape=H", CommTypeError)
    return shape


def _eps(fn: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise arg_error(fn, "eps", eps, "must be a float >= 0", "pass e.g. eps=1e-5",
                        CommTypeError)
    return float(eps)


class LayerNorm2D(nn.Module):
    """``nn.LayerNorm`` over the last dim H, with H split over the mesh's c columns: input and
    output ``(N/r, ..., H/c)``. Rank (i, j) holds block j (H/c) of the scale and shift,
    replicated down column j.

    The statistics are numerically stable: each rank takes its block's per-token mean and M2 in
    float32 (two passes, the mean kept as a float plus its correction: three numbers per token;
    float64 for float64 data), and one all-gather along the row brings the c blocks' moments,
    merged with Chan et al.'s parallel formula (never E[x^2] - E[x]^2, which loses everything
    when the mean dwarfs the spread).
    Backward: one all-reduce along the row of the two per-token sums the input gradient needs,
    and one along the column of the scale's and shift's gradient blocks. bfloat16 and float16
    compute in float32 and round the result once.

    Args:
        normalized_shape: H (an int, or a one-element shape); must divide by c.
        eps: added to the variance.
        mesh: a 2-D ``commlib.Mesh`` (r, c).
        elementwise_affine: a learnable scale (ones) and, with ``bias``, shift (zeros).
        bias: a shift, as ``nn.LayerNorm``'s ``bias``.
    """

    _fn = "nn.LayerNorm2D"

    def __init__(self, normalized_shape, eps: float = 1e-5, *, mesh, elementwise_affine: bool = True,
                 bias: bool = True, dtype=None, device=None):
        super().__init__()
        fn = self._fn
        self.grid = grid = grid_of(fn, mesh)
        features = _features(fn, normalized_shape)
        self.eps = _eps(fn, eps)
        elementwise_affine = F._bool(fn, "elementwise_affine", elementwise_affine)
        bias = F._bool(fn, "bias", bias)
        divisible(fn, "normalized_shape", "normalized_shape", features, grid.c,
                  f"features split over the mesh's {grid.c} columns")
        self.normalized_shape, self.mesh = (features,), mesh
        self.elementwise_affine = elementwise_affine
        self._load(nn.LayerNorm(features, self.eps, elementwise_affine, bias, device=device,
                                dtype=dtype))

    def _load(self, dense: nn.LayerNorm) -> None:
        h = self.normalized_shape[0] // self.grid.c
        for name in ("weight", "bias"):
            p = getattr(dense, name)
            if p is None:
                self.register_parameter(name, None)
            else:
                setattr(self, name, block_param(p[self.grid.j * h:(self.grid.j + 1) * h],
                                                 p.requires_grad))

    @classmethod
    def from_dense(cls, module: nn.LayerNorm, mesh, **options) -> "LayerNorm2D":
        """This rank's blocks of ``module`` (the same ``nn.LayerNorm`` on every rank; no
        communication, the parameters are copied). No options."""
        fn = cls._fn + ".from_dense"
        if not isinstance(module, nn.LayerNorm):
            raise arg_error(fn, "module", type(module).__name__, "must be a torch.nn.LayerNorm",
                            "pass the dense layer this one replaces", CommTypeError)
        _options(fn, options, ())
        p = module.weight if module.weight is not None else module.bias
        layer = cls(module.normalized_shape, module.eps, mesh=mesh,
                    elementwise_affine=module.elementwise_affine, bias=module.bias is not None,
                    device="meta", dtype=None if p is None else p.dtype)
        layer._load(module)
        return layer

    def to_dense(self) -> nn.LayerNorm:
        """The dense ``nn.LayerNorm`` on every rank (collective over the mesh), with ``.grad``
        where this layer's parameters have one."""
        p = self.weight
        dense = nn.LayerNorm(self.normalized_shape, self.eps, self.elementwise_affine,
                             self.bias is not None, device="meta",
                             dtype=None if p is None else p.dtype)
        if p is None:
            return dense
        return dense_params(self._fn + ".to_dense", self.grid, dense,
                             {"weight": self.weight, "bias": self.bias},
                             lambda _, t: column_vector(t, self.grid))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = self._fn
        with checked_call(fn, self.grid.whole) as (_, call):
            if self.weight is not None:
                dtype = self.weight.dtype
            else:
                dtype = x.dtype if isinstance(x, torch.Tensor) and x.is_floating_point() \
                    else torch.get_default_dtype()
            _check_block(fn, "x", x, self.grid, self.normalized_shape[0], dtype)
            call.update(shape=tuple(x.shape), dtype=str(x.dtype))
        return _LayerNorm2D.apply(x, self.weight, self.bias, self.grid, self.normalized_shape[0],
                                  self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}, "
                f"mesh={self.grid.r}x{self.grid.c}")


# ----- Embedding2D ------------------------------------------------------------------------------
class _Embedding2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, grid, num_embeddings, fn):
        vr, h = weight.shape
        flat = ids.detach().reshape(-1).to(torch.int64)
        t = flat.numel()
        # every id of the column's rows: the same on every rank (a row holds the same ids), so
        # the check below raises on every rank or on none
        every = flat.new_empty(grid.r * t)
        _traffic.all_gather(every, flat.contiguous(), grid.col)
        bad = (every < 0) | (every >= num_embeddings)
        if bool(bad.any()):
            first = int(every[bad][0])
            raise arg_error(fn, "ids", first,
                            f"is a token id outside [0, {num_embeddings}) (num_embeddings); "
                            f"{int(bad.sum())} of the batch's ids are",
                            f"map the ids into [0, {num_embeddings}), or build the layer with "
                            f"num_embeddings > {first}")
        local = every - grid.i * vr
        rows = torch.nonzero((local >= 0) & (local < vr)).squeeze(1)  # ids in my vocab block
        idx = local[rows]
        looked = weight.new_zeros((grid.r * t, h))
        looked[rows] = weight.detach()[idx]
        out = weight.new_empty((t, h))
        _traffic.reduce_scatter(out, looked, grid.col)  # each token's row from its block's owner
        ctx.save_for_backward(rows, idx)
        ctx.args = (grid, tuple(weight.shape), weight.dtype)
        return out.view(tuple(ids.shape) + (h,))

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        rows, idx = ctx.saved_tensors
        grid, shape, dtype = ctx.args
        dy2 = dy.reshape(-1, shape[1]).contiguous()
        every = dy2.new_empty((grid.r * dy2.shape[0], shape[1]))
        _traffic.all_gather(every, dy2, grid.col)  # every token's gradient of my columns
        acc = torch.float32 if dtype in _LOW else dtype
        dw = torch.zeros(shape, dtype=acc, device=dy2.device)
        dw.index_add_(0, idx, every[rows].to(acc))
        return None, dw.to(dtype), None, None, None


class Embedding2D(nn.Module):
    """``nn.Embedding`` on an (r, c) mesh: rank (i, j) holds the weight block
    ``(V/r, H/c)`` (vocabulary rows block i, embedding columns block j), 1/(r c) of the table.

    Input: this rank's token ids ``(N/r, ...)`` (int64 or int32; the same on every rank of row
    i). Output: ``(N/r, ..., H/c)``, the 2-D layout. Forward all-gathers the ids along the column,
    looks up those in the rank's vocabulary block (zero rows for the others) and reduce-scatters
    along the column; backward all-gathers the output gradient along the column and accumulates
    it into the block. An id outside [0, V) raises on every rank.

    Args:
        num_embeddings: V, must divide by r.
        embedding_dim: H, must divide by c.
        mesh: a 2-D ``commlib.Mesh`` (r, c).
    """

    _fn = "nn.Embedding2D"

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mesh, dtype=None, device=None):
        super().__init__()
        fn = self._fn
        self.grid = grid = grid_of(fn, mesh)
        num_embeddings = _positive(fn, "num_embeddings", num_embeddings)
        embedding_dim = _positive(fn, "embedding_dim", embedding_dim)
        divisible(fn, "num_embeddings", "num_embeddings", num_embeddings, grid.r,
                  f"vocabulary rows split over the mesh's {grid.r} rows")
        divisible(fn, "embedding_dim", "embedding_dim", embedding_dim, grid.c,
                  f"embedding columns split over the mesh's {grid.c} columns")
        self.num_embeddings, self.embedding_dim, self.mesh = num_embeddings, embedding_dim, mesh
        self._load(nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype))

    def _load(self, dense: nn.Embedding) -> None:
        g = self.grid
        v, h = self.num_embeddings // g.r, self.embedding_dim // g.c
        w = dense.weight[g.i * v:(g.i + 1) * v, g.j * h:(g.j + 1) * h]
        self.weight = block_param(w, dense.weight.requires_grad)

    @classmethod
    def from_dense(cls, module: nn.Embedding, mesh, **options) -> "Embedding2D":
        """This rank's block of ``module`` (the same ``nn.Embedding`` on every rank; no
        communication, the weight is copied). No options. ``padding_idx``, ``max_norm``,
        ``scale_grad_by_freq`` and ``sparse`` are not supported."""
        fn = cls._fn + ".from_dense"
        if not isinstance(module, nn.Embedding):
            raise arg_error(fn, "module", type(module).__name__, "must be a torch.nn.Embedding",
                            "pass the dense layer this one replaces", CommTypeError)
        _options(fn, options, ())
        for name, default in (("padding_idx", None), ("max_norm", None),
                              ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(module, name) != default:
                raise arg_error(fn, "module", f"<nn.Embedding {name}={getattr(module, name)}>",
                                f"has {name} set, which Embedding2D does not support",
                                f"build the dense embedding with {name}={default}")
        layer = cls(module.num_embeddings, module.embedding_dim, mesh=mesh, device="meta",
                    dtype=module.weight.dtype)
        layer._load(module)
        return layer

    def to_dense(self) -> nn.Embedding:
        """The dense ``nn.Embedding`` on every rank (collective over the mesh), with ``.grad``
        where this layer's weight has one."""
        g = self.grid
        dense = nn.Embedding(self.num_embeddings, self.embedding_dim, device="meta",
                             dtype=self.weight.dtype)
        return dense_params(self._fn + ".to_dense", g, dense, {"weight": self.weight},
                             lambda _, t: assemble(gather_blocks(t, g), g.r, g.c))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        fn = self._fn
        with checked_call(fn, self.grid.whole) as (_, call):
            if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
                what = f"<tensor dtype={ids.dtype}>" if isinstance(ids, torch.Tensor) \
                    else type(ids).__name__
                raise arg_error(fn, "ids", what, "must be a torch.Tensor of int64 token ids",
                                f"pass this rank's (N/{self.grid.r}, ...) ids (the rows block of "
                                "its mesh row) as torch.int64", CommTypeError)
            if ids.dim() < 1:
                raise arg_error(fn, "ids", "<tensor shape=()>", "must have at least 1 dimension",
                                f"pass this rank's (N/{self.grid.r}, ...) block of ids")
            call.update(shape=tuple(ids.shape))
        return _Embedding2D.apply(ids, self.weight, self.grid, self.num_embeddings, fn)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"mesh={self.grid.r}x{self.grid.c}")


# ----- transformer blocks -----------------------------------------------------------------------
def _attend(qkv: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    """Self-attention of ``heads`` heads from ``qkv`` (B, S, 3 * heads * d) ordered
    [q; k; v] with each head's d features contiguous: (B, S, heads * d)."""
    b, s, f = qkv.shape
    q, k, v = qkv.view(b, s, 3, heads, f // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)
    a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return a.transpose(1, 2).reshape(b, s, f // 3)


def _block_forward(m: nn.Module, x: torch.Tensor, heads: int) -> torch.Tensor:
    """Pre-norm: h = x + proj(attn(ln1(x))); out = h + fc2(gelu(fc1(ln2(h))))."""
    h = x + m.proj(_attend(m.qkv(m.ln1(x)), heads, m.causal))
    return h + m.fc2(nn.functional.gelu(m.fc1(m.ln2(h))))


def _block_sizes(fn: str, embed_dim, num_heads, ffn_dim) -> tuple[int, int, int]:
    embed_dim = _positive(fn, "embed_dim", embed_dim)
    num_heads = _positive(fn, "num_heads", num_heads)
    ffn_dim = _positive(fn, "ffn_dim", ffn_dim)
    divisible(fn, "embed_dim", "embed_dim", embed_dim, num_heads, f"{num_heads} heads of equal size")
    return embed_dim, num_heads, ffn_dim


_PARTS = ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")


class TransformerBlock(nn.Module):
    """The dense (single-process) pre-norm transformer block that :class:`TransformerBlock2D`
    splits: ``h = x + proj(attn(ln1(x)))``, ``out = h + fc2(gelu(fc1(ln2(h))))`` on
    ``(B, S, embed_dim)``, with ``qkv = nn.Linear(E, 3E)`` (output rows [q; k; v], each head's
    features contiguous), torch's ``scaled_dot_product_attention`` and the exact GELU."""

    _fn = "nn.TransformerBlock"

    def __init__(self, embed_dim: int, num_heads: int, ffn_dim: int, causal: bool = True,
                 dtype=None, device=None):
        super().__init__()
        e, self.num_heads, f = _block_sizes(self._fn, embed_dim, num_heads, ffn_dim)
        self.embed_dim, self.ffn_dim = e, f
        self.causal = F._bool(self._fn, "causal", causal)
        kw = dict(device=device, dtype=dtype)
        self.ln1, self.qkv, self.proj = nn.LayerNorm(e, **kw), nn.Linear(e, 3 * e, **kw), \
            nn.Linear(e, e, **kw)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(e, **kw), nn.Linear(e, f, **kw), \
            nn.Linear(f, e, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            what = f"<tensor shape={tuple(x.shape)}>" if isinstance(x, torch.Tensor) \
                else type(x).__name__
            raise arg_error(self._fn, "x", what, f"must be a (batch, sequence, {self.embed_dim}) "
                            "tensor", "pass the activations as (B, S, embed_dim)")
        return _block_forward(self, x, self.num_heads)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}"


def _qkv_order(embed_dim: int, c: int) -> torch.Tensor:
    """The dense qkv rows in the 2D layer's order: block j of the output holds [q; k; v] of the
    heads of column j (rows ``part * E + j * E/c ...`` for part = q, k, v)."""
    w = embed_dim // c
    return torch.cat([torch.arange(w) + part * embed_dim + j * w
                      for j in range(c) for part in range(3)])


def _reorder_linear(lin: nn.Linear, rows: torch.Tensor, inverse: bool) -> nn.Linear:
    """``lin`` with its output rows permuted (``W[rows]``, or back with ``inverse``), gradients
    along (a new module on the meta device; the parameters are new tensors)."""
    out = nn.Linear(lin.in_features, lin.out_features, lin.bias is not None, device="meta",
                    dtype=lin.weight.dtype)

    def move(t):
        if not inverse:
            return t.detach()[rows].clone()
        back = torch.empty_like(t.detach())
        back[rows] = t.detach()
        return back

    for name in ("weight", "bias"):
        p = getattr(lin, name)
        if p is not None:
            q = nn.Parameter(move(p), requires_grad=p.requires_grad)
            if p.grad is not None:
                q.grad = move(p.grad)
            setattr(out, name, q)
    return out


class TransformerBlock2D(nn.Module):
    """:class:`TransformerBlock` on an (r, c) mesh: input and output ``(B/r, S, E/c)`` (the 2-D
    layout with dim 0 the batch). Attention is local to a rank: ``qkv = Linear2D(E, 3E)`` gives
    rank (i, j) the q, k, v of the heads of column j for its batch rows, attention runs on
    ``(B/r, heads/c, S, d)``, and ``proj = Linear2D(E, E)`` takes heads block j as its input
    features block j. LayerNorm2D, the MLP's Linear2D pair and the exact GELU do the rest.

    Args:
        embed_dim: E, must divide by num_heads and by lcm(r, c).
        num_heads: must divide by c (the heads of a column stay on it).
        ffn_dim: the MLP's width, must divide by lcm(r, c).
        mesh: a 2-D ``commlib.Mesh`` (r, c).
        causal: causal attention.
        overlap: the Linear2D layers' SUMMA overlap (default True).
    """

    _fn = "nn.TransformerBlock2D"

    def __init__(self, embed_dim: int, num_heads: int, ffn_dim: int, *, mesh, causal: bool = True,
                 overlap: bool = True, dtype=None, device=None):
        super().__init__()
        fn = self._fn
        self.grid = grid = grid_of(fn, mesh)
        e, h, f = _block_sizes(fn, embed_dim, num_heads, ffn_dim)
        self.causal = F._bool(fn, "causal", causal)
        self.overlap = F._bool(fn, "overlap", overlap)
        L = math.lcm(grid.r, grid.c)
        divisible(fn, "num_heads", "num_heads", h, grid.c,
                  f"the heads split over the mesh's {grid.c} columns")
        divisible(fn, "embed_dim", "embed_dim", e, L,
                  f"features split in {grid.c}, weight rows in {grid.r}, SUMMA panels of "
                  f"E/lcm({grid.r}, {grid.c})")
        divisible(fn, "ffn_dim", "ffn_dim", f, L,
                  f"fc2's input features split in {grid.c}, its weight rows in {grid.r}, SUMMA "
                  f"panels of ffn_dim/lcm({grid.r}, {grid.c})")
        self.embed_dim, self.num_heads, self.ffn_dim, self.mesh = e, h, f, mesh
        self._load(TransformerBlock(e, h, f, causal, dtype=dtype, device=device))

    def _load(self, dense: TransformerBlock) -> None:
        mesh, kw = self.mesh, dict(overlap=self.overlap)
        self.ln1 = LayerNorm2D.from_dense(dense.ln1, mesh)
        self.qkv = Linear2D.from_dense(
            _reorder_linear(dense.qkv, _qkv_order(self.embed_dim, self.grid.c), False), mesh, **kw)
        self.proj = Linear2D.from_dense(dense.proj, mesh, **kw)
        self.ln2 = LayerNorm2D.from_dense(dense.ln2, mesh)
        self.fc1 = Linear2D.from_dense(dense.fc1, mesh, **kw)
        self.fc2 = Linear2D.from_dense(dense.fc2, mesh, **kw)

    @classmethod
    def from_dense(cls, module: TransformerBlock, mesh, **options) -> "TransformerBlock2D":
        """This rank's blocks of ``module`` (the same :class:`TransformerBlock` on every rank;
        no communication, the parameters are copied), the qkv rows reordered so that column j
        gets its heads' q, k and v. ``options``: ``overlap``."""
        fn = cls._fn + ".from_dense"
        if not isinstance(module, TransformerBlock):
            raise arg_error(fn, "module", type(module).__name__,
                            "must be a commlib.nn.TransformerBlock",
                            "build the dense block as TransformerBlock(embed_dim, num_heads, "
                            "ffn_dim) and load its weights", CommTypeError)
        _options(fn, options, ("overlap",))
        layer = cls(module.embed_dim, module.num_heads, module.ffn_dim, mesh=mesh,
                    causal=module.causal, device="meta", dtype=module.qkv.weight.dtype, **options)
        layer._load(module)
        return layer

    def to_dense(self) -> TransformerBlock:
        """The dense :class:`TransformerBlock` on every rank (collective over the mesh), with
        ``.grad`` where this block's parameters have one."""
        dense = TransformerBlock(self.embed_dim, self.num_heads, self.ffn_dim, self.causal,
                                 dtype=self.qkv.weight.dtype, device="meta")
        for name in _PARTS:
            part = getattr(self, name).to_dense()
            if name == "qkv":
                part = _reorder_linear(part, _qkv_order(self.embed_dim, self.grid.c), True)
            setattr(dense, name, part)
        return dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = self._fn
        with checked_call(fn, self.grid.whole) as (_, call):
            _check_block(fn, "x", x, self.grid, self.embed_dim, self.qkv.weight.dtype)
            if x.dim() != 3:
                raise arg_error(fn, "x", f"<tensor shape={tuple(x.shape)}>",
                                f"must be this rank's (B/{self.grid.r}, S, "
                                f"{self.embed_dim}/{self.grid.c}) block: batch, sequence, features",
                                "pass 3-D activations (dim 0 the batch, split over the mesh rows)")
            call.update(shape=tuple(x.shape), dtype=str(x.dtype))
        return _block_forward(self, x, self.num_heads // self.grid.c)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"ffn_dim={self.ffn_dim}, causal={self.causal}, "
                f"mesh={self.grid.r}x{self.grid.c}")

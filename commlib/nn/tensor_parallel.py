"""Megatron-style 1D tensor-parallel layers: :class:`ColumnParallelLinear`,
:class:`RowParallelLinear` and :class:`ParallelMLP` (Shoeybi et al. 2019; sequence parallelism,
Korthikanti et al. 2022).

A layer's weight is split over the ranks of a group of N: by output features (column-parallel:
each rank holds ``out_features / N`` rows of ``W``, as ``nn.Linear`` stores it) or by input
features (row-parallel: ``in_features / N`` columns). A column-parallel layer followed by a
row-parallel one (:class:`ParallelMLP`) needs one collective forward and one backward, whatever
lies between them elementwise.

**Sequence parallelism** (``sequence_parallel=True``) follows Megatron's ``[s, b, h]``
convention: dim 0 of the activations is the sequence, and outside the column/row pair each rank
holds rows ``[r * s/N, (r + 1) * s/N)`` of it (``shard_sequence(x, dim=0, layout="contiguous")``);
the column layer all-gathers them and the row layer reduce-scatters back.

**Gradients** follow Megatron. A replicated output (row-parallel without sequence parallelism,
column-parallel with ``gather_output=True``) carries the same loss on every rank, counted once. A
sharded output (column-parallel: by features; row-parallel with sequence parallelism: by
sequence) carries one loss per rank and the total loss is their sum. Input gradients come back
in the input's own layout, and every parameter's ``.grad`` is the exact gradient of that total on
every rank holding it: no reduction is left to the user (the replicated bias of a
sequence-parallel row layer is summed over the group in backward, unlike Megatron, which leaves
it to the optimizer). :meth:`to_dense` therefore returns the dense module with the gradients the
dense model gets for the same total loss.

**Initialization.** Each rank draws the whole dense ``nn.Linear`` from its default generator and
keeps its shard: seed every rank alike (``torch.manual_seed``) and the layer is the shards of the
``nn.Linear`` the same seed gives (the row-parallel bias, replicated, must be the same everywhere).
Use :meth:`from_dense` to shard a given model without drawing.
"""

from __future__ import annotations

import torch
from torch import nn

import commlib
from commlib.api.groups import resolve_group
from commlib.compress.autograd import (BACKWARD, all_gather_fn, copy_fn, reduce_fn,
                                       reduce_scatter_fn)
from commlib.compress.codec import as_codec
from commlib.compress.collectives import ALGORITHMS
from commlib.errors import CommMismatchError, CommTypeError, arg_error

from . import functional as F

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP"]


def _positive(fn: str, arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise arg_error(fn, arg, value, "must be a positive int", f"pass {arg}=<int > 0>",
                        CommTypeError)
    return value


def _multiple(fn: str, arg: str, value: int, size: int, what: str) -> None:
    """``value`` (a feature count) must split into ``size`` equal shards."""
    if value % size:
        raise arg_error(fn, arg, value,
                        f"must be a multiple of the group size {size} ({what})",
                        f"choose {arg} divisible by {size} (e.g. {value + (-value) % size}), or a "
                        f"group whose size divides {value}")


def _options(fn: str, options: dict, allowed: tuple[str, ...]) -> None:
    """``from_dense``'s keywords: the layer's options, not what the dense module fixes."""
    for key in options:
        if key not in allowed:
            raise arg_error(fn, key, options[key],
                            f"is not an option of from_dense (the sizes, bias, dtype and device "
                            f"come from the dense module); options: {list(allowed)}",
                            "drop it, or build the dense module with it")


def _unshard(t: torch.Tensor, dim: int, g) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in rank order (a new tensor on every rank)."""
    t = t.detach()
    if g.size == 1:
        return t.clone()
    stacked = t.new_empty((g.size,) + tuple(t.shape))
    commlib.all_gather_into_tensor(stacked, t.contiguous(), group=g)
    return torch.cat(stacked.unbind(0), dim)


def _agree_on_grads(fn: str, g, params: list) -> list[bool]:
    """Which of ``params`` have a ``.grad``, checked equal on every rank (the gathers that follow
    would otherwise hang): one all-gather of a few flags; a mismatch raises on every rank."""
    mine = [p.grad is not None for p in params]
    if g.size == 1:
        return mine
    flags = torch.tensor(mine, dtype=torch.int64)
    table = flags.new_empty((g.size, len(mine)))
    commlib.all_gather_into_tensor(table, flags, group=g)
    if not bool((table == table[0]).all()):
        rows = "; ".join(f"rank {r}: {[bool(v) for v in row.tolist()]}"
                         for r, row in enumerate(table))
        raise CommMismatchError(f"commlib.{fn}(): ranks disagree on which parameters have a "
                                f".grad ({rows}). Fix: run the same backward on every rank of "
                                "the group before to_dense(), or zero_grad(set_to_none=True) on all")
    return mine


def _compress_options(fn: str, compress, backward, algorithm) -> tuple:
    """The ``compress=``, ``compress_backward=`` and ``compress_algorithm=`` of a layer, checked:
    (codec or None, backward or None, algorithm)."""
    if backward is not None and backward not in BACKWARD:
        raise arg_error(fn, "compress_backward", backward, f"must be None or one of {BACKWARD}",
                        "pass None (the layer's default), 'exact' or 'compressed'")
    if algorithm not in ALGORITHMS:
        raise arg_error(fn, "compress_algorithm", algorithm, f"must be one of {ALGORITHMS}",
                        "pass 'auto' (exact where compression does not pay) or 'compressed'")
    return (None if compress is None else as_codec(compress)), backward, algorithm


class _ShardedLinear(nn.Module):
    """What the column- and row-parallel layers share: argument checks, the shard of a dense
    ``nn.Linear`` (rows or columns of its weight), ``from_dense`` and ``to_dense``."""

    _fn = ""  # the layer's name in messages, e.g. "nn.ColumnParallelLinear"
    _shard_dim = 0  # the weight's dim split over the group (0: output rows, 1: input columns)
    _bias_sharded = True
    _from_dense_options: tuple[str, ...] = ()

    def _setup(self, in_features, out_features, bias, group, overlap, device, dtype,
               flags: dict) -> None:
        fn = self._fn
        in_features = _positive(fn, "in_features", in_features)
        out_features = _positive(fn, "out_features", out_features)
        bias = F._bool(fn, "bias", bias)
        self.overlap = F._bool(fn, "overlap", overlap)
        for name, value in flags.items():
            setattr(self, name, F._bool(fn, name, value))
        g = resolve_group(group, fn)
        if self._shard_dim == 0:
            _multiple(fn, "out_features", out_features, g.size,
                      f"each rank holds out_features/{g.size} rows of the weight")
        else:
            _multiple(fn, "in_features", in_features, g.size,
                      f"each rank holds in_features/{g.size} columns of the weight")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.group_size, self.group_rank = group, g.size, g.rank
        # nn.Linear's initialization, the same on every rank seeded alike; this rank keeps its
        # shard (a meta device draws nothing: from_dense)
        dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._load(dense)

    def _load(self, dense: nn.Linear) -> None:
        """Keep this rank's shard of ``dense``'s parameters (copies: the layer never aliases it)."""
        n = dense.weight.shape[self._shard_dim] // self.group_size
        w = dense.weight.detach().narrow(self._shard_dim, self.group_rank * n, n)
        self.weight = nn.Parameter(w.clone(), requires_grad=dense.weight.requires_grad)
        if dense.bias is None:
            self.register_parameter("bias", None)
        else:
            b = dense.bias.detach()
            if self._bias_sharded:
                b = b.narrow(0, self.group_rank * n, n)
            self.bias = nn.Parameter(b.clone(), requires_grad=dense.bias.requires_grad)

    @classmethod
    def from_dense(cls, module: nn.Linear, *, group=None, **options):
        """This rank's shard of ``module``, an ``nn.Linear`` that every rank of the group passes
        alike (no communication; the parameters are copied). ``options`` are the layer's keyword
        options (``overlap``, ``sequence_parallel``, ...); the sizes, bias, dtype and device are
        ``module``'s."""
        fn = cls._fn + ".from_dense"
        if not isinstance(module, nn.Linear):
            raise arg_error(fn, "module", type(module).__name__, "must be a torch.nn.Linear",
                            "pass the dense layer this one replaces", CommTypeError)
        _options(fn, options, cls._from_dense_options)
        layer = cls(module.in_features, module.out_features, module.bias is not None, group=group,
                    device="meta", dtype=module.weight.dtype, **options)
        layer._load(module)
        return layer

    def to_dense(self) -> nn.Linear:
        """The dense ``nn.Linear`` this layer is a shard of, on every rank (collective over the
        group: the shards are all-gathered), with each parameter's ``.grad`` gathered too where
        this layer's parameter has one; with this module's gradient convention those are the
        dense model's gradients of the same total loss."""
        fn = self._fn + ".to_dense"
        g = resolve_group(self.group, fn)
        params = [self.weight] + ([] if self.bias is None else [self.bias])
        has_grad = _agree_on_grads(fn, g, params)
        dense = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device="meta", dtype=self.weight.dtype)
        for name, p, grad in zip(("weight", "bias"), params, has_grad):
            dim = self._shard_dim if name == "weight" else 0
            sharded = name == "weight" or self._bias_sharded
            full = nn.Parameter(_unshard(p, dim, g) if sharded else p.detach().clone(),
                                requires_grad=p.requires_grad)
            if grad:
                full.grad = _unshard(p.grad, dim, g) if sharded else p.grad.detach().clone()
            setattr(dense, name, full)
        return dense

    def _compress(self, compress, backward, algorithm) -> None:
        self.compress, self.compress_backward, self.compress_algorithm = _compress_options(
            self._fn, compress, backward, algorithm)

    def extra_repr(self) -> str:
        flags = ", ".join(f"{k}={getattr(self, k)}" for k in self._from_dense_options)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}, {flags}")


class ColumnParallelLinear(_ShardedLinear):
    """``nn.Linear`` with its weight split by output features over a group of N ranks: rank r
    holds rows ``[r * out/N, (r + 1) * out/N)`` of the weight and of the bias.

    Args:
        in_features, out_features: the dense layer's sizes; ``out_features`` must divide by N.
        bias: a bias (sharded like the weight's rows).
        group: the tensor-parallel group (default: the world).
        gather_output: all-gather the output along the last dim, so every rank gets
            ``(..., out_features)`` (replicated: its loss counts once). Default: this rank's
            ``(..., out_features / N)`` (one loss per rank, summed).
        sequence_parallel: the input is this rank's sequence shard ``(s / N, ..., in_features)``
            (dim 0 is the sequence, rank r holds rows ``[r s/N, (r+1) s/N)``), all-gathered
            before the GEMM; the input gradient is reduce-scattered back to the shard. Default: the
            input ``(..., in_features)`` is replicated (the same on every rank); forward is an
            identity, and backward all-reduces the input gradient (Megatron's f).
        overlap: hide communication behind computation (the result is the same within float
            rounding): with sequence_parallel, the all-gather is pipelined with the GEMM
            (``commlib.overlap.all_gather_matmul``, whose autograd also pipelines the backward);
            without, the input gradient's all-reduce runs while the weight gradient is computed.
            ``False``: plain blocking collectives.
        compress: a codec (name or ``commlib.compress.Codec``) for the input's collectives:
            with sequence_parallel, the forward all-gather of the sequence shards
            (``commlib.compress.all_gather_fn``; its backward reduce-scatter is exact unless
            ``compress_backward="compressed"``); without, the input gradient's all-reduce in
            backward, the layer's only collective (``commlib.compress.copy_fn``; compressed unless
            ``compress_backward="exact"``, run as ``compress_algorithm`` says). ``overlap`` does
            not apply and ``gather_output`` stays exact. Default None: exact.
            float32/bfloat16/float16 layers only.
        compress_backward: None (the default above), ``"exact"`` or ``"compressed"``.
        compress_algorithm: the compressed all-reduce's (``commlib.compress.all_reduce``):
            ``"auto"`` stays exact where compression does not pay (on one host, always),
            ``"compressed"`` forces the codec.
        device, dtype: of the parameters (as ``nn.Linear``).

    Example (2 ranks, both seeded alike)::

        torch.manual_seed(0); dense = nn.Linear(6, 4)          # the model this layer shards
        layer = ColumnParallelLinear.from_dense(dense)         # rank r: dense.weight[2r:2r+2]
        y = layer(x)                                           # rank r: dense(x)[..., 2r:2r+2]
        ColumnParallelLinear.from_dense(dense, gather_output=True)(x)   # every rank: dense(x)
    """

    _fn = "nn.ColumnParallelLinear"
    _shard_dim = 0
    _bias_sharded = True
    _from_dense_options = ("gather_output", "sequence_parallel", "overlap", "compress",
                           "compress_backward", "compress_algorithm")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 overlap: bool = True, compress=None, compress_backward: str | None = None,
                 compress_algorithm: str = "auto", device=None, dtype=None):
        super().__init__()
        self._compress(compress, compress_backward, compress_algorithm)
        self._setup(in_features, out_features, bias, group, overlap, device, dtype,
                    {"gather_output": gather_output, "sequence_parallel": sequence_parallel})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = self._fn + ".forward"
        if self.compress is None or self.group_size == 1:
            return F._column_linear(fn, x, self.weight, self.bias, self.group,
                                    self.gather_output, self.sequence_parallel, self.overlap)
        g = resolve_group(self.group, fn)
        F._tp_input(fn, x, self.weight, self.in_features, "in_features", self.sequence_parallel,
                    g.size, False)
        if self.sequence_parallel:
            x = all_gather_fn(x, codec=self.compress, group=g,
                              backward=self.compress_backward or "exact")
        else:
            x = copy_fn(x, codec=self.compress, group=g,
                        backward=self.compress_backward or "compressed",
                        algorithm=self.compress_algorithm)
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return F._GatherLast.apply(y, g) if self.gather_output else y


class RowParallelLinear(_ShardedLinear):
    """``nn.Linear`` with its weight split by input features over a group of N ranks: rank r
    holds columns ``[r * in/N, (r + 1) * in/N)`` of the weight; the bias is replicated and added
    once, after the reduction.

    Args:
        in_features, out_features: the dense layer's sizes; ``in_features`` must divide by N.
        bias: a bias (the whole ``out_features``, the same on every rank).
        group: the tensor-parallel group (default: the world).
        input_is_parallel: the input is this rank's ``(..., in_features / N)`` features (e.g. a
            :class:`ColumnParallelLinear`'s output). ``False``: the input is the replicated
            ``(..., in_features)``, which the layer splits (its gradient is all-gathered back).
        sequence_parallel: the partial outputs are reduce-scattered along dim 0, the sequence
            (its length must divide by N): this rank gets rows ``[r s/N, (r+1) s/N)``, one loss
            per rank, summed. Default: all-reduced, every rank gets the whole output
            (Megatron's g; backward is an identity) and its loss counts once.
        overlap: hide communication behind computation (the same result within float rounding):
            with sequence_parallel, the GEMM is pipelined with the reduce-scatter
            (``commlib.overlap.matmul_reduce_scatter``); without, the GEMM is cut into
            ``overlap_chunks`` row chunks (dim 0 of the flattened input) and each chunk's
            all-reduce is posted as soon as it is computed, running while the next chunk's GEMM
            does. ``False``: one GEMM and one blocking collective.
        overlap_chunks: row chunks of that pipeline (default
            ``commlib.nn.functional.DEFAULT_OVERLAP_CHUNKS``, 4; fewer if there are fewer rows).
        compress: a codec (name or ``commlib.compress.Codec``) for the partial outputs'
            reduction: ``commlib.compress.reduce_fn`` (all-reduce, run as
            ``compress_algorithm`` says: ``"auto"`` stays exact where compression does not pay,
            ``"compressed"`` forces the codec; its backward is the identity) or, with
            sequence_parallel, ``commlib.compress.reduce_scatter_fn`` (always the codec; its
            backward all-gather is exact unless ``compress_backward="compressed"``). ``overlap``
            does not apply. Default None: exact. float32/bfloat16/float16 layers only.
        compress_backward: None (exact), ``"exact"`` or ``"compressed"``.
        compress_algorithm: see ``compress``.
        device, dtype: of the parameters (as ``nn.Linear``).

    Example (2 ranks, ``dense = nn.Linear(6, 4)`` the same on both)::

        layer = RowParallelLinear.from_dense(dense)            # rank r: dense.weight[:, 3r:3r+3]
        y = layer(x[..., 3 * rank:3 * rank + 3])               # every rank: dense(x)
        RowParallelLinear.from_dense(dense, input_is_parallel=False)(x)   # every rank: dense(x)
    """

    _fn = "nn.RowParallelLinear"
    _shard_dim = 1
    _bias_sharded = False
    _from_dense_options = ("input_is_parallel", "sequence_parallel", "overlap", "overlap_chunks",
                           "compress", "compress_backward", "compress_algorithm")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 overlap: bool = True, overlap_chunks: int | None = None, compress=None,
                 compress_backward: str | None = None, compress_algorithm: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        self.overlap_chunks = F._overlap_chunks(self._fn, overlap_chunks)
        self._compress(compress, compress_backward, compress_algorithm)
        self._setup(in_features, out_features, bias, group, overlap, device, dtype,
                    {"input_is_parallel": input_is_parallel, "sequence_parallel": sequence_parallel})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = self._fn + ".forward"
        if self.compress is None or self.group_size == 1:
            return F._row_linear(fn, x, self.weight, self.bias, self.group, self.input_is_parallel,
                                 self.sequence_parallel, self.overlap, self.overlap_chunks)
        g = resolve_group(self.group, fn)
        k = self.in_features // (g.size if self.input_is_parallel else 1)
        F._tp_input(fn, x, self.weight, k, "in_features (this rank's, if input_is_parallel)",
                    self.sequence_parallel, g.size, True)
        if not self.input_is_parallel:
            x = F._SplitLast.apply(x, g)
        y = torch.nn.functional.linear(x, self.weight)  # this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_fn(y, codec=self.compress, group=g,
                                  backward=self.compress_backward or "exact")
            return y if self.bias is None else F._SumBiasGrad.apply(y, self.bias, g)
        y = reduce_fn(y, codec=self.compress, group=g, algorithm=self.compress_algorithm)
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """The transformer's MLP, ``fc2(activation(fc1(x)))``, with ``fc1`` a
    :class:`ColumnParallelLinear` (hidden -> ffn, output kept sharded) and ``fc2`` a
    :class:`RowParallelLinear` (ffn -> hidden, input parallel): one all-reduce forward and one
    backward (or, with ``sequence_parallel``, one all-gather and one reduce-scatter each way).

    Args:
        hidden_size: the model width (input and output features).
        ffn_hidden_size: the inner width; must divide by the group size N.
        group: the tensor-parallel group (default: the world).
        activation: applied elementwise between the two (default ``torch.nn.functional.gelu``;
            any callable, e.g. an ``nn.Module``).
        bias: biases in both layers.
        sequence_parallel: the input and output are sequence shards ``(s / N, ..., hidden)``
            (Megatron's ``[s, b, h]``, rank r holds rows ``[r s/N, (r+1) s/N)``; the total
            length must divide by N). Default: input and output are replicated.
        overlap: as in both layers (see :class:`ColumnParallelLinear`, :class:`RowParallelLinear`).
        overlap_chunks: ``fc2``'s row chunks (see :class:`RowParallelLinear`).
        compress, compress_backward, compress_algorithm: passed to both layers (see
            :class:`ColumnParallelLinear` and :class:`RowParallelLinear`): with a codec and the
            defaults, each direction has one compressed collective (fc2's output reduction
            forward, fc1's input-gradient all-reduce backward; with sequence_parallel, fc1's
            all-gather and fc2's reduce-scatter forward, the backward exact unless
            ``compress_backward="compressed"``).
        device, dtype: of the parameters.

    Example (2 ranks, both seeded alike)::

        fc1, fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        mlp = ParallelMLP.from_dense(fc1, fc2)                  # rank r: 16 of the 32 inner features
        y = mlp(x)                                             # every rank: fc2(gelu(fc1(x)))
    """

    _fn = "nn.ParallelMLP"
    _from_dense_options = ("activation", "sequence_parallel", "overlap", "overlap_chunks",
                           "compress", "compress_backward", "compress_algorithm")

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, group=None,
                 activation=torch.nn.functional.gelu, bias: bool = True,
                 sequence_parallel: bool = False, overlap: bool = True,
                 overlap_chunks: int | None = None, compress=None,
                 compress_backward: str | None = None, compress_algorithm: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        fn = self._fn
        hidden_size = _positive(fn, "hidden_size", hidden_size)
        ffn_hidden_size = _positive(fn, "ffn_hidden_size", ffn_hidden_size)
        size = resolve_group(group, fn).size
        _multiple(fn, "ffn_hidden_size", ffn_hidden_size, size,
                  f"each rank holds ffn_hidden_size/{size} of the inner features")
        if not callable(activation):
            raise arg_error(fn, "activation", activation, "must be callable",
                            "pass a function such as torch.nn.functional.gelu, or an nn.Module",
                            CommTypeError)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.activation = activation
        compress_opts = {"compress": compress, "compress_backward": compress_backward,
                   "compress_algorithm": compress_algorithm}
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, group=group,
                                        sequence_parallel=sequence_parallel, overlap=overlap,
                                        device=device, dtype=dtype, **compress_opts)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias, group=group,
                                     sequence_parallel=sequence_parallel, overlap=overlap,
                                     overlap_chunks=overlap_chunks, device=device, dtype=dtype,
                                     **compress_opts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))

    @classmethod
    def from_dense(cls, fc1, fc2: nn.Linear | None = None, *, group=None, **options):
        """This rank's shards of a dense MLP that every rank passes alike (no communication):
        either its two ``nn.Linear`` layers, ``from_dense(fc1, fc2)``, or an
        ``nn.Sequential(fc1, activation, fc2)``, whose middle module becomes the activation
        (unless ``activation=`` is given). ``options``: ``activation`` (default gelu for two
        layers), ``sequence_parallel``, ``overlap``, ``overlap_chunks``, ``compress``,
        ``compress_backward``, ``compress_algorithm``."""
        fn = cls._fn + ".from_dense"
        _options(fn, options, cls._from_dense_options)
        if fc2 is None:
            if not (isinstance(fc1, nn.Sequential) and len(fc1) == 3
                    and isinstance(fc1[0], nn.Linear) and isinstance(fc1[2], nn.Linear)):
                raise arg_error(fn, "fc1", type(fc1).__name__,
                                "must be nn.Sequential(nn.Linear, activation, nn.Linear) when "
                                "fc2 is not given", "pass from_dense(fc1, fc2) with the two "
                                "nn.Linear layers", CommTypeError)
            options.setdefault("activation", fc1[1])
            fc1, fc2 = fc1[0], fc1[2]
        for arg, m in (("fc1", fc1), ("fc2", fc2)):
            if not isinstance(m, nn.Linear):
                raise arg_error(fn, arg, type(m).__name__, "must be a torch.nn.Linear",
                                "pass the MLP's two dense layers", CommTypeError)
        if (fc2.in_features, fc2.out_features) != (fc1.out_features, fc1.in_features) \
                or (fc1.bias is None) != (fc2.bias is None) or fc1.weight.dtype != fc2.weight.dtype:
            raise arg_error(fn, "fc2", f"<nn.Linear {fc2.in_features} -> {fc2.out_features}, "
                            f"bias={fc2.bias is not None}, {fc2.weight.dtype}>",
                            f"must map fc1's {fc1.out_features} features back to "
                            f"{fc1.in_features}, with a bias if and only if fc1 has one "
                            f"(bias={fc1.bias is not None}) and fc1's dtype {fc1.weight.dtype}",
                            "pass the MLP's two layers in order (hidden -> ffn, ffn -> hidden)")
        mlp = cls(fc1.in_features, fc1.out_features, group=group, bias=fc1.bias is not None,
                  device="meta", dtype=fc1.weight.dtype, **options)
        mlp.fc1._load(fc1)
        mlp.fc2._load(fc2)
        return mlp

    def to_dense(self) -> tuple[nn.Linear, nn.Linear]:
        """The dense ``(fc1, fc2)`` on every rank, gradients gathered where present (collective
        over the group; see :meth:`ColumnParallelLinear.to_dense`)."""
        return self.fc1.to_dense(), self.fc2.to_dense()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"group_size={self.fc1.group_size}, compress={self.fc1.compress}")


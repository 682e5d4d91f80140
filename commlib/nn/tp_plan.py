"""Plan tensor parallelism before running it: 1D (Megatron) over p ranks against 2D
(Optimus/SUMMA) over an r x c mesh, predicted per rank from commlib's own cost model.

    python -m commlib.nn.tp_plan --topology dgx1-v100 --nodes 8 --hidden 4096 --ffn 16384 \\
        --seq 2048 --batch 1,2,4,...,256
    python -m commlib.nn.tp_plan --local --tuning-file PATH --engine mpi --ranks 4 --hosts 2 \\
        --gflops 50 --hidden 512 --ffn 2048 --seq 128 --batch 1,2,4,...,64

For a described model (hidden H, FFN size F, heads n, tokens T = batch B x sequence S, operand size
s bytes) it predicts what one rank spends on one forward+backward: the time, the bytes it sends and
the activations it keeps for backward, for both schemes, and where 2D starts to win. Pure: nothing
here communicates; :func:`measure_gflops` is the only function that runs anything.

**The schedule** (what the layers of commlib.nn issue; :func:`mlp_schedule`,
:func:`block_schedule`). Bytes are *logical bytes sent by this rank*, the layers' traffic counter's
convention: a broadcast over g ranks costs its root (g-1)·n and the others 0; a reduce costs every
non-root n; an all-reduce 2(g-1)/g·n per rank (floored per call, as the counter does); an
all-gather of n bytes per rank (g-1)·n. On the mesh, rank (i, j) holds activation block
(T/r, H/c); its *row group* is the c ranks (i, ·), its *column group* the r ranks (·, j); L =
lcm(r, c).

``Linear2D(in, out)`` (weight block (out/c, in/r), bias block out/c), SUMMA in K panels of in/K
(K a multiple of L dividing in: by default the layers' own choice, :func:`summa_panels`; every
rank owns K/c of the X panels and K/r of the W panels, so the bytes do not depend on K)::

    forward   broadcast X panel (T/r x in/K) along the row, W panel (in/K x out/c) along the column,
              K times; sent s·[(c-1)·T·in/(r·c) + (r-1)·in·out/(r·c)]; 2·T·in·out/(r·c) flops
    backward  the same broadcasts, then reduce the dX panel along the row and the dW panel along the
              column to their owners, K times, and one all-reduce of the bias gradient (out/c) over
              the column; sent 2·s·[(c-1)·T·in/(r·c) + (r-1)·in·out/(r·c)]
              + floor(2(r-1)/r·(out/c)·s); 4·T·in·out/(r·c) flops
    saved     X's block, T/r·in/c elements

``LayerNorm2D(H)``: forward an all-gather along the row of 3 statistics per local token (mean, its
correction, M2; float32, float64 for float64 data: (c-1)·3·T/r·s_f bytes); backward an all-reduce
along the row of 2 statistics per local token and one of the
gamma+beta gradients (2·H/c elements) over the column. Saves its input block.

``1D`` over p ranks (no sequence parallelism): column-parallel layer (out/p), row-parallel layer
(in/p); each MLP and each attention block does one all-reduce of T·H·s forward (after the row
layer) and one backward (the column layer's input gradient); LayerNorm is replicated and free.

**Activation memory** (elements saved for backward per rank, times s; LayerNorm's per-token mean and
rstd, dropout masks and attention's log-sum-exp are not counted; residual adds save nothing)::

    MLP H->F->H   2D  T/r·H/c (fc1 input) + 2·T/r·F/c (GELU input, fc2 input)
                  1D  T·H (fc1 input, replicated) + 2·T·F/p
    block         2D  8·T·H/p + 2·T·F/p + A/p
                  1D  4·T·H + 4·T·H/p + 2·T·F/p + A/p

The block is pre-norm: LN1 -> qkv (H -> 3H) -> attention -> proj (H -> H) -> +x -> LN2 -> MLP -> +.
Its 2D terms are LN1 input, qkv input, q, k, v (3), proj input, LN2 input, fc1 input: 8 blocks of
T/r·H/c; its 1D terms are LN1 input, qkv input, LN2 input, fc1 input replicated (4·T·H) and q, k, v,
proj input sharded (4·T·H/p). ``A = B·n·S·S`` is the attention probabilities (the softmax output
that backward reads), counted when ``attention_scores=True`` (eager attention) and not for
flash-style attention that recomputes them. 2D holds heads n/c of sequences B/r (Optimus splits the
batch along mesh rows, so attention is local: B must be a multiple of r, n of c); 1D holds heads n/p
of every sequence.

**Time.** Each collective is priced by :func:`commlib.tuning.model.predict` on the group's table,
taking the cheapest algorithm as selection would (:class:`Machine`). GEMMs take flops / rate; the
block's attention (QK^T and PV: 4·T·S·H/p flops forward, twice that backward, no causal halving) is
a GEMM too; softmax, GELU, LayerNorm and other elementwise work are not counted. Without overlap a
layer costs its collectives plus its GEMMs. With overlap (2D: panel k+1's collectives are issued
before panel k's GEMM) a layer of K panels with per-panel collectives P and per-panel GEMM G costs
``P + (K-1)·max(P, G) + G`` forward; backward computes each panel's dW half before its dX half,
so only X's broadcast opens the pass exposed (W's travels during the dW half) and the last
panel's dX reduction closes it (dW's travels during the dX half): ``bx + (bw - G/2)+ + (K-1)·max(P,
G) + G + rx + (rw - G/2)+``. Plus whatever a layer issues once (bias and LayerNorm all-reduces,
exposed; the layer posts the bias all-reduce asynchronously, so this is a bound). A collective
running beside a GEMM slows it by the share of its time it keeps the cores busy (``busy``,
:data:`BusyShare`: B = Σ busy·t over a panel's collectives), so each overlapped slot costs
``max(P, G + B)`` and each half-GEMM window ``max(t - G/2, busy·t)``: with busy 1 (CPU ranks
inside one host, the cores copy) nothing is hidden, with 0 (a GPU's DMA) the formulas above.
1D's all-reduces sit on the critical path: overlap changes nothing there. A panel's row and column
collectives are added (taken as running one after the other, though they use different links).
commlib's model prices a broadcast and a reduce as a binomial tree, ceil(log2 g)·(α + nβ) (the
engine's own is priced as the best formula, and commlib has no pipelined one): NCCL's pipelined
ring broadcast takes about nβ, so on GPUs 2D's predictions are pessimistic by up to log2(g) on its
broadcasts and reduces.

**Machines.** A catalog cluster (:func:`catalog_machine`): ranks are placed host-major, as
``Mesh.from_topology`` places them, so the row group (last mesh dimension, consecutive ranks) stays
in a host while c <= GPUs per host, and the column group (stride c) spans hosts. A group inside one
host is priced on the whole host's ring bottleneck (``plan_machine``'s intra-host link, whatever
the group's size); a group spanning
hosts gets ``plan_machine``'s table for the whole cluster with its own ranks per host, and its
inter-host link shared by every group crossing at once (all column groups run their panels
together: min(stride, GPUs per host) streams share the host's rails). The GEMM rate of a catalog
GPU is :data:`GEMM_EFFICIENCY` of the datasheet's dense peak (:data:`PEAK_TFLOPS`), an assumption:
pass ``gflops`` (``--gflops``) for a measured one. "This machine" (:func:`local_machine`): the
tuning file ``bench/calibrate.py`` wrote (the entry of each group's shape, else the nearest size's
links and the file's measured link between hosts, as selection builds it) and a given GEMM rate
(``--gflops``, or :func:`measure_gflops`). On one host of CPU ranks the cores that compute also copy
the messages, so nothing is hidden: the overlapped prediction equals the plain one there. Between
hosts the link's ``busy`` is measured (``bench/calibrate.py``: a matmul loop beside the transfer,
every rank at once): on a real NIC little, on network namespaces sharing the cores much.

Example (one MLP, 2 x 2 mesh, T = 8, H = 4, F = 8, float32)::

    >>> p = predict_mlp(8, 4, 8, mesh=(2, 2), dtype_bytes=4, comm=lambda *a: 1e-6, gflops=1.0)
    >>> p.bytes_sent, p.activation_bytes
    (504, 160)
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from commlib.errors import CommArgumentError, CommConfigError, CommError, CommTypeError, arg_error
from commlib.overlap.costs import measure
from commlib.topology import load as load_topology
from commlib.tuning import calibration
from commlib.tuning.machine import plan_machine
from commlib.tuning.model import DEFAULT_LINKS, HOP_LATENCY_US, LinkCost, Table, predict
from commlib.tuning.selector import shared_link

from ._panels import summa_panels

__all__ = ["Comm", "Stage", "Prediction", "Row", "Machine", "CollectiveSeconds", "mlp_schedule",
           "block_schedule", "summa_panels", "predict_mlp", "predict_block", "compare", "crossover",
           "catalog_machine", "local_machine", "measure_gflops", "square_mesh", "PEAK_TFLOPS",
           "GEMM_EFFICIENCY", "CATALOG_GPU", "main"]

#: ``comm(collective, nbytes, group_size, stride) -> seconds``: one collective of ``nbytes`` (the
#: cost model's size: the buffer of a broadcast, reduce or all-reduce, the whole output of an
#: all-gather) on a group of ``group_size`` ranks that are ``stride`` apart in host-major order.
CollectiveSeconds = Callable[[str, int, int, int], float]
#: ``busy(group_size, stride) -> share``: the share of a collective's time on such a group during
#: which it keeps the ranks' cores busy, so that a GEMM running beside it is that much slower
#: (``Machine.busy_share``: 1 for CPU ranks inside one host, whose cores do the copies; measured
#: for the links between hosts; 0 for GPUs, whose copies are DMA). None: 0 everywhere.
BusyShare = Callable[[int, int], float]

# Datasheet dense peaks, TFLOP/s per GPU, by operand type (NVIDIA's V100 SXM2, A100, H100 SXM5 and
# A10 datasheets; sparsity figures halved). V100 has no bfloat16 tensor cores.
PEAK_TFLOPS = {
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
}
#: The share of that peak a large GEMM is assumed to reach (cuBLAS reaches 70-90% on large square
#: GEMMs; a transformer layer's GEMMs are smaller, so the low end). An assumption, not a measurement.
GEMM_EFFICIENCY = 0.7
#: The GPU of each catalog system (its source line in commlib/topology/catalog names it); the PCIe
#: consumer boxes (1080 Ti, K80) have no entry: pass ``gflops``.
CATALOG_GPU = {
    "dgx1-v100": "V100", "dgx1-v100-pcie": "V100", "azure-ndv2": "V100",
    "aws-p4d": "A100", "azure-ncv4": "A100", "azure-ndv4": "A100", "dgx-a100": "A100",
    "hgx-a100-8-17nic": "A100",
    "aws-p5": "H100", "azure-ndv5": "H100", "hgx-h100-8": "H100", "ibm-hgx-h100-vsi": "H100",
    "pcie-4xa10": "A10",
}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_STAT_BYTES = 4  # LayerNorm2D exchanges its per-token statistics in float32 (float64 data: 8)


# --------------------------------------------------------------------------------------------
# The schedule: what each layer issues and computes, per rank
# --------------------------------------------------------------------------------------------

class Comm(NamedTuple):
    """``count`` collectives of ``nbytes`` each (a rank's buffer; for all_gather its own part) on
    ``axis`` (``"row"``: c ranks, ``"col"``: r ranks, ``"tp"``: the 1D group of p), of which this
    rank sends ``sent`` logical bytes in all."""
    collective: str
    axis: str
    nbytes: int
    count: int
    sent: int


class Stage(NamedTuple):
    """One layer's forward or backward on one rank: its GEMM ``flops``, the collectives it issues
    per panel (``pipelined``, all with the same count: the panels, overlapped with the GEMMs when
    the layer overlaps) and once (``exposed``), and the elements it saves for backward."""
    layer: str
    phase: str
    flops: int
    pipelined: tuple = ()
    exposed: tuple = ()
    saved: int = 0


class Prediction(NamedTuple):
    """Per rank, one forward+backward: ``seconds`` (with overlap where asked), ``comm_seconds``
    (every collective, hidden or not), ``compute_seconds`` (GEMMs), ``bytes_sent`` (logical, the
    exact closed form) and ``activation_bytes`` (saved for backward: the peak, at the end of
    forward)."""
    seconds: float
    comm_seconds: float
    compute_seconds: float
    bytes_sent: int
    activation_bytes: int


def _all_reduce_sent(g: int, n: int) -> int:
    return 2 * (g - 1) * n // g


class _Layout(NamedTuple):
    p: int
    r: int  # 0 for 1D
    c: int
    panels: int | None = None  # 2D: SUMMA panels of every Linear2D (None: the layers' default)

    @property
    def two_d(self) -> bool:
        return self.r > 0

    def group(self, axis: str) -> tuple[int, int]:
        """(ranks, stride in host-major order) of a group along ``axis``."""
        return {"row": (self.c, 1), "col": (self.r, self.c), "tp": (self.p, 1)}[axis]

    def describe(self) -> str:
        return f"2D {self.r}x{self.c}" if self.two_d else f"1D p={self.p}"


def _int(fn: str, arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise arg_error(fn, arg, value, "must be an int", f"pass {arg}=<int > 0>", CommTypeError)
    if value <= 0:
        raise arg_error(fn, arg, value, "must be positive", f"pass {arg}=<int > 0>")
    return value


def _layout(fn: str, p, mesh, panels=None) -> _Layout:
    if panels is not None:
        _int(fn, "panels", panels)
    if mesh is None:
        if p is None:
            raise arg_error(fn, "p", None, "neither p nor mesh is given",
                            "pass p=N for 1D over N ranks, or mesh=(r, c) for 2D")
        return _Layout(_int(fn, "p", p), 0, 0)
    if not isinstance(mesh, (tuple, list)) or len(mesh) != 2:
        raise arg_error(fn, "mesh", mesh, "must be a pair (r, c)", "pass e.g. mesh=(8, 8)",
                        CommTypeError)
    r, c = _int(fn, "mesh", mesh[0]), _int(fn, "mesh", mesh[1])
    if p is not None and _int(fn, "p", p) != r * c:
        raise arg_error(fn, "mesh", tuple(mesh), f"has r*c = {r * c} ranks but p = {p}",
                        f"pass a mesh whose product is {p}, e.g. {square_mesh(p)}, or p={r * c}")
    return _Layout(r * c, r, c, panels)


def _multiple(fn: str, arg: str, value: int, parts: int, why: str) -> None:
    if value % parts:
        raise arg_error(fn, arg, value, f"is not a multiple of {parts} ({why})",
                        f"use a multiple of {parts} (e.g. {value + (-value) % parts}) or another "
                        f"rank count or mesh")


def _check_shapes(fn: str, lay: _Layout, tokens: int, features: dict[str, int]) -> None:
    """Every feature size must split the way the layout cuts it; tokens split over mesh rows."""
    if lay.two_d:
        lcm = math.lcm(lay.r, lay.c)
        for arg, size in features.items():
            _multiple(fn, arg, size, lcm, f"lcm(r, c) = {lcm}: SUMMA cuts it into {lcm} panels of "
                                          f"a {lay.r}x{lay.c} mesh")
        _multiple(fn, "tokens", tokens, lay.r, f"the {lay.r} mesh rows each hold T/r tokens")
        if lay.panels is not None:
            _multiple(fn, "panels", lay.panels, lcm, f"every rank owns whole panels of a "
                                                      f"{lay.r}x{lay.c} mesh's blocks")
            for arg, size in features.items():
                if size % lay.panels:
                    raise arg_error(fn, "panels", lay.panels, f"does not divide {arg} = {size}",
                                    "pass panels dividing every layer's input features, or None")
    else:
        for arg, size in features.items():
            _multiple(fn, arg, size, lay.p, f"split over the {lay.p} ranks of the 1D group")


def _linear_2d(name: str, tokens: int, fan_in: int, fan_out: int, lay: _Layout,
               s: int) -> tuple[Stage, Stage]:
    """Linear2D(fan_in, fan_out)'s forward and backward stages (see the module docstring)."""
    r, c = lay.r, lay.c
    panels = summa_panels(r, c, fan_in, lay.panels)
    x_panel = tokens // r * (fan_in // panels) * s
    w_panel = fan_in // panels * (fan_out // c) * s
    x_sent = (c - 1) * (tokens // r) * (fan_in // c) * s          # s·(c-1)·T·in/(r·c)
    w_sent = (r - 1) * (fan_in // r) * (fan_out // c) * s         # s·(r-1)·in·out/(r·c)
    bx, bw = Comm("broadcast", "row", x_panel, panels, x_sent), Comm("broadcast", "col", w_panel,
                                                                     panels, w_sent)
    rx, rw = Comm("reduce", "row", x_panel, panels, x_sent), Comm("reduce", "col", w_panel, panels,
                                                                  w_sent)
    bias = fan_out // c * s
    db = Comm("all_reduce", "col", bias, 1, _all_reduce_sent(r, bias))
    flops = 2 * (tokens // r) * fan_in * (fan_out // c)
    return (Stage(name, "forward", flops, (bx, bw), (), tokens // r * (fan_in // c)),
            Stage(name, "backward", 2 * flops, (bx, bw, rx, rw), (db,)))


def _layer_norm_2d(name: str, tokens: int, hidden: int, lay: _Layout, s: int) -> tuple[Stage, Stage]:
    r, c = lay.r, lay.c
    sf = 8 if s == 8 else _STAT_BYTES  # statistics in float64 for float64, else float32
    moments = 3 * (tokens // r) * sf  # (mean, its correction, M2) per token
    stats = 2 * (tokens // r) * sf  # backward's two per-token sums
    params = 2 * (hidden // c) * s
    fwd = Stage(name, "forward", 0, (), (Comm("all_gather", "row", moments, 1, (c - 1) * moments),),
                tokens // r * (hidden // c))
    bwd = Stage(name, "backward", 0, (), (Comm("all_reduce", "row", stats, 1, _all_reduce_sent(c, stats)),
                                          Comm("all_reduce", "col", params, 1,
                                               _all_reduce_sent(r, params))))
    return fwd, bwd


def _linear_1d(name: str, tokens: int, fan_in: int, fan_out: int, lay: _Layout, s: int,
               kind: str) -> tuple[Stage, Stage]:
    """A column-parallel (input replicated, saved whole; backward all-reduces the input gradient)
    or row-parallel (input sharded; forward all-reduces the output) layer over the 1D group."""
    p = lay.p
    flops = 2 * tokens * fan_in * fan_out // p
    act = tokens * fan_in * s if kind == "column" else tokens * fan_out * s
    ar = (Comm("all_reduce", "tp", act, 1, _all_reduce_sent(p, act)),)
    saved = tokens * fan_in if kind == "column" else tokens * fan_in // p
    return (Stage(name, "forward", flops, (), ar if kind == "row" else (), saved),
            Stage(name, "backward", 2 * flops, (), ar if kind == "column" else ()))


def _mlp_stages(tokens: int, hidden: int, ffn: int, lay: _Layout, s: int) -> list[tuple[Stage, Stage]]:
    if lay.two_d:
        gelu = Stage("gelu", "forward", 0, saved=tokens // lay.r * (ffn // lay.c))
        return [_linear_2d("fc1", tokens, hidden, ffn, lay, s), (gelu, None),
                _linear_2d("fc2", tokens, ffn, hidden, lay, s)]
    gelu = Stage("gelu", "forward", 0, saved=tokens * ffn // lay.p)
    return [_linear_1d("fc1", tokens, hidden, ffn, lay, s, "column"), (gelu, None),
            _linear_1d("fc2", tokens, ffn, hidden, lay, s, "row")]


def _in_order(pairs: list[tuple[Stage, Stage | None]]) -> list[Stage]:
    """Forward stages in order, then backward stages in reverse."""
    return [f for f, _ in pairs] + [b for _, b in reversed(pairs) if b is not None]


def mlp_schedule(tokens: int, hidden: int, ffn: int, *, p: int | None = None,
                 mesh: tuple[int, int] | None = None, dtype_bytes: int = 2,
                 panels: int | None = None) -> list[Stage]:
    """The stages of one MLP (H -> F -> GELU -> H) forward and backward on one rank: 1D over ``p``
    ranks, or 2D over ``mesh`` = (r, c) with ``panels`` SUMMA panels per layer (None: the
    layers' default, :func:`summa_panels`). ``tokens`` = batch x sequence."""
    fn = "nn.tp_plan.mlp_schedule"
    lay = _layout(fn, p, mesh, panels)
    tokens, hidden, ffn = _int(fn, "tokens", tokens), _int(fn, "hidden", hidden), _int(fn, "ffn", ffn)
    s = _int(fn, "dtype_bytes", dtype_bytes)
    _check_shapes(fn, lay, tokens, {"hidden": hidden, "ffn": ffn} if lay.two_d else {"ffn": ffn})
    return _in_order(_mlp_stages(tokens, hidden, ffn, lay, s))


def block_schedule(batch: int, seq: int, hidden: int, ffn: int, heads: int, *, p: int | None = None,
                   mesh: tuple[int, int] | None = None, dtype_bytes: int = 2,
                   attention_scores: bool = True, panels: int | None = None) -> list[Stage]:
    """The stages of one pre-norm transformer block (attention, then the MLP) forward and
    backward on one rank; ``attention_scores``: count the B·heads·S·S probabilities as saved;
    the rest as :func:`mlp_schedule`."""
    fn = "nn.tp_plan.block_schedule"
    lay = _layout(fn, p, mesh, panels)
    batch, seq = _int(fn, "batch", batch), _int(fn, "seq", seq)
    hidden, ffn, heads = _int(fn, "hidden", hidden), _int(fn, "ffn", ffn), _int(fn, "heads", heads)
    s = _int(fn, "dtype_bytes", dtype_bytes)
    _multiple(fn, "hidden", hidden, heads, f"{heads} heads of equal size")
    tokens = batch * seq
    # heads split along mesh columns (2D) or over the group (1D); 2D rows hold whole sequences
    head_parts, seq_parts = (lay.c, lay.r) if lay.two_d else (lay.p, 1)
    _multiple(fn, "heads", heads, head_parts, f"split over {head_parts} "
              f"{'mesh columns' if lay.two_d else 'ranks'}")
    if lay.two_d:
        _multiple(fn, "batch", batch, lay.r, f"the {lay.r} mesh rows each hold whole sequences, "
                                             f"so attention needs no communication")
    _check_shapes(fn, lay, tokens, {"hidden": hidden, "ffn": ffn})
    local_heads, local_batch = heads // head_parts, batch // seq_parts
    attn_flops = 4 * local_batch * local_heads * seq * seq * (hidden // heads)  # QK^T and PV
    qkv_saved = 3 * local_batch * seq * local_heads * (hidden // heads)
    scores = local_batch * local_heads * seq * seq if attention_scores else 0
    attention = (Stage("attention", "forward", attn_flops, saved=qkv_saved + scores),
                 Stage("attention", "backward", 2 * attn_flops))
    if lay.two_d:
        pairs = [_layer_norm_2d("ln1", tokens, hidden, lay, s),
                 _linear_2d("qkv", tokens, hidden, 3 * hidden, lay, s), attention,
                 _linear_2d("proj", tokens, hidden, hidden, lay, s),
                 _layer_norm_2d("ln2", tokens, hidden, lay, s)]
    else:
        pairs = [(Stage("ln1", "forward", 0, saved=tokens * hidden), None),
                 _linear_1d("qkv", tokens, hidden, 3 * hidden, lay, s, "column"), attention,
                 _linear_1d("proj", tokens, hidden, hidden, lay, s, "row"),
                 (Stage("ln2", "forward", 0, saved=tokens * hidden), None)]
    return _in_order(pairs + _mlp_stages(tokens, hidden, ffn, lay, s))


# --------------------------------------------------------------------------------------------
# Pricing a schedule
# --------------------------------------------------------------------------------------------

def _seconds(c: Comm, lay: _Layout, comm: CollectiveSeconds) -> float:
    size, stride = lay.group(c.axis)
    if size == 1:
        return 0.0
    nbytes = c.nbytes * size if c.collective == "all_gather" else c.nbytes
    return float(comm(c.collective, nbytes, size, stride))


def _busy(c: Comm, lay: _Layout, comm: CollectiveSeconds, busy: BusyShare | None) -> float:
    """The seconds of ``c`` during which it keeps the cores busy (what a GEMM beside it loses)."""
    size, stride = lay.group(c.axis)
    return 0.0 if busy is None or size == 1 else busy(size, stride) * _seconds(c, lay, comm)


def _ends(st: Stage, lay: _Layout, comm: CollectiveSeconds, busy: BusyShare | None, gemm: float,
          per_panel: float) -> float:
    """The exposed ends of an overlapped SUMMA pass: the first panel's collectives before its
    GEMM; in backward (broadcasts X, W, reductions dX, dW: ``_linear_2d``) the dW half of a
    panel's GEMM needs only X's panel, so W's travels during it, and the last panel's dW
    reduction during its dX half: ``bx + max(bw - G/2, busy(bw))`` ahead, ``rx + max(rw - G/2,
    busy(rw))`` behind (a transfer beside a GEMM costs at least the cores it keeps busy)."""
    if st.phase != "backward" or len(st.pipelined) != 4:
        return per_panel
    bx, bw, rx, rw = (_seconds(c, lay, comm) for c in st.pipelined)
    lost_w, lost_r = (_busy(c, lay, comm, busy) for c in st.pipelined[1::2])
    return bx + max(0.0, bw - gemm / 2, lost_w) + rx + max(0.0, rw - gemm / 2, lost_r)


def _price(stages: list[Stage], lay: _Layout, s: int, comm: CollectiveSeconds, gflops: float,
           overlap: bool, busy: BusyShare | None = None, times: int = 1) -> Prediction:
    total = comm_total = compute_total = 0.0
    sent = saved = 0
    rate = gflops * 1e9
    for st in stages:
        per_panel = sum(_seconds(c, lay, comm) for c in st.pipelined)
        once = sum(c.count * _seconds(c, lay, comm) for c in st.exposed)
        panels = st.pipelined[0].count if st.pipelined else 0
        compute = st.flops / rate
        if overlap and panels:
            gemm = compute / panels
            lost = sum(_busy(c, lay, comm, busy) for c in st.pipelined)  # the GEMM beside them
            body = (_ends(st, lay, comm, busy, gemm, per_panel)
                    + (panels - 1) * max(per_panel, gemm + lost) + gemm)
        else:
            body = panels * per_panel + compute
        total += body + once
        comm_total += panels * per_panel + once
        compute_total += compute
        sent += sum(c.sent for c in st.pipelined + st.exposed)
        saved += st.saved
    return Prediction(times * total, times * comm_total, times * compute_total, times * sent,
                      times * saved * s)


def _check_gflops(fn: str, gflops) -> None:
    if isinstance(gflops, bool) or not isinstance(gflops, (int, float)) or not gflops > 0:
        raise arg_error(fn, "gflops", gflops, "must be a positive GEMM rate in GFLOP/s",
                        "pass machine.gflops, or measure_gflops(dtype)")


def _check_pricing(fn: str, comm, gflops) -> None:
    if not callable(comm):
        raise arg_error(fn, "comm", comm, "must be a function (collective, nbytes, ranks, stride) "
                        "-> seconds", "pass machine.collective_seconds (catalog_machine or "
                        "local_machine)", CommTypeError)
    _check_gflops(fn, gflops)


def predict_mlp(tokens: int, hidden: int, ffn: int, *, p: int | None = None,
                mesh: tuple[int, int] | None = None, dtype_bytes: int = 2,
                comm: CollectiveSeconds, gflops: float, overlap: bool = True,
                panels: int | None = None, busy: BusyShare | None = None) -> Prediction:
    """One MLP's forward+backward per rank, 1D over ``p`` ranks or 2D over ``mesh`` = (r, c)
    (both given: r·c must be p). ``comm`` prices one collective (``Machine.collective_seconds``),
    ``gflops`` is the GEMM rate per rank; ``overlap``: 2D pipelines its panels' collectives with
    the GEMMs; ``panels``: SUMMA panels per layer (None: the layers' default); ``busy``: the
    cores' share of each group's collectives (``Machine.busy_share``), what overlap cannot hide."""
    fn = "nn.tp_plan.predict_mlp"
    _check_pricing(fn, comm, gflops)
    stages = mlp_schedule(tokens, hidden, ffn, p=p, mesh=mesh, dtype_bytes=dtype_bytes,
                          panels=panels)
    return _price(stages, _layout(fn, p, mesh), dtype_bytes, comm, gflops, overlap, busy)


def predict_block(batch: int, seq: int, hidden: int, ffn: int, heads: int, *, p: int | None = None,
                  mesh: tuple[int, int] | None = None, dtype_bytes: int = 2,
                  comm: CollectiveSeconds, gflops: float, overlap: bool = True, layers: int = 1,
                  attention_scores: bool = True, panels: int | None = None,
                  busy: BusyShare | None = None) -> Prediction:
    """``layers`` pre-norm transformer blocks' forward+backward per rank (everything times
    ``layers``: every block saves its activations until backward). Arguments as
    :func:`predict_mlp`; ``attention_scores``: count the attention probabilities as saved (eager
    attention) or not (flash-style)."""
    fn = "nn.tp_plan.predict_block"
    _check_pricing(fn, comm, gflops)
    layers = _int(fn, "layers", layers)
    stages = block_schedule(batch, seq, hidden, ffn, heads, p=p, mesh=mesh, dtype_bytes=dtype_bytes,
                            attention_scores=attention_scores, panels=panels)
    return _price(stages, _layout(fn, p, mesh), dtype_bytes, comm, gflops, overlap, busy, layers)


# --------------------------------------------------------------------------------------------
# Sweeps and the crossover
# --------------------------------------------------------------------------------------------

class Row(NamedTuple):
    """One batch size: 1D, 2D without and with overlap (None where the mesh cannot hold the
    batch: 2D blocks need the batch to be a multiple of r)."""
    batch: int
    tokens: int
    one_d: Prediction
    two_d: Prediction | None
    two_d_overlap: Prediction | None

    def winner(self) -> str:
        best = self.two_d_overlap
        return "1D" if best is None or best.seconds >= self.one_d.seconds else "2D"


def compare(batches: Sequence[int], *, seq: int, hidden: int, ffn: int, mesh: tuple[int, int],
            p: int | None = None, heads: int | None = None, model: str = "block",
            dtype_bytes: int = 2, comm: CollectiveSeconds, gflops: float, overlap: bool = True,
            layers: int = 1, attention_scores: bool = True,
            panels: int | None = None, busy: BusyShare | None = None) -> list[Row]:
    """1D over p = r·c ranks against 2D over ``mesh`` = (r, c) for each batch of ``batches``
    (tokens = batch·seq), for ``model`` ``"block"`` (needs ``heads``) or ``"mlp"``. ``overlap``:
    whether the machine can hide 2D's collectives behind its GEMMs at all; ``busy`` as
    :func:`predict_mlp`."""
    fn = "nn.tp_plan.compare"
    lay = _layout(fn, p, mesh)
    if not lay.two_d:
        raise arg_error(fn, "mesh", mesh, "is needed: compare sets 2D on it against 1D over r*c",
                        f"pass mesh=(r, c), e.g. {square_mesh(lay.p)}")
    if model not in ("block", "mlp"):
        raise arg_error(fn, "model", model, "is not a model this planner describes",
                        "pass model='block' or model='mlp'")
    if model == "block" and heads is None:
        raise arg_error(fn, "heads", heads, "is needed for model='block'", "pass heads=<int>")
    if not batches:
        raise arg_error(fn, "batches", batches, "is empty", "pass e.g. [1, 2, 4, 8]")
    batches = sorted({_int(fn, "batches", b) for b in batches})

    def run(b: int, **kw) -> Prediction:
        if model == "mlp":
            return predict_mlp(b * seq, hidden, ffn, dtype_bytes=dtype_bytes, comm=comm,
                               gflops=gflops, busy=busy, **kw)
        return predict_block(b, seq, hidden, ffn, heads, dtype_bytes=dtype_bytes, comm=comm,
                             gflops=gflops, layers=layers, attention_scores=attention_scores,
                             busy=busy, **kw)

    rows = []
    for b in batches:
        one = run(b, p=lay.p)
        holds = (b * seq if model == "mlp" else b) % lay.r == 0
        two = run(b, mesh=(lay.r, lay.c), overlap=False, panels=panels) if holds else None
        ovl = run(b, mesh=(lay.r, lay.c), overlap=overlap, panels=panels) if holds else None
        rows.append(Row(b, b * seq, one, two, ovl))
    return rows


def crossover(rows: Sequence[Row], *, metric: str = "seconds", overlap: bool = True) -> Row | None:
    """The first row from which 2D beats 1D on ``metric`` (``"seconds"`` or
    ``"activation_bytes"``) at it and at every later row 2D can run (``overlap``: 2D's overlapped
    time), or None when 2D does not stay ahead by the last row."""
    if metric not in ("seconds", "activation_bytes"):
        raise arg_error("nn.tp_plan.crossover", "metric", metric, "is not a predicted quantity",
                        "pass metric='seconds' or metric='activation_bytes'")
    found = None
    for row in rows:
        two = row.two_d_overlap if overlap else row.two_d
        if two is None:
            continue
        if getattr(two, metric) < getattr(row.one_d, metric):
            found = found or row
        else:
            found = None
    return found


def square_mesh(p: int) -> tuple[int, int]:
    """The mesh (r, c) with r·c = p closest to square, r >= c (so rows of c ranks stay in a
    host): 64 -> (8, 8), 128 -> (16, 8), 6 -> (3, 2)."""
    c = max(d for d in range(1, math.isqrt(p) + 1) if p % d == 0)
    return p // c, c


# --------------------------------------------------------------------------------------------
# Machines
# --------------------------------------------------------------------------------------------

def _placement(size: int, stride: int, per_host: int) -> tuple[int, int | None]:
    """(hosts spanned, ranks per host or None if uneven) of a group of ``size`` ranks ``stride``
    apart, ranks placed host-major with ``per_host`` each."""
    counts = collections.Counter(stride * m // per_host for m in range(size))
    local = set(counts.values())
    return len(counts), (local.pop() if len(local) == 1 else None)


@dataclass
class Machine:
    """A described machine: how many ranks, how fast each multiplies (``gflops``, and where the
    figure comes from), whether communication can hide behind computation, the cost model's
    :class:`~commlib.tuning.model.Table` for a group of (ranks, stride), and (``cores_copy``) whether
    the ranks' own cores do the copies inside a host (CPU ranks: a collective there hides nothing)."""

    name: str
    ranks: int
    ranks_per_host: int
    gflops: float
    gflops_source: str
    hides_comm: bool
    table_of: Callable[[int, int], Table]
    cores_copy: bool = False
    _memo: dict = field(default_factory=dict, repr=False)

    def busy_share(self, size: int, stride: int = 1) -> float:
        """:data:`BusyShare`: the share of a collective's time on ``size`` ranks ``stride`` apart
        during which it keeps the cores busy: 1 inside one host when the cores copy, else the
        ``busy`` of the link the group crosses hosts on (measured by ``bench/calibrate.py``; 0
        in the catalog: DMA)."""
        hosts, _ = _placement(size, stride, self.ranks_per_host)
        if hosts == 1:
            return 1.0 if self.cores_copy else 0.0
        return self.table_of(size, stride).inter.busy

    def collective_seconds(self, collective: str, nbytes: int, size: int, stride: int = 1) -> float:
        """The cheapest algorithm's predicted time (as selection picks) of ``collective`` of
        ``nbytes`` on ``size`` ranks ``stride`` apart (:data:`CollectiveSeconds`)."""
        key = (collective, nbytes, size, stride)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = predict(collective, nbytes, size,
                                            self.table_of(size, stride))[0].seconds
        return hit

    def group_note(self, size: int, stride: int) -> str:
        hosts, local = _placement(size, stride, self.ranks_per_host)
        if hosts == 1:
            return f"{size} ranks in one host"
        return f"{size} ranks over {hosts} hosts, {local or 'uneven'} per host"


def _gemm_rate(fn: str, system: str, dtype: str) -> tuple[float, str]:
    gpu = CATALOG_GPU.get(system)
    if gpu is None:
        raise arg_error(fn, "gflops", None, f"{system}'s GPU has no assumed GEMM rate here",
                        f"pass gflops (--gflops) for {system}'s GPUs")
    peak = PEAK_TFLOPS[gpu].get(dtype)
    if peak is None:
        raise arg_error(fn, "dtype", dtype, f"{gpu} has no {dtype} rate (no such tensor cores)",
                        f"use one of {sorted(PEAK_TFLOPS[gpu])} or pass gflops")
    return peak * GEMM_EFFICIENCY * 1e3, (f"assumed: {GEMM_EFFICIENCY:.0%} of {gpu} {dtype} dense "
                                          f"peak {peak:g} TFLOP/s")


def catalog_machine(system, nodes: int = 1, *, dtype: str = "fp16", gflops: float | None = None,
                    nics_per_host: int | None = None, nic_gbps: float | None = None) -> Machine:
    """``nodes`` hosts of catalog ``system`` (a name, or a :class:`~commlib.topology.Topology`),
    priced with ``plan_machine``'s links; GEMMs at ``gflops`` or the assumed rate of the system's
    GPU for ``dtype`` (:data:`PEAK_TFLOPS` x :data:`GEMM_EFFICIENCY`)."""
    fn = "nn.tp_plan.catalog_machine"
    if dtype not in DTYPE_BYTES:
        raise arg_error(fn, "dtype", dtype, "is not a GEMM operand type", f"use one of {list(DTYPE_BYTES)}")
    plan = plan_machine(system, nodes, nics_per_host, nic_gbps)
    if gflops is None:
        gflops, source = _gemm_rate(fn, plan.name, dtype)
    else:
        _check_gflops(fn, gflops)
        source = "given"
    g, whole = plan.gpus_per_host, plan.table

    def table_of(size: int, stride: int) -> Table:
        hosts, local = _placement(size, stride, g)
        if hosts == 1:
            return Table(whole.link, local=size, base=whole.base)
        # every group with a member on a host crosses its boundary at once: they share its rails
        streams = min(stride, g)
        inter = whole.inter if streams == 1 else LinkCost.from_bandwidth(
            HOP_LATENCY_US["NET"], min(plan.rails * plan.rail_gbps / streams, plan.intra_gbps))
        return Table(whole.link, local=local, inter=inter, base=whole.base,
                     shard_inter=whole.shard_inter)

    return Machine(plan.describe(), plan.ranks, g, float(gflops), source, True, table_of)


def local_machine(tuning_file, engine: str, ranks: int, hosts: int = 1, *,
                  gflops: float) -> Machine:
    """This machine as ``bench/calibrate.py`` measured it: ``ranks`` ranks of ``engine`` on
    ``hosts`` hosts (host-major), priced from the tuning file at ``tuning_file`` (None: the
    configured one, ``COMMLIB_TUNING_FILE`` or the per-host cache); GEMMs at ``gflops`` per rank
    (:func:`measure_gflops` measures one process: with k ranks sharing a host's cores, give each
    its share). A group's table is its shape's entry (``mpi/4@2``), else the nearest size's links
    on one host and the file's measured link between hosts (``net``; ``net_rails`` when several
    groups cross at once), as selection builds it."""
    fn = "nn.tp_plan.local_machine"
    ranks, hosts = _int(fn, "ranks", ranks), _int(fn, "hosts", hosts)
    _multiple(fn, "ranks", ranks, hosts, f"the same number of ranks on each of {hosts} hosts")
    _check_gflops(fn, gflops)
    doc = calibration.load(tuning_file)
    path = tuning_file or calibration.tuning_path()
    if doc is None:
        raise CommConfigError(f"commlib.nn.tp_plan: no tuning file at {path}. Fix: run "
                              f"`mpirun -n {ranks} python bench/calibrate.py` or pass --tuning-file")
    per_host = ranks // hosts
    groups = doc.get("groups", {})

    def net_links(size: int, spanned: int) -> dict[str, LinkCost]:
        """The measured links between hosts: the group's own entry's, else another entry of this
        engine across hosts (this many hosts first). ``net_rails`` (every local rank's pair
        crossing at once) only from an entry with this job's ranks per host: it is the sharing
        of the host's link by that many streams, and one rank per host has none."""
        keys = [calibration.entry_key(engine, size, spanned)] + sorted(
            (k for k in groups if k.split("/")[0] == engine and "@" in k),
            key=lambda k: (not k.endswith(f"@{hosts}"), k))
        out: dict[str, LinkCost] = {}
        for key in keys:
            links = groups.get(key, {}).get("links", {})
            size_k, hosts_k = (int(v) for v in key.rsplit("/", 1)[1].split("@"))
            for name in ("net", "net_rails"):
                same_sharing = name == "net" or size_k // hosts_k == per_host
                if name in links and name not in out and same_sharing:
                    out[name] = calibration.link_from_json(links[name])
        return out

    def table_of(size: int, stride: int) -> Table:
        spanned, local = _placement(size, stride, per_host)
        if spanned == 1:
            table = calibration.table_for(doc, engine, size)
        else:
            table = calibration.table_for(doc, engine, size, spanned)
            if table is None:
                intra = calibration.table_for(doc, engine, local or per_host)
                table = None if intra is None else Table(intra.link)
        if table is None:
            raise CommConfigError(
                f"commlib.nn.tp_plan: tuning file {path} has no entry for engine {engine!r} "
                f"usable by a group of {size} ranks on {spanned} host(s). Fix: run `mpirun -n "
                f"{size} python bench/calibrate.py` with that layout, or pass --engine as named "
                f"in the file ({sorted(doc.get('groups', {}))})")
        if spanned > 1:
            links = net_links(size, spanned)
            net = links.get("net", DEFAULT_LINKS["net"])
            rails = links.get("net_rails") or shared_link(net, per_host)
            table.local = local
            table.inter = net if min(stride, per_host) == 1 else rails
            table.shard_inter = rails
        return table

    source = "given"
    name = f"this machine: {ranks} {engine} ranks on {hosts} host(s), tuning file {path}"
    # CPU ranks: the cores that compute also copy the messages inside a host (overlap hides
    # nothing there); between hosts the link's measured busy share
    return Machine(name, ranks, per_host, float(gflops), source, hosts > 1, table_of, True)


def measure_gflops(dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    """This process's matmul rate in GFLOP/s for ``dtype`` on ``device``: the rate the collective
    matmul planner measures (:func:`commlib.overlap.costs.measure`, once per process, with every
    thread torch uses: ranks sharing the cores get less)."""
    return measure(dtype, device)[0] / 1e9


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

def _batches(text: str) -> list[int]:
    """``1,2,4,16`` or a geometric run ``1,2,4,...,256`` (``...`` last: up to 1024)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        if "..." in parts:
            k = parts.index("...")
            head = [int(t) for t in parts[:k]]
            end = int(parts[k + 1]) if k + 1 < len(parts) else 1024
            if len(head) < 2 or head[1] <= head[0] or head[1] % head[0] or len(parts) > k + 2:
                raise ValueError
            out, ratio = head[:], head[1] // head[0]
            while out[-1] * ratio <= end:
                out.append(out[-1] * ratio)
            return out
        return [int(t) for t in parts]
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected batch sizes like 1,2,4,16 or 1,2,4,...,256") from None


def _mesh(text: str) -> list[tuple[int, int]]:
    try:
        out = []
        for part in text.split(","):
            r, c = part.lower().split("x")
            out.append((int(r), int(c)))
        return out
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RxC, e.g. 8x8 or 8x8,16x4") from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def _ms(p: Prediction | None) -> str:
    return "-" if p is None else f"{p.seconds * 1e3:.2f}"


def report(rows: list[Row], mesh: tuple[int, int], hides_comm: bool) -> list[str]:
    """The table and the crossover lines for one configuration."""
    r, c = mesh
    p = r * c
    head = (f"  {'batch':>6} {'tokens':>8} {'1D ms':>9} {'2D ms':>9} {'2D ovl ms':>10} "
            f"{'1D MiB sent':>12} {'2D MiB sent':>12} {'1D act MiB':>11} {'2D act MiB':>11}  winner")
    lines = [head]
    for row in rows:
        two = row.two_d
        lines.append(f"  {row.batch:>6} {row.tokens:>8} {_ms(row.one_d):>9} {_ms(two):>9} "
                     f"{_ms(row.two_d_overlap):>10} {_mib(row.one_d.bytes_sent):>12} "
                     f"{'-' if two is None else _mib(two.bytes_sent):>12} "
                     f"{_mib(row.one_d.activation_bytes):>11} "
                     f"{'-' if two is None else _mib(two.activation_bytes):>11}  "
                     f"{row.winner() if two is not None else f'1D (2D: not a multiple of {r} rows)'}")

    def line(found: Row | None, what: str) -> str:
        if found is None:
            return f"2D {r}x{c} {what} 1D p={p}: never in range"
        return f"2D {r}x{c} {what} 1D p={p} from batch {found.batch} (tokens {found.tokens})"

    time_what = "overtakes" if hides_comm else "overtakes (no overlap possible here)"
    lines.append(line(crossover(rows, overlap=hides_comm), time_what))
    if hides_comm:
        lines.append(line(crossover(rows, overlap=False), "without overlap overtakes"))
    lines.append(line(crossover(rows, metric="activation_bytes"), "needs less activation memory than"))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.nn.tp_plan",
                                     description=__doc__.split("\n\n")[0])
    where = parser.add_argument_group("machine")
    where.add_argument("--topology", help="catalog system (commlib.topology.catalog_names()) or "
                                          "a topology file")
    where.add_argument("--nodes", type=int, default=1, help="hosts of that system (default 1)")
    where.add_argument("--nics-per-host", type=int, default=None)
    where.add_argument("--nic-gbps", type=float, default=None, help="NIC rate in Gb/s")
    where.add_argument("--local", action="store_true", help="this machine, from the tuning file")
    where.add_argument("--tuning-file", default=None, help="default: COMMLIB_TUNING_FILE or the "
                                                           "per-host cache")
    where.add_argument("--engine", default="mpi", help="engine named in the tuning file (--local)")
    where.add_argument("--hosts", type=int, default=1, help="hosts the ranks span (--local)")
    where.add_argument("--ranks", type=int, default=None,
                       help="p: ranks of both schemes (default: every GPU of the cluster)")
    where.add_argument("--gflops", type=float, default=None,
                       help="GEMM rate per rank, GFLOP/s (default: the catalog GPU's assumed "
                            "rate; --local: measured, as commlib.overlap measures it)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=("block", "mlp"), default="block")
    model.add_argument("--hidden", type=int, required=True)
    model.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    model.add_argument("--heads", type=int, default=None,
                       help="default max(hidden / 128, ranks): 1D needs a multiple of its ranks")
    model.add_argument("--layers", type=int, default=1)
    model.add_argument("--seq", type=int, required=True)
    model.add_argument("--batch", type=_batches, default=_batches("1,2,4,..."),
                       help="batch sizes: 1,2,4,16 or 1,2,4,...,256 (default 1,2,4,...,1024)")
    model.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                       help="operand type (default fp16 on GPUs, fp32 --local)")
    model.add_argument("--flash", action="store_true",
                       help="do not count the attention probabilities as saved")
    parser.add_argument("--mesh", type=_mesh, default=None,
                        help="2D meshes RxC, comma-separated (default: the squarest, r >= c)")
    parser.add_argument("--panels", type=int, default=None,
                        help="SUMMA panels per layer (default: the layers' own, lcm(r, c))")
    args = parser.parse_args(argv)
    if args.local == (args.topology is not None):
        parser.error("pass exactly one of --topology and --local")
    dtype = args.dtype or ("fp32" if args.local else "fp16")
    try:
        if args.local:
            if args.ranks is None:
                parser.error("--local needs --ranks (and --hosts when they span hosts)")
            gflops = args.gflops
            if gflops is None:
                gflops = measure_gflops(_TORCH_DTYPES[dtype])
            machine = local_machine(args.tuning_file, args.engine, args.ranks, args.hosts,
                                    gflops=gflops)
            if args.gflops is None:
                machine.gflops_source = f"measured {dtype} matmul rate, one process"
        else:
            system = args.topology
            if os.path.exists(system):
                system = load_topology(system)
            machine = catalog_machine(system, args.nodes, dtype=dtype, gflops=args.gflops,
                                      nics_per_host=args.nics_per_host, nic_gbps=args.nic_gbps)
        p = args.ranks or machine.ranks
        if p > machine.ranks:
            raise arg_error("nn.tp_plan", "ranks", p, f"exceeds the machine's {machine.ranks}",
                            f"pass --ranks <= {machine.ranks} or more --nodes", CommArgumentError)
        ffn = args.ffn or 4 * args.hidden
        heads = args.heads or max(args.hidden // 128, p)  # head dim 128, or one head per rank
        meshes = args.mesh or [square_mesh(p)]
        print(f"# commlib tp_plan: {'transformer block' if args.model == 'block' else 'MLP'}: "
              f"hidden {args.hidden}, ffn {ffn}"
              + (f", heads {heads}, layers {args.layers}" if args.model == "block" else "")
              + f", seq {args.seq}, {dtype}; per rank, one forward+backward")
        print(f"# machine: {machine.name}")
        print(f"# GEMM: {machine.gflops:g} GFLOP/s per rank ({machine.gflops_source})")
        if args.model == "block":
            print(f"# attention probabilities {'not ' if args.flash else ''}counted as saved")
        for r, c in meshes:
            rows = compare(args.batch, seq=args.seq, hidden=args.hidden, ffn=ffn, mesh=(r, c), p=p,
                           heads=heads, model=args.model, dtype_bytes=DTYPE_BYTES[dtype],
                           comm=machine.collective_seconds, gflops=machine.gflops,
                           overlap=machine.hides_comm, layers=args.layers,
                           attention_scores=not args.flash, panels=args.panels,
                           busy=machine.busy_share)
            print(f"\n# 1D over {p} ranks ({machine.group_note(p, 1)}) vs 2D {r}x{c}: rows of "
                  f"{machine.group_note(c, 1)}, columns of {machine.group_note(r, c)}")
            if machine.hides_comm and machine.cores_copy:
                print(f"# busy share (what a GEMM beside a collective loses): rows "
                      f"{machine.busy_share(c, 1):.2f}, columns {machine.busy_share(r, c):.2f}")
            if not machine.hides_comm:
                print("# CPU ranks on one host: the cores that compute also copy, so 2D ovl = 2D")
            print("\n".join(report(rows, (r, c), machine.hides_comm)))
    except CommError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

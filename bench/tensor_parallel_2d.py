"""2D tensor parallelism (Optimus: ``commlib.nn.Linear2D``, SUMMA on an (r, c) mesh) against 1D
(Megatron: ``commlib.nn.ParallelMLP``) at the same rank count: time, activation memory and bytes
sent per rank for one forward+backward of a transformer MLP (H -> F -> H, GELU) and of a whole
pre-norm transformer block (``commlib.nn.layers_2d.TransformerBlock2D``).

Run under ``mpiexec`` on one host, or across hosts (the multi-host cluster of docs/overlap.md)::

    mpiexec -n 4 .venv/bin/python bench/tensor_parallel_2d.py              # 2D 2x2 against 1D over 4
    mpiexec -n 2 .venv/bin/python bench/tensor_parallel_2d.py              # 2D 1x2 and 2x1, 1D over 2
    mpiexec -n 4 .venv/bin/python bench/tensor_parallel_2d.py --part mlp --panels 2,default,8
    vcluster mpirun -n 4 -ppn 2 -- env COMMLIB_TUNING_FILE=$T .venv/bin/python \
        bench/tensor_parallel_2d.py --json tp2d.json

**What runs.** Every rank builds the same dense model (seeded alike) and the same input
``(B, S, H)``, T = B x S tokens. *2D* on each mesh, from the dense modules with ``from_dense``
(``Linear2D`` fc1 and fc2; ``TransformerBlock2D``), input the rank's ``(B/r, S, H/c)`` block
(``split_2d``: dim 0, the batch, split in r, the features in c), with ``overlap=True`` (the next
panel's broadcasts travel while the current panel's GEMMs run) and ``overlap=False`` (blocking
SUMMA). *1D* over the world, input ``(B, S, H)`` replicated: ``ParallelMLP.from_dense(fc1, fc2,
sequence_parallel=False)``, and for the block the same layers Megatron uses (LayerNorm replicated,
qkv and fc1 column-parallel, proj and fc2 row-parallel, attention on heads / p), with
``overlap=False`` (the blocking all-reduces) and ``overlap=True``. The meshes follow the world
size: q x q at q*q ranks (2x2 at 4), else 1xp and px1 (``--meshes`` overrides).
``--mesh-order topology`` (default) builds them with ``commlib.Mesh.from_topology`` (the row
group, the last mesh dimension, kept inside a host while it fits), ``row-major`` with
``commlib.Mesh`` in rank order; the header says which groups cross hosts.

**Columns** (one row per configuration; a *layout* is 2D on one mesh with one panel count, or 1D):

* ``panels``: SUMMA's panel count of each Linear2D (fc1 x fc2; qkv x proj x fc1 x fc2).
* ``ms``: one forward+backward (loss ``y.sum()``), wall time of the slowest rank, median over
  ``--rounds`` rounds. Each round runs every layout after the quiet gate of ``bench/_quiet.py``
  (it waits out the host's slow phases, as bench/overlap.py does) and then the layout's rows back
  to back; both orders rotate per round, so the rows compared below are measured within a second
  of each other.
* ``compute ms``: the layout's local work with no communication, timed the same way, all ranks at
  once: the same GEMMs (``LocalLinear``: SUMMA's per-panel GEMMs forward, ``dY W_p`` and
  ``dY^T x_p`` per panel backward; a 1D shard's GEMMs), bias, GELU, and for the block the
  LayerNorms and attention on the rank's heads. The bound overlap can reach.
* ``hidden``: the share of the communication overlap hides, (blocking - overlapped) /
  (blocking - compute), on the overlapped row.
* ``act MiB``: activation memory per rank, measured: the bytes autograd saves for backward in one
  forward, i.e. the sum of ``untyped_storage().nbytes()`` over the unique storages of the tensors
  that ``torch.autograd.graph.saved_tensors_hooks``' pack hook sees (custom autograd Functions'
  ``save_for_backward`` goes through it too), the parameters' storages left out (weights, not
  activations). That is what backward keeps at its peak, at the end of forward. Largest over
  ranks. ``-closed``: measured minus the closed form of commlib/nn/tp_plan.py (MLP: 2D s (T/r H/c
  + 2 T/r F/c), 1D s (T H + 2 T F/p); block: 2D s (8 T H/p + 2 T F/p), 1D s (4 T H + 4 T H/p +
  2 T F/p)); the closed form leaves out what torch's attention and LayerNorm also save (the
  attention output and log-sum-exp, the per-token statistics).
* ``sent MiB``: bytes this rank sends in one forward+backward, largest over ranks. 2D: counted by
  ``commlib.nn.functional.traffic()`` (logical bytes: a broadcast's root sends (g-1) n, a reduce's
  non-roots n each) and checked against the closed form (Linear2D: commlib/nn/tp_plan.py;
  LayerNorm2D: commlib/nn/layers_2d.py). 1D: the counter does not see the 1D layers' collectives,
  so the closed form: all-reduces of T H s bytes, 2 (p-1)/p T H s each, two per MLP (forward
  after fc2, backward fc1's input gradient), four per block.
* ``err``: max |y - y_dense| / max |y_dense| over the output and the input gradient against the
  dense model on the whole input (this rank's block of it), largest over ranks; above 1e-4 it is
  wrong, and the exit status is 1.

After each table: 2D overlapped / blocking speed-up and hidden share, with the goal (across hosts:
faster, and at least half hidden; on one host the cores that compute also copy the messages, so
only "never more than 5% slower"), and 2D / 1D ratios of time, bytes sent and activations (below
1: 2D is faster, sends or keeps less).

``--panels 2,4,default`` measures each SUMMA panel count of the MLP in turn (Linear2D's
``panels``: a multiple of lcm(r, c) dividing the layer's input features; ``default``: the layer's
own choice), one layout each, named ``2D 2x2 p4``; the block always uses the default.
``--json PATH`` writes every row, the options and the hosts.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys

import torch
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI

from _harness import rank0_out, timed_slowest, write_json
from _quiet import quiet_for, quiet_summary
from commlib.nn import ColumnParallelLinear, Linear2D, ParallelMLP, RowParallelLinear, tp_plan
from commlib.nn.functional import split_2d, traffic

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
MIB = float(1 << 20)
GOAL_HIDDEN = 0.5     # across hosts: overlapped SUMMA hides at least half of its communication
GOAL_NO_LOSS = 0.05   # one host: overlap never more than 5% slower than blocking
TOLERANCE = 1e-4      # float32 against the dense model, relative to the largest |value|


def timed(fn) -> float:
    return timed_slowest(fn, COMM)


# ----- what one forward+backward keeps, sends and computes -----------------------------------
def saved_bytes(forward, params) -> int:
    """Bytes of the unique storages autograd saves for backward during ``forward()`` (the
    parameters' storages left out), on this rank; runs the backward afterwards to free them."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    y.sum().backward()
    return sum(seen.values())


def closed_forms(part: str, args, **geometry) -> tuple[int, int]:
    """(bytes sent, activation bytes) per rank for one forward+backward of ``part`` on ``mesh=``
    (r, c) or ``p=`` (1D): the planner's closed forms (commlib/nn/tp_plan.py, checked against
    hand-computed values in tests/test_tp_plan.py). Attention probabilities are not counted:
    torch's scaled_dot_product_attention does not keep them."""
    free = dict(dtype_bytes=4, comm=lambda *a: 0.0, gflops=1.0, **geometry)
    if part == "mlp":
        pred = tp_plan.predict_mlp(args.batch * args.seq, args.hidden, args.ffn, **free)
    else:
        pred = tp_plan.predict_block(args.batch, args.seq, args.hidden, args.ffn, args.heads,
                                     attention_scores=False, **free)
    return pred.bytes_sent, pred.activation_bytes


# ----- the same local work with no communication (the compute-only rows) -----------------------
def _panel(block: torch.Tensor, p: int, width: int) -> torch.Tensor:
    """Panel p of a layer's input as SUMMA multiplies it: this rank's block when it is one panel,
    else one of its panels (a panel another rank would broadcast has the same shape)."""
    if block.shape[1] == width:
        return block
    off = (p % (block.shape[1] // width)) * width
    return block[:, off:off + width].contiguous()


class _LocalSumma(torch.autograd.Function):
    """One Linear2D's GEMMs on this rank, with the panels in place of their broadcasts: forward
    ``sum_p x_p W_p^T + b``; backward per panel ``dY W_p`` (this rank's dX slot, or what it would
    reduce to the panel's owner) and ``dY^T x_p``. One panel: a 1D shard's GEMMs."""

    @staticmethod
    def forward(ctx, x, w, b):
        x2 = x.reshape(-1, x.shape[-1])
        width = w.shape[2]
        acc = torch.addmm(b, _panel(x2, 0, width), w[0].t())
        for p in range(1, w.shape[0]):
            acc.addmm_(_panel(x2, p, width), w[p].t())
        ctx.save_for_backward(x2, w)
        ctx.shape = x.shape
        return acc.view(tuple(x.shape[:-1]) + (w.shape[1],))

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        width, per = w.shape[2], x2.shape[1] // w.shape[2]
        dx, dw = torch.empty_like(x2), torch.empty_like(w)
        for p in range(w.shape[0]):
            part = torch.mm(dy2, w[p])
            if p < per:
                dx[:, p * width:(p + 1) * width] = part
            torch.mm(dy2.t(), _panel(x2, p, width), out=dw[p])
        return dx.view(ctx.shape), dw, dy2.sum(0)


class LocalLinear(torch.nn.Module):
    """The compute-only twin of a Linear2D block or a 1D shard: ``panels`` GEMMs of ``width``
    input features each, to ``out_local`` features."""

    def __init__(self, width: int, panels: int, out_local: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(panels, out_local, width) /
                                         math.sqrt(width * panels))
        self.bias = torch.nn.Parameter(torch.zeros(out_local))

    @classmethod
    def of_2d(cls, layer: Linear2D) -> "LocalLinear":
        return cls(layer.panels.width, layer.panels.count, layer.out_features // layer.grid.c)

    @classmethod
    def of_1d(cls, fan_in: int, fan_out: int, p: int, column: bool) -> "LocalLinear":
        if column:  # input replicated, output features / p
            return cls(fan_in, 1, fan_out // p)
        return cls(fan_in // p, 1, fan_out)

    def forward(self, x):
        return _LocalSumma.apply(x, self.weight, self.bias)


class MLP(torch.nn.Module):
    """``fc2(gelu(fc1(x)))`` of any two layers: dense, Linear2D or their LocalLinear twins."""

    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


# ----- configurations -------------------------------------------------------------------------
class Config:
    """One row: ``step()`` runs one forward+backward. For the overlap and blocking rows also
    ``forward()``, its input ``x``, ``params``, the dense ``reference`` (output, input gradient)
    in this rank's layout and the closed forms of the bytes sent and saved."""

    def __init__(self, name: str, scheme: str, variant: str, step, *, mesh=None, panels=None,
                 params=None, forward=None, x=None, reference=None, sent_closed=None,
                 act_closed=None):
        self.name, self.scheme, self.variant, self.step = name, scheme, variant, step
        self.key = name.rsplit(" ", 1)[0]  # the layout: its overlap, blocking and compute rows
        self.mesh, self.panels, self.params, self.forward, self.x = mesh, panels, params, forward, x
        self.reference, self.sent_closed, self.act_closed = reference, sent_closed, act_closed
        self.times: list[float] = []


def _step(forward, x, params):
    def run():
        x.grad = None
        for p in params:
            p.grad = None
        forward().sum().backward()
    return run


def add_layout(configs: list, tag: str, scheme: str, build, local, x, reference, sent: int,
               act: int, mesh=None) -> None:
    """The rows of one layout: ``build(overlap)`` gives the parallel module (overlap rows first
    for 2D, blocking first for 1D), ``local`` its compute-only twin."""
    panels = None
    for ov in (True, False) if scheme == "2d" else (False, True):
        module = build(ov)
        if scheme == "2d":
            panels = [m.panels.count for m in module.modules() if isinstance(m, Linear2D)]

        def forward(module=module):
            return module(x)
        params = list(module.parameters())
        variant = "overlap" if ov else "blocking"
        configs.append(Config(f"{tag} {variant}", scheme, variant, _step(forward, x, params),
                              mesh=mesh, panels=panels, params=params, forward=forward, x=x,
                              reference=reference, sent_closed=sent, act_closed=act))
    xl = torch.randn_like(x).requires_grad_()
    configs.append(Config(f"{tag} compute", scheme, "compute",
                          _step(lambda: local(xl), xl, list(local.parameters())), mesh=mesh,
                          panels=panels))


def dense_reference(model, x_full):
    xr = x_full.clone().requires_grad_()
    y = model(xr)
    y.sum().backward()
    return y.detach(), xr.grad


def parse_meshes(text: str | None, p: int) -> list[tuple[int, int]]:
    if not text:
        q = math.isqrt(p)
        return [(q, q)] if q * q == p and p > 1 else [(1, p), (p, 1)]
    try:
        meshes = [tuple(int(v) for v in m.lower().split("x")) for m in text.split(",")]
    except ValueError:
        meshes = []
    if not meshes or any(len(m) != 2 or m[0] * m[1] != p for m in meshes):
        raise ValueError(f"--meshes {text!r}: give meshes r x c with r * c = {p} ranks, "
                         f"e.g. 1x{p},{p}x1")
    return meshes


def make_mesh(shape, order: str):
    return commlib.Mesh.from_topology(shape) if order == "topology" else commlib.Mesh(shape)


def placement(mesh, hosts: list[str]) -> str:
    """Which of this mesh's groups cross hosts (every rank's view, gathered)."""
    def crosses(g):
        return len({hosts[q] for q in g.ranks}) > 1
    flags = COMM.allgather((crosses(mesh.group(1)), crosses(mesh.group(0))))
    row, col = any(a for a, _ in flags), any(b for _, b in flags)
    where = {True: "across hosts", False: "inside a host"}
    return f"row groups (x panels) {where[row]}, column groups (W panels) {where[col]}"


def _mesh_note(mesh, shape, args, hosts, out) -> None:
    how = "Mesh.from_topology" if args.mesh_order == "topology" else "Mesh, rank order"
    out(f"# mesh {shape[0]}x{shape[1]} ({how}): {placement(mesh, hosts)}")


def mlp_configs(args, meshes, hosts, out) -> list[Config]:
    p = COMM.size
    h, f, bsz, seq = args.hidden, args.ffn, args.batch, args.seq
    torch.manual_seed(args.seed)
    fc1, fc2 = torch.nn.Linear(h, f), torch.nn.Linear(f, h)
    x_full = torch.randn(bsz, seq, h, generator=torch.Generator().manual_seed(args.seed + 1))
    y_ref, dx_ref = dense_reference(MLP(fc1, fc2), x_full)
    configs: list[Config] = []
    for (r, c), mesh in meshes.items():
        _mesh_note(mesh, (r, c), args, hosts, out)
        # a copy, not a view of x_full: the saved bytes count storages
        x = split_2d(x_full, mesh).clone().requires_grad_()
        ref = (split_2d(y_ref, mesh), split_2d(dx_ref, mesh))
        sent, act = closed_forms("mlp", args, mesh=(r, c))
        for panels in args.panels:
            opts = {} if panels is None else {"panels": panels}

            def build(ov, opts=opts, mesh=mesh):
                return MLP(Linear2D.from_dense(fc1, mesh, overlap=ov, **opts),
                                Linear2D.from_dense(fc2, mesh, overlap=ov, **opts))
            twin = build(False)
            local = MLP(LocalLinear.of_2d(twin.fc1), LocalLinear.of_2d(twin.fc2))
            tag = f"2D {r}x{c}" + ("" if panels is None else f" p{panels}")
            add_layout(configs, tag, "2d", build, local, x, ref, sent, act, mesh=(r, c))
    x = x_full.clone().requires_grad_()
    local = MLP(LocalLinear.of_1d(h, f, p, True), LocalLinear.of_1d(f, h, p, False))
    add_layout(configs, f"1D {p}", "1d",
               lambda ov: ParallelMLP.from_dense(fc1, fc2, sequence_parallel=False, overlap=ov),
               local, x, (y_ref, dx_ref), *closed_forms("mlp", args, p=p))
    return configs


def block_configs(args, meshes, hosts, out, blocks) -> list[Config]:
    """The whole pre-norm block: ``TransformerBlock2D.from_dense`` on each mesh against Megatron's
    1D block built from the same dense ``TransformerBlock`` (``Block1D``)."""
    TransformerBlock, TransformerBlock2D, block_forward, qkv_order = blocks
    p = COMM.size
    h, f, heads, bsz, seq = args.hidden, args.ffn, args.heads, args.batch, args.seq
    torch.manual_seed(args.seed)
    dense = TransformerBlock(h, heads, f)
    x_full = torch.randn(bsz, seq, h, generator=torch.Generator().manual_seed(args.seed + 1))
    y_ref, dx_ref = dense_reference(dense, x_full)
    ln = torch.nn.LayerNorm

    class LocalBlock(torch.nn.Module):
        """The compute-only block: LayerNorm over this rank's features, the four layers'
        GEMMs (LocalLinear), attention on this rank's heads."""

        def __init__(self, features, qkv, proj, fc1, fc2, heads):
            super().__init__()
            self.ln1, self.ln2, self.causal, self.heads = ln(features), ln(features), True, heads
            self.qkv, self.proj, self.fc1, self.fc2 = qkv, proj, fc1, fc2

        def forward(self, x):
            return block_forward(self, x, self.heads)

    class Block1D(torch.nn.Module):
        """Megatron's block over the world: LayerNorms replicated, qkv column-parallel (rank q
        holds the q, k and v of heads block q), attention on heads/p, proj row-parallel (one
        all-reduce), fc1 column- and fc2 row-parallel (one all-reduce); backward one all-reduce
        for each column layer's input gradient."""

        def __init__(self, overlap: bool):
            super().__init__()
            self.ln1, self.ln2 = copy.deepcopy(dense.ln1), copy.deepcopy(dense.ln2)
            qkv = torch.nn.Linear(h, 3 * h)
            rows = qkv_order(h, p)
            with torch.no_grad():
                qkv.weight.copy_(dense.qkv.weight[rows])
                qkv.bias.copy_(dense.qkv.bias[rows])
            kw = dict(overlap=overlap)
            self.qkv = ColumnParallelLinear.from_dense(qkv, **kw)
            self.proj = RowParallelLinear.from_dense(dense.proj, **kw)
            self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, **kw)
            self.fc2 = RowParallelLinear.from_dense(dense.fc2, **kw)
            self.causal = dense.causal

        def forward(self, x):
            return block_forward(self, x, heads // p)

    configs: list[Config] = []
    for (r, c), mesh in meshes.items():
        _mesh_note(mesh, (r, c), args, hosts, out)
        x = split_2d(x_full, mesh).clone().requires_grad_()
        ref = (split_2d(y_ref, mesh), split_2d(dx_ref, mesh))
        sent, act = closed_forms("block", args, mesh=(r, c))

        def build(ov, mesh=mesh):
            return TransformerBlock2D.from_dense(dense, mesh, overlap=ov)
        twin = build(False)
        local = LocalBlock(h // c, *(LocalLinear.of_2d(getattr(twin, n))
                                     for n in ("qkv", "proj", "fc1", "fc2")), heads // c)
        add_layout(configs, f"2D {r}x{c}", "2d", build, local, x, ref, sent, act, mesh=(r, c))
    x = x_full.clone().requires_grad_()
    local = LocalBlock(h, LocalLinear.of_1d(h, 3 * h, p, True), LocalLinear.of_1d(h, h, p, False),
                       LocalLinear.of_1d(h, f, p, True), LocalLinear.of_1d(f, h, p, False),
                       heads // p)
    add_layout(configs, f"1D {p}", "1d", Block1D, local, x, (y_ref, dx_ref),
               *closed_forms("block", args, p=p))
    return configs


# ----- measuring ------------------------------------------------------------------------------
def check_and_count(cfg: Config) -> dict:
    """Untimed: the error against the dense model, the saved bytes and the bytes sent (largest
    over ranks, and the smallest for the bytes)."""
    if cfg.forward is None:
        return {}
    cfg.step()  # warm-up
    for p in cfg.params:
        p.grad = None
    cfg.x.grad = None
    y = cfg.forward()
    y.sum().backward()
    err = 0.0
    for got, want in zip((y.detach(), cfg.x.grad), cfg.reference):
        err = max(err, float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30))
    act = saved_bytes(cfg.forward, cfg.params)
    with traffic() as t:
        cfg.step()
    counted = t.sent
    return {"error": COMM.allreduce(err, op=MPI.MAX),
            "activation_bytes": COMM.allreduce(act, op=MPI.MAX),
            "counted_sent_max": COMM.allreduce(counted, op=MPI.MAX),
            "counted_sent_min": COMM.allreduce(counted, op=MPI.MIN),
            "counted_by_kind": t.by_kind}


def measure(configs: list[Config], rounds: int, patience: float) -> None:
    """Each round: every layout in turn, after the quiet gate, its rows (overlap, blocking,
    compute) back to back; both orders rotate every round. The rows that the hidden share and
    the speed-up compare are measured within a second of each other, in the same phase."""
    for cfg in configs:
        cfg.step()  # warm-up (the 2D/1D ones were also run by check_and_count)
    quiet = quiet_for(COMM, patience)
    layouts: dict[str, list[Config]] = {}
    for cfg in configs:
        layouts.setdefault(cfg.key, []).append(cfg)
    keys = list(layouts)
    for k in range(rounds):
        for key in keys[k % len(keys):] + keys[:k % len(keys)]:
            quiet.wait()  # not in one of the host's slow phases (bench/_quiet.py)
            rows = layouts[key]
            for cfg in rows[k % len(rows):] + rows[:k % len(rows)]:
                cfg.times.append(timed(cfg.step))


def _ms(t) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def report(configs: list[Config], facts: dict, multi_host: bool, out) -> tuple[list[dict], list[str], int]:
    rows, wrong = [], 0
    compute = {c.key: statistics.median(c.times) for c in configs if c.variant == "compute"}
    blocking = {c.key: statistics.median(c.times) for c in configs if c.variant == "blocking"}
    out(f"# {'configuration':<18} | {'panels':>7} | {'ms':>7} | {'compute ms':>10} | "
        f"{'hidden':>6} | {'act MiB':>8} | {'-closed':>7} | {'sent MiB':>9} | {'how':<11} | check | "
        f"{'err':>7}")
    for cfg in configs:
        med = statistics.median(cfg.times)
        key = cfg.key
        comp = compute.get(key)
        hidden = None
        if cfg.variant == "overlap" and key in blocking and blocking[key] > comp:
            hidden = (blocking[key] - med) / (blocking[key] - comp)
        f = facts.get(cfg.name, {})
        row = {"name": cfg.name, "scheme": cfg.scheme, "variant": cfg.variant,
               "mesh": list(cfg.mesh) if cfg.mesh else None, "ranks": COMM.size,
               "panels": list(cfg.panels) if cfg.panels else None,
               "seconds": med, "seconds_rounds": cfg.times, "compute_seconds": comp,
               "hidden": hidden}
        if f:
            if cfg.scheme == "2d":
                sent, how = f["counted_sent_max"], "counted"
                sent_ok = f["counted_sent_max"] == f["counted_sent_min"] == cfg.sent_closed
            else:
                sent, how = cfg.sent_closed, "closed form"
                sent_ok = True
            extra = f["activation_bytes"] - cfg.act_closed
            bad = f["error"] > TOLERANCE
            wrong += bad
            row.update(bytes_sent=sent, bytes_sent_source=how, bytes_sent_closed_form=cfg.sent_closed,
                       bytes_sent_min=f["counted_sent_min"] if cfg.scheme == "2d" else sent,
                       bytes_by_kind=f["counted_by_kind"] if cfg.scheme == "2d" else None,
                       activation_bytes=f["activation_bytes"],
                       activation_closed_form=cfg.act_closed, error=f["error"])
            tail = (f"{f['activation_bytes'] / MIB:8.2f} | "
                    f"{'ok' if extra == 0 else f'{extra / MIB:+.3g}':>7} | "
                    f"{sent / MIB:9.2f} | {how:<11} | {'ok' if sent_ok else 'DIFF':>5} | "
                    f"{f['error']:7.1e}{' WRONG' if bad else ''}")
        else:
            tail = f"{'-':>8} | {'':>7} | {'-':>9} | {'':<11} | {'':>5} | {'-':>7}"
        pan = "x".join(map(str, cfg.panels)) if cfg.panels else "-"
        out(f"  {cfg.name:<18} | {pan:>7} | {_ms(med):>7} | {_ms(comp):>10} | "
            f"{'-' if hidden is None else f'{100 * hidden:5.0f}%':>6} | {tail}")
        rows.append(row)
    return rows, ratios(rows, multi_host), wrong


def ratios(rows: list[dict], multi_host: bool) -> list[str]:
    """The comparisons under a table: each 2D layout's overlapped against blocking SUMMA (with
    the goal) and against 1D (the times as 2D / 1D: below 1, 2D is faster)."""
    by = {r["name"]: r for r in rows}
    lines = []
    p = COMM.size
    one_d = {v: by.get(f"1D {p} {v}") for v in ("blocking", "overlap")}
    for r in rows:
        if r["scheme"] != "2d" or r["variant"] != "overlap":
            continue
        blk = by[r["name"].replace("overlap", "blocking")]
        speed = blk["seconds"] / r["seconds"]
        hidden = r["hidden"]
        name = r["name"].rsplit(" ", 1)[0]
        if multi_host:
            ok = speed > 1 and hidden is not None and hidden >= GOAL_HIDDEN
            goal = (f"{'PASS' if ok else 'MISS'} (across hosts: faster and >= "
                    f"{GOAL_HIDDEN:.0%} hidden)")
        else:
            ok = speed >= 1 / (1 + GOAL_NO_LOSS)
            goal = (f"{'PASS' if ok else 'MISS'} (one host: at most {GOAL_NO_LOSS:.0%} slower; "
                    f"the cores that compute also copy, nothing to hide)")
        lines.append(f"# {name}: overlapped / blocking SUMMA speed-up {speed:.2f}x, hidden "
                     f"{'-' if hidden is None else f'{100 * hidden:.0f}%'}: {goal}")
        if all(one_d.values()):
            d_blk, d_ov = one_d["blocking"], one_d["overlap"]
            lines.append(f"# {name} / 1D over {p}: time {r['seconds'] / d_blk['seconds']:.2f} "
                         f"(2D overlapped / 1D blocking), "
                         f"{r['seconds'] / d_ov['seconds']:.2f} (2D overlapped / 1D "
                         f"overlapped), {blk['seconds'] / d_blk['seconds']:.2f} (both "
                         f"blocking); bytes sent {r['bytes_sent'] / d_blk['bytes_sent']:.2f}; "
                         f"activations {r['activation_bytes'] / d_blk['activation_bytes']:.2f}")
    return lines


GOAL_PLANNER = 0.25  # the planner's predictions within 25% of the measured times


def planner_check(part: str, args, rows: list[dict], hosts: list[str]) -> list[str]:
    """The planner's prediction (commlib.nn.tp_plan, priced from this machine's tuning file, the
    configured one) beside each measured overlap/blocking row: its collectives from the cost
    model, its GEMMs at the rate the layout's compute-only row measured (the planner's flops over
    that time), so the check is of the communication and overlap model."""
    p, nhosts = COMM.size, len(set(hosts))
    engine = commlib.get_world_group().backend.name
    t, s = args.batch * args.seq, 4
    lines = [f"# planner (python -m commlib.nn.tp_plan --local, engine {engine}, {p} ranks on "
             f"{nhosts} host(s), GEMM rate from each layout's compute row): predicted against "
             f"measured, goal within {GOAL_PLANNER:.0%}"]
    for row in rows:
        if row["variant"] not in ("overlap", "blocking") or not row["compute_seconds"]:
            continue
        geometry = {"mesh": tuple(row["mesh"])} if row["scheme"] == "2d" else {"p": p}
        panels = row["panels"][0] if row["panels"] else None
        if part == "mlp":
            stages = tp_plan.mlp_schedule(t, args.hidden, args.ffn, dtype_bytes=s, panels=panels,
                                          **geometry)
        else:
            stages = tp_plan.block_schedule(args.batch, args.seq, args.hidden, args.ffn,
                                            args.heads, dtype_bytes=s, panels=panels, **geometry)
        gflops = sum(st.flops for st in stages) / row["compute_seconds"] / 1e9
        machine = tp_plan.local_machine(None, engine, p, nhosts, gflops=gflops)
        overlap = row["variant"] == "overlap" and row["scheme"] == "2d"
        common = dict(dtype_bytes=s, comm=machine.collective_seconds, gflops=gflops,
                      overlap=overlap, panels=panels, busy=machine.busy_share, **geometry)
        if part == "mlp":
            pred = tp_plan.predict_mlp(t, args.hidden, args.ffn, **common)
        else:
            pred = tp_plan.predict_block(args.batch, args.seq, args.hidden, args.ffn, args.heads,
                                         **common)
        ratio = row["seconds"] / pred.seconds
        ok = abs(ratio - 1) <= GOAL_PLANNER
        row.update(predicted_seconds=pred.seconds, predicted_comm_seconds=pred.comm_seconds)
        lines.append(f"#   {row['name']:<20} predicted {pred.seconds * 1e3:7.1f} ms (comm "
                     f"{pred.comm_seconds * 1e3:6.1f}), measured {row['seconds'] * 1e3:7.1f} ms: "
                     f"x{ratio:.2f} {'PASS' if ok else 'MISS'}")
    return lines


def run_part(part: str, args, configs: list[Config], multi_host: bool, out,
             hosts: list[str]) -> dict:
    facts = {c.name: check_and_count(c) for c in configs}
    measure(configs, args.rounds, args.patience)
    rows, lines, wrong = report(configs, facts, multi_host, out)
    if COMM.rank == 0:
        try:
            lines += planner_check(part, args, rows, hosts)
        except commlib.CommError as exc:  # no tuning file for this job: say so, measure anyway
            lines.append(f"# planner: not checked ({exc})")
    for line in lines:
        out(line)
    return {"part": part, "tokens": args.batch * args.seq, "hidden": args.hidden,
            "ffn": args.ffn, "heads": args.heads if part == "block" else None,
            "batch": args.batch, "seq": args.seq, "dtype_bytes": 4, "rows": rows,
            "ratios": lines, "wrong": wrong}


def part_mlp(args, meshes, hosts, multi_host: bool, out) -> dict:
    out(f"# mlp: H {args.hidden} -> F {args.ffn} -> H, GELU, biases; input ({args.batch}, "
        f"{args.seq}, {args.hidden}) float32, T = {args.batch * args.seq} tokens; {COMM.size} "
        f"ranks; forward+backward, slowest rank, median of {args.rounds} rounds")
    return run_part("mlp", args, mlp_configs(args, meshes, hosts, out), multi_host, out, hosts)


def part_block(args, meshes, hosts, multi_host: bool, out) -> dict | None:
    try:  # another change brings the 2D block; its dense twin, its block function (the same
        # computation for the 1D block and the compute-only rows) and its qkv row order
        from commlib.nn.layers_2d import TransformerBlock, TransformerBlock2D
        from commlib.nn.layers_2d import _block_forward, _qkv_order
    except ImportError as e:
        out(f"# block: skipped: commlib.nn.layers_2d.TransformerBlock2D is not available ({e})")
        return None
    if args.heads % COMM.size or args.hidden % args.heads:
        out(f"# block: skipped: --heads {args.heads} must divide --hidden {args.hidden} and be a "
            f"multiple of the {COMM.size} ranks (1D splits the heads)")
        return None
    out(f"# block: pre-norm transformer block, H {args.hidden}, {args.heads} heads, F "
        f"{args.ffn}, causal attention (torch SDPA); input ({args.batch}, {args.seq}, "
        f"{args.hidden}) float32, T = {args.batch * args.seq} tokens; {COMM.size} ranks; "
        f"forward+backward, slowest rank, median of {args.rounds} rounds")
    configs = block_configs(args, meshes, hosts, out,
                            (TransformerBlock, TransformerBlock2D, _block_forward, _qkv_order))
    return run_part("block", args, configs, multi_host, out, hosts)


def main() -> int:
    ap = argparse.ArgumentParser(description="2D (Linear2D, SUMMA) against 1D (Megatron) tensor "
                                 "parallelism: time, activation memory and bytes sent per rank "
                                 "for an MLP and a transformer block (see the module docstring)")
    ap.add_argument("--part", choices=("mlp", "block", "all"), default="all")
    ap.add_argument("--hidden", type=int, default=512, help="H (default 512)")
    ap.add_argument("--ffn", type=int, default=None, help="F (default 4 H)")
    ap.add_argument("--batch", type=int, default=8, help="B, split over the mesh rows (default 8)")
    ap.add_argument("--seq", type=int, default=256, help="S (default 256)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads of --part block")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds, the median is reported")
    ap.add_argument("--meshes", default=None,
                    help="2D meshes, e.g. 1x4,2x2,4x1 (default: q x q at q*q ranks, else 1xp,px1)")
    ap.add_argument("--mesh-order", choices=("topology", "row-major"), default="topology",
                    help="commlib.Mesh.from_topology (default) or commlib.Mesh in rank order")
    ap.add_argument("--panels", default=None,
                    help="SUMMA panels per layer, a comma list (each a 2D set of rows; "
                         "'default': the layers' own choice, the default)")
    ap.add_argument("--patience", type=float, default=60.0,
                    help="seconds to wait out a slow phase of the host before a round (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    args.ffn = args.ffn or 4 * args.hidden
    commlib.init()
    rank = commlib.get_rank()

    out = rank0_out(rank)

    try:
        args.meshes = parse_meshes(args.meshes, COMM.size)
        args.panels = [None if v in ("", "default") else int(v)
                       for v in (args.panels or "default").split(",")]
    except ValueError as e:
        if rank == 0:
            ap.error(str(e))  # exit status 2, as the other benchmarks' usage errors
        sys.exit(2)
    hosts = COMM.allgather(MPI.Get_processor_name())
    multi_host = len(set(hosts)) > 1
    out(f"# bench/tensor_parallel_2d.py: {COMM.size} ranks on {len(set(hosts))} host(s) "
        f"({', '.join(f'{n}: ranks {[q for q, x in enumerate(hosts) if x == n]}' for n in dict.fromkeys(hosts))}), "
        f"commlib backend {commlib.get_world_group().backend.name}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread per rank, {os.cpu_count()} cores, tuning file "
        f"{os.environ.get('COMMLIB_TUNING_FILE', '(default)')}")
    meshes = {shape: make_mesh(shape, args.mesh_order) for shape in args.meshes}
    parts, wrong = [], 0
    if args.part in ("mlp", "all"):
        parts.append(part_mlp(args, meshes, hosts, multi_host, out))
        wrong += parts[-1]["wrong"]
    if args.part in ("block", "all"):
        res = part_block(args, meshes, hosts, multi_host, out)
        if res:
            parts.append(res)
            wrong += res["wrong"]
    out(quiet_summary(COMM))
    out(f"# wrong results: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if rank == 0 and args.json:
        write_json(args.json, {"bench": "tensor_parallel_2d", "ranks": COMM.size,
                               "hosts": sorted(set(hosts)), "rank_hosts": hosts,
                               "mesh_order": args.mesh_order, "parts": parts}, args, out)
    commlib.finalize()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

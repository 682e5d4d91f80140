"""Compressed collectives: an all-reduce that moves compressed bytes, and the pieces it is made of.

**all_reduce** never all-gathers everything compressed (Bian et al.: at int8 on 4 ranks that
moves as many bytes as the uncompressed ring, more at 8). It runs ZeRO++'s qgZ shape:

1. each rank encodes the chunk every other rank owns and sends it with one all-to-all
   (``(p-1)`` compressed chunks out, ``(p-1)`` in);
2. the owner adds its own chunk (exact) and the ``p-1`` received ones, decoded, in float32;
3. the owner encodes its reduced chunk once and one all-gather hands it to every rank, which
   decodes all ``p`` chunks: every rank ends with the same bits.

Bytes on the wire per rank: ``2 (p-1) codec.nbytes(ceil(n/p))``. Where the group spans hosts with
several ranks on each (the same number), ``hierarchical`` compresses only the slow hop: an
uncompressed float32 reduce-scatter inside each host (shared memory), the compressed all-reduce
of each rank's shard among the ranks holding the same shard on the other hosts, and an
uncompressed all-gather inside each host.

**The choice** (``algorithm="auto"``) prices ``uncompressed`` (commlib's own all-reduce, as its
selection would run it), ``compressed`` and ``hierarchical`` on the group's agreed cost model plus
the codec's encode and decode rates measured on this machine (:mod:`commlib.compress.costs`), and
takes the cheapest: on one host, where shared memory beats any encoder, that is the exact
all-reduce. :func:`explain` prints the rows.

``error_feedback`` (an :class:`~commlib.compress.ErrorFeedback`) keeps what each encode lost and
adds it to the next call's input, for gradients: the worker's residual per chunk it sends, and
the owner's per chunk it hands out (keys ``(key, "send", j)`` and ``(key, "own")``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

import commlib
from commlib.api.entry import DeferredWork, checked_call
from commlib.api.groups import resolve_group
from commlib.api.traffic import count
from commlib.errors import CommTypeError, arg_error
from commlib.ops import ReduceOp
from commlib.tuning import memo_key
from commlib.tuning.model import Prediction
from commlib.tuning.selector import Explanation

from .codec import Codec, as_codec
from .costs import agreed_rates, known_rates, links, plain_seconds
from .feedback import ErrorFeedback

__all__ = ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "send", "recv",
           "explain", "predictions", "wire_bytes", "ALGORITHMS"]

ALGORITHMS = ("auto", "uncompressed", "compressed", "hierarchical")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_GROUPS: dict = {}  # group name -> (the host's group, the rail group): made once per group
_CHOICES: dict = {}  # (group name, numel, dtype, codec key, tuning memo key) -> algorithm


# ----- checks -----------------------------------------------------------------------------------
def _tensor(fn: str, arg: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise arg_error(fn, arg, type(t).__name__, "must be a torch.Tensor", "pass a tensor",
                        CommTypeError)
    if t.dtype not in _FLOATS:
        raise arg_error(fn, arg, f"<tensor dtype={t.dtype}>",
                        "must be float32, bfloat16 or float16 (the codecs quantize floats)",
                        "cast it (t.float()), or use the uncompressed commlib collective",
                        CommTypeError)
    return t


def _op(fn: str, op) -> bool:
    """True for AVG. Compression sums: the other reductions have no compressed form."""
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise arg_error(fn, "op", op, "compressed reductions support ReduceOp.SUM and AVG",
                        "use commlib.all_reduce (uncompressed) for MIN, MAX or PRODUCT")
    return op is ReduceOp.AVG


def _algorithm(fn: str, algorithm) -> str:
    if algorithm not in ALGORITHMS:
        raise arg_error(fn, "algorithm", algorithm, f"must be one of {ALGORITHMS}",
                        "pass 'auto' to let the cost model choose")
    return algorithm


def _feedback(fn: str, ef):
    if ef is not None and not isinstance(ef, ErrorFeedback):
        raise arg_error(fn, "error_feedback", type(ef).__name__,
                        "must be a commlib.compress.ErrorFeedback or None",
                        "pass error_feedback=commlib.compress.ErrorFeedback()", CommTypeError)
    return ef


# ----- the group's shape ------------------------------------------------------------------------
def _hosts(g) -> list[list[int]]:
    layout = getattr(g.resources, "layout", None)
    return [list(h) for h in layout.hosts] if layout is not None else [list(range(g.size))]


def _two_level(g) -> tuple[int, int] | None:
    """(ranks per host, hosts) where the group spans hosts with the same number of ranks, more
    than one, on every host; else None (``hierarchical`` is not eligible)."""
    hosts = _hosts(g)
    local = len(hosts[0])
    if len(hosts) > 1 and local > 1 and all(len(h) == local for h in hosts):
        return local, len(hosts)
    return None


def _level_groups(g):
    """(this rank's host group, this rank's rail group: the ranks of the same local index on
    every host), created collectively over ``g`` the first time."""
    pair = _GROUPS.get(g.name)
    if pair is None:
        hosts = _hosts(g)
        world = [[g.ranks[r] for r in h] for h in hosts]
        mine = mine_rail = None
        for h in world:
            made = commlib.new_group(h, group=g)
            mine = made if made.rank >= 0 else mine
        for i in range(len(world[0])):
            made = commlib.new_group([h[i] for h in world], group=g)
            mine_rail = made if made.rank >= 0 else mine_rail
        pair = _GROUPS[g.name] = (mine, mine_rail)
    return pair


# ----- pricing ----------------------------------------------------------------------------------
def _compressed_s(p: int, n: int, codec: Codec, link, rates) -> float:
    """The flat compressed all-reduce of ``n`` elements on ``p`` ranks over ``link``: encode
    everything, an all-to-all of p-1 chunks, decode p-1, encode one, an all-gather (a ring of
    p-1 steps), decode p."""
    c = -(-n // p)
    nb = codec.nbytes(c)
    comm = 2 * (p - 1) * link.step(nb)
    return comm + rates.encode_s * p * c + rates.decode_s * (2 * p - 1) * c


def predictions(n: int, dtype: torch.dtype, codec: Codec, g, rates) -> list[Prediction]:
    """Predicted seconds of every eligible algorithm for an all-reduce of ``n`` elements,
    cheapest first."""
    p = g.size
    plain, how = plain_seconds("all_reduce", n * torch.empty((), dtype=dtype).element_size(), g,
                               dtype)
    intra, slow, source = links(g)
    rows = [Prediction("uncompressed", plain, how)]
    if p > 1:
        rows.append(Prediction("compressed", _compressed_s(p, n, codec, slow, rates),
                               f"{codec!r}: all-to-all + all-gather of chunks, {source}"))
    shape = _two_level(g)
    if shape is not None:
        local, hosts = shape
        shard = -(-n // local)
        stage = 2 * (local - 1) * intra.step(4 * shard)  # float32 reduce-scatter + all-gather
        rows.append(Prediction("hierarchical",
                               stage + _compressed_s(hosts, shard, codec, slow, rates),
                               f"{codec!r} across hosts only, float32 inside, {source}"))
    return sorted(rows, key=lambda r: r.seconds)


def _choose(n: int, dtype: torch.dtype, c: Codec, g) -> str:
    """The cheapest algorithm, memoized per (group, size, dtype, codec) like commlib's own
    selection (made again when the tuning changes)."""
    key = (g.name, n, dtype, c.key, memo_key())
    hit = _CHOICES.get(key)
    if hit is None:
        hit = _CHOICES[key] = predictions(n, dtype, c, g, agreed_rates(g, c))[0].algorithm
    return hit


def explain(numel: int, codec, *, dtype: torch.dtype = torch.float32, group=None) -> Explanation:
    """What :func:`all_reduce` would choose for ``numel`` elements of ``dtype`` with ``codec`` on
    ``group``, and every row it priced (local: never communicates; the codec's rates are the
    group's agreed ones after its first compressed all-reduce, this rank's before)."""
    fn = "compress.explain"
    c = as_codec(codec)
    g = resolve_group(group, fn)
    rates = known_rates(g, c)
    rows = predictions(int(numel), dtype, c, g, rates)
    nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
    return Explanation("compressed all_reduce", nbytes, g.name, g.size,
                       f"the group's model; codec rates: {rates.source}", rows, rows[0].algorithm,
                       f"cheapest: {rows[0].algorithm}")


# ----- the compressed all-reduce ----------------------------------------------------------------
def all_reduce(tensor, *, codec, op=ReduceOp.SUM, group=None, async_op: bool = False,
               error_feedback: ErrorFeedback | None = None, algorithm: str = "auto", key=0):
    """Sum (or average) ``tensor`` across the group, moving compressed bytes; every rank gets the
    same result, in place.

    Args:
        tensor: float32, bfloat16 or float16, any shape.
        codec: a codec name (``"int8"``, ``"int4"``, ``"fp8"``, ``"topk"``) or a
            :class:`~commlib.compress.Codec`.
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        async_op: return a work whose ``wait()`` finishes the call (the first exchange is posted
            at once and advances on commlib's progress thread).
        error_feedback: an :class:`~commlib.compress.ErrorFeedback` carried across calls (one per
            tensor, or distinct ``key`` per tensor).
        algorithm: ``"auto"`` (the cheapest on the cost model: exact where compression does not
            pay), ``"uncompressed"``, ``"compressed"`` or ``"hierarchical"``.

    Error: every element is within ``codec.bound`` of each contribution, summed over the ``p``
    contributions, plus the bound of the reduced chunk's own encode (all_reduce is exact when the
    choice is ``uncompressed`` or the group has one rank).

    Example (2 ranks, int8): ``t = torch.full((4,), rank + 1.0)``; after
    ``commlib.compress.all_reduce(t, codec="int8", algorithm="compressed")`` every rank holds
    ``[3., 3., 3., 3.]`` (within the int8 bound of 3 / 127 / 2 per contribution).
    """
    fn = "compress.all_reduce"
    with checked_call(fn, group) as (g, call):
        t = _tensor(fn, "tensor", tensor)
        avg = _op(fn, op)
        c = as_codec(codec)
        algo = _algorithm(fn, algorithm)
        ef = _feedback(fn, error_feedback)
        if algo == "hierarchical" and _two_level(g) is None:
            raise arg_error(fn, "algorithm", algorithm,
                            "needs a group spanning hosts with the same number (> 1) of ranks "
                            f"on each (this one: {[len(h) for h in _hosts(g)]} per host)",
                            "pass 'auto' or 'compressed'")
        call.update(shape=tuple(t.shape), dtype=str(t.dtype), codec=repr(c), op=str(op),
                    algorithm=algo)
    n = t.numel()
    if algo == "auto":
        algo = "uncompressed" if g.size == 1 or n == 0 else _choose(n, t.dtype, c, g)
    if algo == "uncompressed" or g.size == 1 or n == 0:
        return commlib.all_reduce(t, op, group=g, async_op=async_op)
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
    if algo == "compressed":
        finish = _flat_all_reduce(flat, c, g, avg, ef, key)
    else:
        finish = _hierarchical(flat, c, g, avg, ef, key)

    def done():
        finish()
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(flat.view(t.shape))
        return None

    work = DeferredWork(done)
    return work if async_op else work.wait()


def _exchange_buffers(p: int, me: int, nb: int):
    """Send and receive buffers of the all-to-all of compressed chunks (``nb`` bytes to and from
    every other rank, nothing to itself) and its split sizes."""
    splits = [0 if j == me else nb for j in range(p)]
    return (torch.empty((p - 1) * nb, dtype=torch.uint8),
            torch.empty((p - 1) * nb, dtype=torch.uint8), splits)


def _slot(buf: torch.Tensor, j: int, me: int, nb: int) -> torch.Tensor:
    """Rank ``j``'s bytes in an exchange buffer (ranks in order, this rank's own left out)."""
    k = j - (j > me)
    return buf[k * nb:(k + 1) * nb]


def _scatter(x: torch.Tensor, m: int, c: Codec, g, ef, key) -> Callable[[], torch.Tensor]:
    """Post the all-to-all of ``x``'s blocks of ``m`` elements (block j, encoded, to rank j; the
    own block stays); return what waits and returns this rank's block summed in float32 (its own
    block exact, the others decoded and added in rank order)."""
    p, me = g.size, g.rank
    nb = c.nbytes(m)
    send, recv, splits = _exchange_buffers(p, me, nb)
    for j in range(p):
        if j != me:
            piece, wire = x[j * m:(j + 1) * m].float(), _slot(send, j, me, nb)
            if ef is None:
                c.encode(piece, out=wire)
            else:
                ef.encode(c, piece, key=(key, "send", j), out=wire)
    count("compress.wire", (p - 1) * nb)
    work = commlib.all_to_all_single(recv, send, splits, splits, group=g, async_op=True)

    def reduced() -> torch.Tensor:
        work.wait()
        acc = x[me * m:(me + 1) * m].float().clone()
        for i in range(p):
            if i != me:
                c.decode(c.packed(_slot(recv, i, me, nb), (m,), torch.float32), out=acc,
                         accumulate=True)
        return acc

    return reduced


def _gather(mine: torch.Tensor, c: Codec, g, out: torch.Tensor, ef=None, key=None) -> None:
    """Encode ``mine`` (float32) once, all-gather the encoded blocks, decode every block (this
    rank's too, so every rank holds the same values) into ``out`` (flat, group size x numel)."""
    p, m = g.size, mine.numel()
    nb = c.nbytes(m)
    wire = torch.empty(nb, dtype=torch.uint8)
    if ef is None:
        c.encode(mine, out=wire)
    else:
        ef.encode(c, mine, key=key, out=wire)
    every = torch.empty(p * nb, dtype=torch.uint8)
    count("compress.wire", (p - 1) * nb)
    commlib.all_gather_into_tensor(every, wire, group=g)
    for i in range(p):
        c.decode(c.packed(every[i * nb:(i + 1) * nb], (m,), torch.float32),
                 out=out[i * m:(i + 1) * m])


def _flat_all_reduce(x: torch.Tensor, c: Codec, g, avg: bool, ef, key) -> Callable[[], None]:
    """Post the all-to-all of compressed chunks now; return what finishes the call."""
    p, n = g.size, x.numel()
    chunk = -(-n // p)
    if x.dtype == torch.float32 and chunk * p == n:
        xf = x
    else:
        xf = torch.zeros(chunk * p, dtype=torch.float32)
        xf[:n] = x
    reduced = _scatter(xf, chunk, c, g, ef, key)

    def finish():
        acc = reduced()
        if avg:
            acc.div_(p)
        out = xf if xf.data_ptr() == x.data_ptr() else torch.empty_like(xf)
        _gather(acc, c, g, out, ef, (key, "own"))
        if out.data_ptr() != x.data_ptr():
            x.copy_(out[:n])

    return finish


def _hierarchical(x: torch.Tensor, c: Codec, g, avg: bool, ef, key) -> Callable[[], None]:
    """Float32 reduce-scatter inside the host (posted now), the compressed all-reduce of this
    rank's shard across hosts, float32 all-gather inside the host."""
    host, rail = _level_groups(g)
    local, n = host.size, x.numel()
    shard_n = -(-n // local)
    if x.dtype == torch.float32 and shard_n * local == n:
        buf = x  # reduced and gathered in place: no copy of the whole tensor
    else:
        buf = torch.zeros(shard_n * local, dtype=torch.float32)
        buf[:n] = x
    shard = torch.empty(shard_n, dtype=torch.float32)
    work = commlib.reduce_scatter_tensor(shard, buf, group=host, async_op=True)

    def finish():
        work.wait()
        _flat_all_reduce(shard, c, rail, False, ef, key)()
        if avg:
            shard.div_(g.size)
        commlib.all_gather_into_tensor(buf, shard, group=host)
        if buf.data_ptr() != x.data_ptr():
            x.copy_(buf[:n])

    return finish


# ----- the pieces on their own ------------------------------------------------------------------
def reduce_scatter_tensor(output, input, *, codec, op=ReduceOp.SUM, group=None,
                          error_feedback: ErrorFeedback | None = None, key=0):
    """Rank i gets block i of the sum (or average) of every rank's ``input`` (group size blocks of
    ``output.numel()`` elements), each block sent compressed (one all-to-all) and reduced in
    float32 with the rank's own block exact."""
    fn = "compress.reduce_scatter_tensor"
    with checked_call(fn, group) as (g, call):
        out, inp = _tensor(fn, "output", output), _tensor(fn, "input", input)
        avg = _op(fn, op)
        c = as_codec(codec)
        ef = _feedback(fn, error_feedback)
        if inp.numel() != g.size * out.numel():
            raise arg_error(fn, "input", f"<tensor numel={inp.numel()}>",
                            f"must hold group size ({g.size}) x output ({out.numel()}) elements",
                            "allocate input with group size times output's elements")
        call.update(out=tuple(out.shape), inp=tuple(inp.shape), codec=repr(c), op=str(op))
    acc = _scatter(inp.reshape(-1), out.numel(), c, g, ef, key)()
    if avg:
        acc.div_(g.size)
    out.copy_(acc.view(out.shape))


def all_gather_into_tensor(output, input, *, codec, group=None):
    """Every rank's ``input`` into ``output`` in rank order, each sent compressed once (one
    all-gather of the encoded blocks); every rank decodes every block, its own included, so all
    ranks hold the same values."""
    fn = "compress.all_gather_into_tensor"
    with checked_call(fn, group) as (g, call):
        out, inp = _tensor(fn, "output", output), _tensor(fn, "input", input)
        c = as_codec(codec)
        if out.numel() != g.size * inp.numel():
            raise arg_error(fn, "output", f"<tensor numel={out.numel()}>",
                            f"must hold group size ({g.size}) x input ({inp.numel()}) elements",
                            "allocate output with group size times input's elements")
        call.update(out=tuple(out.shape), inp=tuple(inp.shape), codec=repr(c))
    flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype)
    _gather(inp.reshape(-1).float(), c, g, flat)
    if flat.data_ptr() != out.data_ptr():
        out.copy_(flat.view(out.shape))


def send(tensor, dst: int, *, codec, group=None, tag: int = 0,
         error_feedback: ErrorFeedback | None = None, key=0) -> None:
    """Send ``tensor`` compressed to world rank ``dst`` (the receiver calls :func:`recv` with the
    same codec and a tensor of the same numel)."""
    fn = "compress.send"
    t = _tensor(fn, "tensor", tensor)
    c = as_codec(codec)
    ef = _feedback(fn, error_feedback)
    flat = t.reshape(-1)
    wire = torch.empty(c.nbytes(flat.numel(), t.dtype), dtype=torch.uint8)
    c.encode(flat, out=wire) if ef is None else ef.encode(c, flat, key=key, out=wire)
    count("compress.wire", wire.numel())
    commlib.send(wire, dst, group=group, tag=tag)


def recv(tensor, src: int, *, codec, group=None, tag: int = 0) -> None:
    """Receive into ``tensor`` what :func:`send` sent from world rank ``src`` with the same codec;
    ``tensor`` gets the decoded values in its dtype."""
    fn = "compress.recv"
    t = _tensor(fn, "tensor", tensor)
    c = as_codec(codec)
    wire = torch.empty(c.nbytes(t.numel(), t.dtype), dtype=torch.uint8)
    commlib.recv(wire, src, group=group, tag=tag)
    flat = t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype)
    c.decode(c.packed(wire, (t.numel(),), t.dtype), out=flat)
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view(t.shape))


def wire_bytes(numel: int, p: int, codec) -> int:
    """Bytes one rank sends in a flat compressed all-reduce of ``numel`` elements on ``p`` ranks:
    2 (p-1) nbytes(ceil(numel / p)) (the formula the benchmark checks its count against)."""
    return 2 * (p - 1) * as_codec(codec).nbytes(math.ceil(numel / p)) if p > 1 else 0

"""The reshard tests' oracle, shared by tests/test_reshard.py (pure) and tests/mpi/reshard_cases.py
(on ranks): meshes as nested lists of world ranks, and a rank's piece cut with torch.chunk along
each Shard in mesh-dimension order (the DTensor rule), independently of commlib.reshard."""

from __future__ import annotations

import numpy as np

from commlib.reshard import Partial, Replicate, Shard


def unravel(pos, shape):
    out = []
    for s in reversed(shape):
        out.append(pos % s)
        pos //= s
    return tuple(reversed(out))


def shape_of(ranks):
    return np.asarray(ranks).shape


def flat(ranks):
    return [int(r) for r in np.asarray(ranks).reshape(-1)]


def coords(ranks, rank):
    return unravel(flat(ranks).index(rank), shape_of(ranks))


def chunk_piece(t, mesh_shape, placements, c):
    """The piece of ``t`` at mesh coordinates ``c``: torch.chunk along each Shard, mesh dims in
    order (a trailing chunk torch.chunk does not return is empty, at the end of its parent)."""
    for md, p in enumerate(placements):
        if isinstance(p, Shard):
            pieces = t.chunk(mesh_shape[md], p.dim)
            t = pieces[c[md]] if c[md] < len(pieces) else t.narrow(p.dim, t.shape[p.dim], 0)
    return t


def random_mesh(rng, ranks):
    """``ranks`` (a list) shaped as a 1-D or 2-D mesh, as nested lists."""
    k = len(ranks)
    if rng.random() < 0.45:
        return list(ranks)
    a = rng.choice([d for d in range(1, k + 1) if k % d == 0])
    return [list(ranks[i * (k // a):(i + 1) * (k // a)]) for i in range(a)]


def random_placements(rng, mesh_ndim, ndim, source):
    kinds = [Shard(d) for d in range(ndim)] + [Replicate()] + ([Partial()] if source else [])
    return [rng.choice(kinds) for _ in range(mesh_ndim)]

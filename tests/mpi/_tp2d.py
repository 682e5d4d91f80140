"""What the 2D tensor-parallel cases share (tp2d_cases.py, tp2d_layers.py): the meshes of a world
size, a rank's block of a global tensor sliced by the layout's definition (never with the
library's helpers), seeded data, and the relative-error check."""

from __future__ import annotations

import torch

import commlib

_MESHES: dict = {}


def mesh_of(shape):
    """The world's mesh of ``shape``, built once (creating a mesh is collective)."""
    if shape not in _MESHES:
        _MESHES[shape] = commlib.Mesh(shape)
    return _MESHES[shape]


def meshes():
    """(1, n), (n, 1) and (2, n/2) for even n >= 4."""
    n = commlib.get_world_size()
    shapes = [(1, n), (n, 1)] + ([(2, n // 2)] if n % 2 == 0 and n >= 4 else [])
    return [mesh_of(shape) for shape in dict.fromkeys(shapes)]


def rows(t, mesh):
    """Rows block i of dim 0."""
    (r, _), (i, _) = mesh.shape, mesh.coords
    n = t.shape[0] // r
    return t.narrow(0, i * n, n)


def block(t, mesh):
    """Rows block i of dim 0, block j of the last dim: rank (i, j)'s part of the activation (a
    view of ``t``)."""
    (_, c), (_, j) = mesh.shape, mesh.coords
    h = t.shape[-1] // c
    return rows(t, mesh).narrow(-1, j * h, h)


def data(shape, seed, dtype, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (shift + scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


def close(name, got, want, rtol):
    """``got`` (any dtype) within ``rtol * max |want|`` of ``want``."""
    assert got is not None, f"{name}: no gradient"
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got.detach().double() - want.detach().double()).abs().max().item()
    bound = rtol * max(want.detach().double().abs().max().item(), 1e-30)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (rank {commlib.get_rank()})"

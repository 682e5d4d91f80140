"""Object collectives: torch.distributed's ``all_gather_object``, ``broadcast_object_list``,
``gather_object`` and ``scatter_object_list``, with its signatures.

Objects are pickled into uint8 tensors and moved by the tensor collectives of
:mod:`commlib.api.collectives`, in two steps as torch's are: the byte counts, then the bytes.

The first step is always one all-gather of a small header from every rank: whether the rank's own
checks passed (its arguments, pickling its objects), the root it was given, and its counts. So a
rank whose object does not pickle, whose list is wrong, or which names another root makes every
rank raise (its own ``CommArgumentError``/``CommTypeError`` on that rank, ``CommMismatchError``
naming it on the others) in every mode, where torch leaves the other ranks waiting for it.

Pickle runs arbitrary code while loading: call these only with data you trust (as torch warns).
"""

from __future__ import annotations

import pickle

import torch

from ..errors import CommArgumentError, CommError, CommMismatchError, CommTypeError, arg_error
from ..runtime.group import Group
from .collectives import (
    all_gather_into_tensor,
    all_to_all_single,
    broadcast,
    root_rank,
    scatter,
)
from .groups import resolve_group

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]

_COUNT = 8  # bytes of the int64 byte count that heads each block of scatter_object_list


def _kind(value) -> str:
    if isinstance(value, (list, tuple)):
        return f"<list of {len(value)}>"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _device(group: Group, device=None) -> torch.device:
    """Where the pickled bytes travel: ``device`` if given, else host memory where the engine
    moves it, else the current CUDA device (the NCCL engines)."""
    if device is not None:
        return torch.device(device)
    if "cpu" in group.backend.devices:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _pickle(fn: str, arg: str, obj) -> torch.Tensor:
    try:
        data = pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - pickling runs the object's own code
        raise arg_error(fn, arg, f"<{type(obj).__module__}.{type(obj).__qualname__}>",
                        f"cannot be pickled ({type(exc).__name__}: {exc})",
                        "pass a picklable object (no open files, locks, sockets or lambdas)",
                        CommTypeError) from exc
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _unpickle(fn: str, buf: torch.Tensor, source: int):
    try:
        return pickle.loads(buf.cpu().numpy().tobytes())
    except Exception as exc:  # noqa: BLE001 - unpickling runs the object's own code
        raise CommTypeError(
            f"commlib.{fn}(): the object from group rank {source} cannot be unpickled on this rank "
            f"({type(exc).__name__}: {exc}). Fix: make its class importable under the same name "
            f"on every rank.") from exc


def _headers(fn: str, g: Group, device: torch.device, error: CommError | None, root: int,
             values: list[int]) -> list[list[int]]:
    """Step one: all-gather ``[failed, root, *values]`` from every rank (``values`` of the same
    length everywhere) and return the rows; raise on every rank if one failed its checks or the
    ranks name different roots."""
    row = torch.tensor([int(error is not None), root, *values], dtype=torch.int64)
    out = torch.empty(g.size * row.numel(), dtype=torch.int64, device=device)
    all_gather_into_tensor(out, row.to(device), group=g)
    table = out.view(g.size, -1).tolist()
    if error is not None:
        raise error
    failed = [r for r, entry in enumerate(table) if entry[0]]
    if failed:
        raise CommMismatchError(
            f"commlib.{fn}: group rank{'s' if len(failed) > 1 else ''} {failed} of group "
            f"{g.name!r} failed {'their' if len(failed) > 1 else 'its'} argument checks (the error "
            f"raised there says why); this rank raises too instead of waiting. Fix: correct the "
            f"call on those ranks.")
    roots = [entry[1] for entry in table]
    if len(set(roots)) > 1:
        raise CommMismatchError(
            f"commlib.{fn}: ranks of group {g.name!r} name different roots (group rank of the root "
            f"as given on each group rank: {roots}). Fix: pass the same src/dst on every rank.")
    return table


def all_gather_object(object_list: list, obj, group: Group | None = None) -> None:
    """Gather every rank's picklable ``obj`` into ``object_list`` (group size entries) on every
    rank: ``object_list[i]`` becomes (an unpickled copy of) rank i's ``obj``.

    Moves the byte counts (one all-gather of a few integers), then every rank's pickled bytes
    padded to the largest (one ``all_gather_single``), as torch does.

    Example (3 ranks): ``out = [None] * 3``; after ``all_gather_object(out, {"rank": rank})``
    every rank holds ``[{'rank': 0}, {'rank': 1}, {'rank': 2}]``.
    """
    fn = "all_gather_object"
    g = resolve_group(group, fn)
    device = _device(g)
    error, data = None, None
    try:
        if not isinstance(object_list, list) or len(object_list) != g.size:
            raise arg_error(fn, "object_list", _kind(object_list),
                            f"must be a list of group size ({g.size}) entries",
                            f"pass [None] * {g.size}",
                            CommArgumentError if isinstance(object_list, list) else CommTypeError)
        data = _pickle(fn, "obj", obj)
    except CommError as exc:
        error = exc
    table = _headers(fn, g, device, error, 0, [0 if data is None else data.numel()])
    sizes = [entry[2] for entry in table]
    width = max(sizes)
    block = torch.zeros(width, dtype=torch.uint8, device=device)
    block[:data.numel()] = data.to(device)
    out = torch.empty(g.size * width, dtype=torch.uint8, device=device)
    all_gather_into_tensor(out, block, group=g)
    for r, n in enumerate(sizes):
        object_list[r] = _unpickle(fn, out[r * width:r * width + n], r)


def gather_object(obj, object_gather_list: list | None = None, dst: int | None = None,
                  group: Group | None = None, group_dst: int | None = None) -> None:
    """Gather every rank's picklable ``obj`` into ``object_gather_list`` on rank ``dst`` (a world
    rank; or ``group_dst``; default group rank 0).

    ``object_gather_list`` is a list of group size entries on the root and None elsewhere. The
    byte counts travel first (one all-gather of a few integers), then each rank's exact bytes to
    the root only (an all-to-all with split sizes that are zero except to the root).

    Example (3 ranks): ``out = [None] * 3 if rank == 0 else None``; after
    ``gather_object(f"rank {rank}", out)`` rank 0 holds ``['rank 0', 'rank 1', 'rank 2']``.
    """
    fn = "gather_object"
    g = resolve_group(group, fn)
    device = _device(g)
    error, root, data = None, -1, None
    try:
        root = root_rank(fn, g, "dst", dst, group_dst)
        if g.rank == root:
            if object_gather_list is None:
                raise arg_error(fn, "object_gather_list", None,
                                f"is required on the root (group rank {root}, this rank)",
                                f"pass [None] * {g.size} on the root")
            if not isinstance(object_gather_list, list) or len(object_gather_list) != g.size:
                raise arg_error(fn, "object_gather_list", _kind(object_gather_list),
                                f"must be a list of group size ({g.size}) entries on the root "
                                f"(group rank {root}, this rank)", f"pass [None] * {g.size}",
                                CommArgumentError if isinstance(object_gather_list, list)
                                else CommTypeError)
        elif object_gather_list is not None and not (
                isinstance(object_gather_list, (list, tuple)) and len(object_gather_list) == 0):
            raise arg_error(fn, "object_gather_list", _kind(object_gather_list),
                            f"is given on group rank {g.rank}, but only the root (group rank "
                            f"{root}) receives the objects",
                            "pass object_gather_list=None on every other rank")
        data = _pickle(fn, "obj", obj)
    except CommError as exc:
        error = exc
    table = _headers(fn, g, device, error, root, [0 if data is None else data.numel()])
    sizes = [entry[2] for entry in table]
    to_root = [0] * g.size
    to_root[root] = data.numel()
    incoming = sizes if g.rank == root else [0] * g.size
    out = torch.empty(sum(incoming), dtype=torch.uint8, device=device)
    all_to_all_single(out, data.to(device), incoming, to_root, group=g)
    if g.rank == root:
        offset = 0
        for r, n in enumerate(sizes):
            object_gather_list[r] = _unpickle(fn, out[offset:offset + n], r)
            offset += n


def broadcast_object_list(object_list: list, src: int | None = None, group: Group | None = None,
                          device=None, group_src: int | None = None) -> None:
    """Replace the entries of ``object_list`` on every rank by those of rank ``src`` (a world rank;
    or ``group_src``; default group rank 0), which must be picklable.

    Every rank passes a list of the same length. ``device``: where the bytes travel (default:
    host memory, or the current CUDA device on the NCCL engines). The counts travel with every
    rank's header (one all-gather of a few integers), then the source's byte counts and bytes in
    one ``broadcast``.

    Example (3 ranks): ``objs = ["a", {"b": 1}] if rank == 0 else [None, None]``; after
    ``broadcast_object_list(objs, src=0)`` every rank holds ``['a', {'b': 1}]``.
    """
    fn = "broadcast_object_list"
    g = resolve_group(group, fn)
    error, root, datas = None, -1, []
    count = len(object_list) if isinstance(object_list, list) else -1
    dev = None
    try:
        root = root_rank(fn, g, "src", src, group_src)
        if not isinstance(object_list, list):
            raise arg_error(fn, "object_list", _kind(object_list), "must be a list",
                            "pass a list of the same length on every rank, e.g. [None] * n "
                            "off the source", CommTypeError)
        try:
            dev = _device(g, device)
        except (RuntimeError, TypeError) as exc:
            raise arg_error(fn, "device", device, f"is not a device ({exc})",
                            "pass e.g. torch.device('cpu'), or None") from exc
        if g.rank == root:
            datas = [_pickle(fn, f"object_list[{i}]", o) for i, o in enumerate(object_list)]
    except CommError as exc:
        error = exc
    device_ = dev if dev is not None else _device(g)
    table = _headers(fn, g, device_, error, root, [count, sum(d.numel() for d in datas)])
    count, total = table[root][2], table[root][3]
    differ = [r for r, entry in enumerate(table) if entry[2] != count]
    if differ:
        raise CommMismatchError(
            f"commlib.{fn}: object_list has {count} entries on the source (group rank {root}) "
            f"but another length on group ranks {differ} (lengths by group rank: "
            f"{[entry[2] for entry in table]}). Fix: pass lists of one length on every rank.")
    if g.rank == root:
        sizes = torch.tensor([d.numel() for d in datas], dtype=torch.int64)
        buf = torch.cat([sizes.view(torch.uint8), *datas]).to(device_)
    else:
        buf = torch.empty(_COUNT * count + total, dtype=torch.uint8, device=device_)
    broadcast(buf, group=g, group_src=root)
    if g.rank == root:
        return
    sizes = buf[:_COUNT * count].cpu().clone().view(torch.int64).tolist()
    offset = _COUNT * count
    for i, n in enumerate(sizes):
        object_list[i] = _unpickle(fn, buf[offset:offset + n], root)
        offset += n


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: list | None = None,
                        src: int | None = None, group: Group | None = None,
                        group_src: int | None = None) -> None:
    """Rank i receives ``scatter_object_input_list[i]`` of rank ``src`` (a world rank; or
    ``group_src``; default group rank 0) as ``scatter_object_output_list[0]``.

    The input list (group size picklable objects) is read on the source only, and ignored
    elsewhere (as torch does). The largest byte count travels with the headers (one all-gather
    of a few integers), then each rank's block, its byte count and its bytes padded to the
    largest, in one ``scatter``.

    Example (3 ranks): ``out = [None]``; after ``scatter_object_list(out, ["x", "y", "z"] if
    rank == 0 else None)`` rank 0 holds ``out == ['x']``, rank 1 ``['y']``, rank 2 ``['z']``.
    """
    fn = "scatter_object_list"
    g = resolve_group(group, fn)
    device = _device(g)
    error, root, datas = None, -1, []
    try:
        root = root_rank(fn, g, "src", src, group_src)
        out_list = scatter_object_output_list
        if not isinstance(out_list, list) or len(out_list) < 1:
            raise arg_error(fn, "scatter_object_output_list", _kind(out_list),
                            "must be a non-empty list (its first entry receives this rank's "
                            "object)", "pass [None]",
                            CommArgumentError if isinstance(out_list, list) else CommTypeError)
        if g.rank == root:
            ins = scatter_object_input_list
            if not isinstance(ins, (list, tuple)) or len(ins) != g.size:
                raise arg_error(fn, "scatter_object_input_list", _kind(ins),
                                f"must be a list of group size ({g.size}) objects on the source "
                                f"(group rank {root}, this rank)",
                                "pass one object per rank of the group",
                                CommArgumentError if isinstance(ins, (list, tuple)) else CommTypeError)
            datas = [_pickle(fn, f"scatter_object_input_list[{i}]", o) for i, o in enumerate(ins)]
    except CommError as exc:
        error = exc
    table = _headers(fn, g, device, error, root, [max((d.numel() for d in datas), default=0)])
    width = _COUNT + table[root][2]
    blocks = None
    if g.rank == root:
        packed = torch.zeros(g.size, width, dtype=torch.uint8)
        for i, d in enumerate(datas):
            packed[i, :_COUNT] = torch.tensor([d.numel()], dtype=torch.int64).view(torch.uint8)
            packed[i, _COUNT:_COUNT + d.numel()] = d
        blocks = list(packed.to(device))
    mine = torch.empty(width, dtype=torch.uint8, device=device)
    scatter(mine, blocks, group=g, group_src=root)
    n = int(mine[:_COUNT].cpu().clone().view(torch.int64))
    scatter_object_output_list[0] = _unpickle(fn, mine[_COUNT:_COUNT + n], root)

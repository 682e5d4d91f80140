"""The tuning file: what ``bench/calibrate.py`` measured on a host, for the cost model.

Layout (JSON)::

    {"format": "commlib-tuning/1", "host": "<host id>", "commlib": "0.1.0",
     "groups": {"mpi/2": {"links": {"shm": {"alpha": s, "beta": s_per_byte, "gamma": s_per_byte,
                                            "steps": {"8": s, ...}}},
                          "curves": {"all_reduce": {"native": {"8": s, ...}, "shm_oneshot": {...}},
                                     ...},
                          "measured": "2026-11-23T18:50:00Z"},
                "mpi/4": {...}}}

One entry per (backend, group size, hosts): ``mpi/4`` for 4 ranks on one host, ``mpi/4@2`` for 4
ranks on 2 hosts, ``mpi/2@2`` for one rank on each of 2 (its group link is ``net``). A link's α
and β are measured with every rank of a group of that size busy (a ring shift), so they include
the contention of oversubscribed cores, and the engine's collectives differ by size. Entries
across hosts also hold ``net`` (the link between hosts, one pair crossing) and ``net_rails``
(every local rank's pair crossing at once, as in the hierarchical algorithm), each with ``busy``:
the share of a transfer's time that a matmul running beside it lost (the cores the network's
work took; planners price what overlap cannot hide with it).
:func:`load` finds the file: ``COMMLIB_TUNING_FILE``, else the
per-host cache ``$XDG_CACHE_HOME/commlib/tuning-<host hash>.json`` (``~/.cache`` by default).
"""

from __future__ import annotations

import json
import os
import pathlib
import time

from .. import config
from ..version import __version__
from ..errors import CommConfigError
from ..topology.host import host_hash, host_id
from .model import Curve, LinkCost, Table

__all__ = ["FORMAT", "default_path", "tuning_path", "load", "entry_key", "make_entry", "save_entry",
           "put_entry", "table_for",
           "link_to_json", "link_from_json", "fit_alpha_beta"]

FORMAT = "commlib-tuning/1"


def default_path() -> pathlib.Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "commlib" / f"tuning-{host_hash():016x}.json"


def tuning_path() -> pathlib.Path:
    explicit = config.get("tuning_file")
    return pathlib.Path(explicit) if explicit else default_path()


def _read(path: pathlib.Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CommConfigError(
            f"commlib: tuning file {path} is not valid JSON (line {exc.lineno}: {exc.msg}). "
            f"Fix: run bench/calibrate.py again or delete the file.") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CommConfigError(
            f"commlib: tuning file {path} has format {doc.get('format') if isinstance(doc, dict) else None!r}, "
            f"expected {FORMAT!r}. Fix: run bench/calibrate.py again or delete the file.")
    return doc


def load(path: str | os.PathLike | None = None) -> dict | None:
    """The tuning document at ``path`` (default :func:`tuning_path`), or None when there is no
    file. A file that exists but does not parse raises ``CommConfigError`` naming it."""
    p = pathlib.Path(path) if path is not None else tuning_path()
    if not p.exists():
        if path is not None or config.get("tuning_file"):
            raise CommConfigError(
                f"commlib: tuning file {p} does not exist. Fix: run "
                f"`mpirun -n N python bench/calibrate.py --out {p}` or unset COMMLIB_TUNING_FILE.")
        return None
    return _read(p)


def entry_key(backend: str, size: int, hosts: int = 1) -> str:
    return f"{backend}/{size}" if hosts <= 1 else f"{backend}/{size}@{hosts}"


def make_entry(links: dict[str, LinkCost], curves: dict[str, dict[str, dict[int, float]]],
               probe: dict | None = None) -> dict:
    """One group shape's entry: link costs by class, measured curves ``{collective: {algorithm:
    {nbytes: s}}}`` and, for an entry measured by a job's own probe (:mod:`commlib.tuning.probe`),
    how (``probe``: ``how``, the words ``explain`` prints, and what was timed)."""
    entry = {
        "links": {k: link_to_json(v) for k, v in links.items()},
        "curves": {c: {a: {str(n): t for n, t in sorted(pts.items())} for a, pts in algos.items()}
                   for c, algos in curves.items()},
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if probe is not None:
        entry["probe"] = probe
    return entry


def save_entry(path: str | os.PathLike, key: str, links: dict[str, LinkCost],
               curves: dict[str, dict[str, dict[int, float]]], probe: dict | None = None) -> None:
    """Merge the measurements of one group shape (``key``, see :func:`entry_key`) into the file at
    ``path`` (:func:`make_entry`, :func:`put_entry`)."""
    put_entry(path, key, make_entry(links, curves, probe))


def put_entry(path: str | os.PathLike, key: str, entry: dict) -> None:
    """Merge one group shape's ``entry`` (:func:`make_entry`) into the file at ``path``."""
    p = pathlib.Path(path)
    doc = _read(p) if p.exists() else {"format": FORMAT, "host": host_id(), "groups": {}}
    doc["commlib"] = __version__
    doc["groups"][key] = entry
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    tmp.replace(p)


def link_to_json(link: LinkCost) -> dict:
    out = {"alpha": link.alpha, "beta": link.beta, "gamma": link.gamma}
    if link.curve is not None:
        out["steps"] = link.curve.to_json()
    if link.busy:
        out["busy"] = link.busy
    return out


def link_from_json(entry: dict) -> LinkCost:
    steps = entry.get("steps")
    curve = Curve.from_json(steps) if steps and len(steps) >= 2 else None
    return LinkCost(entry["alpha"], entry["beta"], entry.get("gamma", 0.0), curve,
                    entry.get("busy", 0.0))


def table_for(doc: dict | None, backend: str, size: int, hosts: int = 1,
              link_class: str = "shm") -> Table | None:
    """The model's :class:`Table` for a group of ``size`` ranks on ``hosts`` hosts on ``backend``:
    the entry of that shape, else (on one host) the nearest measured size of that backend (its
    measured curves only when the size matches, since engines change algorithm with the group
    size). None without a usable entry."""
    if not doc:
        return None
    if hosts > 1:
        entry = doc.get("groups", {}).get(entry_key(backend, size, hosts))
        if entry is None or _link(entry, link_class) is None:
            return None
        entries = {size: entry}
    else:
        entries = {int(k.split("/")[1]): v for k, v in doc.get("groups", {}).items()
                   if k.split("/")[0] == backend and "@" not in k}
    if not entries:
        return None
    nearest = min(entries, key=lambda s: (abs(s - size), s))
    entry = entries[nearest]
    link = _link(entry, link_class)
    if link is None:
        return None
    curves: dict[str, dict[str, Curve]] = {}
    if nearest == size:
        for c, algos in entry.get("curves", {}).items():
            curves[c] = {a: Curve.from_json(pts) for a, pts in algos.items() if len(pts) >= 2}
    return Table(link_from_json(link), curves)


def _link(entry: dict, link_class: str):
    """An entry's link of ``link_class``. With one rank per host (``mpi/2@2``) the group's own
    link (``shm``, measured inside a host) is the one between hosts, ``net``."""
    links = entry["links"]
    if link_class == "shm" and "shm" not in links:
        return links.get("net")
    return links.get(link_class)


def fit_alpha_beta(points: dict[int, float]) -> tuple[float, float]:
    """α and β of ``t = α + n·β`` fitted to measured ``{nbytes: seconds}`` by least squares on
    relative error (each point weighs 1/t², so small and large messages count alike). Both are
    clamped to be non-negative."""
    # Minimise sum(((a + n b) - t)^2 / t^2): the 2x2 normal equations.
    s00 = s01 = s11 = r0 = r1 = 0.0
    for n, t in points.items():
        w = 1.0 / (t * t)
        s00 += w
        s01 += w * n
        s11 += w * n * n
        r0 += w * t
        r1 += w * n * t
    det = s00 * s11 - s01 * s01
    if det <= 0:
        raise ValueError("fit_alpha_beta needs at least two distinct sizes")
    alpha = (r0 * s11 - r1 * s01) / det
    beta = (s00 * r1 - s01 * r0) / det
    return max(alpha, 0.0), max(beta, 0.0)

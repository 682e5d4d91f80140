"""Selection by the cost model: for each call, predict every eligible algorithm and take the
cheapest.

Every rank of a group must pick the same algorithm, so every rank must hold the same model. At
group creation (collective, like creating the group itself) rank 0 builds the group's
:class:`~commlib.tuning.model.Table` and broadcasts it; the others use what arrives. Rank 0's
table comes from the tuning file (``bench/calibrate.py``) when it has an entry for this backend,
else from defaults refined by a quick built-in probe (this host's copy and reduce bandwidth,
about 10 ms, once per process).

Eligibility: an algorithm the collective has, and for which the group qualifies: ``shm*`` only
where the group has a shared-memory segment, ``hierarchical`` only where the group spans hosts
with more than one rank on some host (priced where every host has the same number of ranks).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from ..algorithms import algorithm_names
from ..errors import CommConfigError
from ..algorithms.hierarchical import host_layout
from .calibration import entry_key, link_from_json, link_to_json, load, table_for
from .model import DEFAULT_LINKS, SHM_ALGORITHMS, Curve, LinkCost, Prediction, Table, predict

__all__ = ["GroupModel", "setup", "eligible", "predictions", "Explanation", "explain_group"]

log = logging.getLogger("commlib")


@dataclass
class GroupModel:
    """What selection knows about a group: its agreed table, where it came from, and layout."""

    table: Table
    source: str
    has_shm: bool
    hierarchical: bool


_PROBE: dict | None = None


def _probe() -> dict:
    """This host's single-thread copy and float32-add bandwidth (s/B), once per process."""
    global _PROBE
    if _PROBE is None:
        a = torch.ones(1 << 20)  # 4 MiB
        b = torch.ones(1 << 20)
        best_copy = best_add = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            a.copy_(b)
            t1 = time.perf_counter()
            a.add_(b)
            t2 = time.perf_counter()
            best_copy, best_add = min(best_copy, t1 - t0), min(best_add, t2 - t1)
        _PROBE = {"beta": best_copy / a.nbytes, "gamma": best_add / a.nbytes}
    return _PROBE


def _table_json(table: Table) -> dict:
    def link(c: LinkCost | None):
        return None if c is None else link_to_json(c)

    return {"link": link(table.link), "inter": link(table.inter), "shard_inter": link(table.shard_inter),
            "shm": link(table.shm), "local": table.local, "base": table.base,
            "curves": {c: {a: cv.to_json() for a, cv in algos.items()} for c, algos in table.curves.items()}}


def _table_from_json(doc: dict) -> Table:
    def link(d):
        return None if d is None else link_from_json(d)

    curves = {c: {a: Curve.from_json(pts) for a, pts in algos.items()} for c, algos in doc["curves"].items()}
    return Table(link(doc["link"]), curves, doc["local"], link(doc["inter"]), doc["base"],
                 link(doc["shard_inter"]), link(doc["shm"]))


def _default_table() -> Table:
    """Uncalibrated CPU defaults, with this host's copy and reduce bandwidth from the probe."""
    probe = _probe()
    step, sync = DEFAULT_LINKS["shm"], DEFAULT_LINKS["shm_sync"]
    table = Table(LinkCost(step.alpha, 3 * probe["beta"], probe["gamma"]))
    table.shm = LinkCost(sync.alpha, probe["beta"], probe["gamma"])
    return table


def _local_table(group, layout) -> tuple[Table, str]:
    """Rank 0's view: the tuning file's entry for this group's shape (size, hosts), else
    defaults with the probe. Across hosts: intra-host links from the host's own entry if the
    group's has none, and ``net`` defaults where the file has no measured ``net`` link."""
    backend = group.backend.name
    hosts = len(layout.hosts) if layout.spans_hosts else 1
    try:
        doc = load()
    except CommConfigError as exc:  # a broken file must not stop the job: say so, use defaults
        log.warning("%s Using the defaults.", exc)
        doc, why = None, f"defaults and probe (tuning file unusable: {exc})"
    else:
        why = "defaults and probe (no calibration: run bench/calibrate.py)"
    key = entry_key(backend, group.size, hosts)
    table = table_for(doc, backend, group.size, hosts)
    links = {}
    if table is not None:
        entry = doc["groups"].get(key)
        if entry is not None:
            source, links = f"tuning file, entry {key}", entry["links"]
        else:  # the nearest size's link costs (table_for), no curves
            source = f"tuning file, nearest entry to {key} (link costs only)"
    else:
        table, source = _default_table(), why
    if hosts > 1 and layout.uniform:
        per_host = layout.ranks_per_host
        table.local = per_host
        if "shm" not in links:
            intra = table_for(doc, backend, per_host)
            if intra is not None:
                table.link = intra.link
                source += f"; intra-host link from entry {entry_key(backend, per_host)}"
        table.inter = link_from_json(links["net"]) if "net" in links else DEFAULT_LINKS["net"]
        if "net_rails" in links:
            table.shard_inter = link_from_json(links["net_rails"])
        else:  # every local rank's shard crosses at once: they share the hosts' links
            table.shard_inter = LinkCost(table.inter.alpha, table.inter.beta * per_host, table.inter.gamma)
    return table, source


def setup(group) -> GroupModel:
    """Collective over ``group``: its agreed model (rank 0's, broadcast)."""
    backend = group.backend
    layout = host_layout(backend)
    has_shm = getattr(group, "shm", None) is not None
    length = torch.zeros(1, dtype=torch.int64)
    payload = b""
    if backend.rank == 0:
        try:
            table, source = _local_table(group, layout)
        except Exception as exc:  # noqa: BLE001 - rank 0 must still send a model, or the others wait
            log.warning("commlib: building the cost model failed (%s: %s); using the defaults",
                        type(exc).__name__, exc)
            table, source = _default_table(), f"defaults and probe (model failed: {exc})"
        payload = json.dumps({"table": _table_json(table), "source": source}).encode()
        length[0] = len(payload)
    if group.size > 1:
        backend.wait([backend.broadcast(length, 0, True)])
        buf = torch.zeros(int(length[0]), dtype=torch.uint8)
        if backend.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        backend.wait([backend.broadcast(buf, 0, True)])
        payload = bytes(buf.tolist()) if backend.rank else payload
    doc = json.loads(payload.decode())
    return GroupModel(_table_from_json(doc["table"]), doc["source"], has_shm, layout.spans_hosts)


def eligible(collective: str, model: GroupModel) -> list[str]:
    out = []
    for name in algorithm_names(collective):
        if name in SHM_ALGORITHMS and not model.has_shm:
            continue
        if name == "hierarchical" and not model.hierarchical:
            continue
        out.append(name)
    return out


def predictions(collective: str, nbytes: int, group, model: GroupModel,
                widen: int = 1) -> list[Prediction]:
    """Every eligible algorithm's predicted time, cheapest first (one rank: native, free).

    ``widen`` > 1: the reduction's dtype is one the engine cannot accumulate (float16/bfloat16 on
    MPI or gloo), so every algorithm but the shared-memory ones (which reduce every dtype
    themselves) runs on a copy ``widen`` times larger (float32) and pays the casts to it and
    back: two copies of ``widen * nbytes``, priced at the table's per-byte copy cost."""
    if group.size == 1:
        return [Prediction("native", 0.0, "formula")]
    names = eligible(collective, model)
    if widen == 1:
        return predict(collective, nbytes, group.size, model.table, names)
    own = [n for n in names if n in SHM_ALGORITHMS]
    rest = [n for n in names if n not in SHM_ALGORITHMS]
    upcast = []
    if rest:
        cast = 2 * widen * nbytes * (model.table.shm or model.table.link).beta
        upcast = [Prediction(x.algorithm, x.seconds + cast, x.how + f" (x{widen} upcast)")
                  for x in predict(collective, widen * nbytes, group.size, model.table, rest)]
    return predict(collective, nbytes, group.size, model.table, own, extra=upcast)


@dataclass
class Explanation:
    """What :func:`commlib.tuning.explain` returns: the predictions and the pick, printable."""

    collective: str
    nbytes: int
    group: str
    size: int
    source: str
    rows: list[Prediction]
    chosen: str
    why: str

    def __str__(self) -> str:
        lines = [f"{self.collective} of {self.nbytes} bytes on group {self.group!r} ({self.size} ranks); "
                 f"model from {self.source}",
                 f"  {'algorithm':20} {'predicted us':>13}  how"]
        for r in self.rows:
            mark = "  <- chosen" if r.algorithm == self.chosen else ""
            lines.append(f"  {r.algorithm:20} {r.seconds * 1e6:13.2f}  {r.how}{mark}")
        if not any(r.algorithm == self.chosen for r in self.rows):
            lines.append(f"  chosen: {self.chosen}")
        lines.append(f"  ({self.why})")
        return "\n".join(lines)


def explain_group(collective: str, nbytes: int, group, model: GroupModel, chosen: str,
                  why: str, widen: int = 1) -> Explanation:
    return Explanation(collective, nbytes, group.name, group.size, model.source,
                       predictions(collective, nbytes, group, model, widen), chosen, why)

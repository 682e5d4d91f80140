"""Selection by the cost model: for each call, predict every eligible algorithm and take the
cheapest.

Every rank of a group must pick the same algorithm, so every rank must hold the same model. At
group creation the runtime (commlib/runtime/resources.py, collective like creating the group
itself) has rank 0 build the group's :class:`~commlib.tuning.model.Table` (:func:`local_model`)
and broadcasts it (:func:`model_to_bytes`, :func:`model_from_bytes`); the others use what
arrives. Rank 0's table comes from the tuning file (``bench/calibrate.py``) when it has an entry
for this backend, else from defaults refined by a quick built-in probe (this host's copy and
reduce bandwidth, about 10 ms, once per process). Nothing here communicates.

Eligibility is each algorithm's record's (:meth:`commlib.algorithms.Algorithm.why_not`) over the
group's resources and the call: ``shm*`` only where the group has a shared-memory segment,
``cuda_ipc_*`` only for CUDA tensors where the group has CUDA IPC and the kernels' rule names
them, ``hierarchical`` only where the group spans hosts with more than one rank on some host
(priced where every host has the same number of ranks).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from .. import config
from ..algorithms.registry import Call, records
from ..errors import CommConfigError
from .calibration import entry_key, link_from_json, link_to_json, load, table_for
from .model import DEFAULT_LINKS, Curve, LinkCost, Prediction, Table, gpu_table, predict
from .probe import RUNS, describe_net

__all__ = ["GroupModel", "local_model", "model_to_bytes", "model_from_bytes", "eligible",
           "predictions", "Explanation", "explain_group", "remember_net", "shared_link"]

log = logging.getLogger("commlib")


@dataclass
class GroupModel:
    """What selection knows about a group's costs: its agreed table for CPU tensors (None where
    the engine moves no CPU memory), where it came from, and the table for CUDA tensors (None
    where the engine moves no CUDA memory)."""

    table: Table | None
    source: str
    gpu: Table | None = None
    #: Seconds the group may spend timing its own all-reduce at creation (in-job calibration,
    #: :mod:`commlib.tuning.probe`): rank 0's ``COMMLIB_AUTOTUNE`` where the tuning file has no
    #: entry for this group's shape on one host, else 0 (nothing to probe).
    probe: float = 0.0
    #: The tuning file's entry key for this group's shape (``mpi/4``): where a probe is saved.
    key: str = ""
    #: How many jobs' probes the table's all-reduce curves already merge (0: none; a probe
    #: merges its own into them, :func:`commlib.tuning.probe.merge`).
    probed: int = 0
    #: Seconds after the probe at which the job re-times part of it (rank 0's
    #: ``COMMLIB_AUTOTUNE_RECHECK``; :func:`commlib.tuning.probe.stale`); empty where nothing is
    #: probed.
    recheck: tuple[float, ...] = ()
    #: Whether the group times the link between its hosts at creation (rank 0's decision: a
    #: group of one rank on each of several hosts whose tuning file entry has no measured
    #: ``net`` link, and ``COMMLIB_AUTOTUNE`` not 0; :func:`commlib.tuning.probe.net_link`):
    #: else the link is priced as a 100 Gb/s NIC's (``DEFAULT_LINKS["net"]``).
    probe_net: bool = False

    def table_for(self, device: str) -> Table | None:
        return self.gpu if device == "cuda" else self.table


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
            "shm": link(table.shm), "cuda_ipc": link(table.cuda_ipc), "local": table.local,
            "base": table.base,
            "curves": {c: {a: cv.to_json() for a, cv in algos.items()} for c, algos in table.curves.items()}}


def _table_from_json(doc: dict) -> Table:
    def link(d):
        return None if d is None else link_from_json(d)

    curves = {c: {a: Curve.from_json(pts) for a, pts in algos.items()} for c, algos in doc["curves"].items()}
    return Table(link(doc["link"]), curves, doc["local"], link(doc["inter"]), doc["base"],
                 link(doc["shard_inter"]), link(doc["shm"]), link(doc.get("cuda_ipc")))


def _default_table() -> Table:
    """Uncalibrated CPU defaults, with this host's copy and reduce bandwidth from the probe."""
    probe = _probe()
    step, sync = DEFAULT_LINKS["shm"], DEFAULT_LINKS["shm_sync"]
    table = Table(LinkCost(step.alpha, 3 * probe["beta"], probe["gamma"]))
    table.shm = LinkCost(sync.alpha, probe["beta"], probe["gamma"])
    return table


def _local_table(backend: str, size: int, layout) -> tuple[Table, str, int, bool]:
    """Rank 0's view: the tuning file's entry for this group's shape (size, hosts), else
    defaults with the probe; what the file had for it: -1 nothing, 0 a calibration, k the
    probes of k jobs (:data:`commlib.tuning.probe.RUNS` make it final); and whether the link
    between hosts is worth timing in the job (:func:`local_model`: one rank per host, and
    neither the file nor an earlier group of the job measured it).
    Across hosts: intra-host links from the host's own entry if the group's has none, and
    ``net`` defaults where the file has no measured ``net`` link."""
    hosts = layout.host_count
    try:
        doc = load()
    except CommConfigError as exc:  # a broken file must not stop the job: say so, use defaults
        log.warning("%s Using the defaults.", exc)
        doc, why = None, f"defaults and probe (tuning file unusable: {exc})"
    else:
        why = "defaults and probe (no calibration: run bench/calibrate.py)"
    key = entry_key(backend, size, hosts)
    table = table_for(doc, backend, size, hosts)
    links = {}
    known = -1
    if table is not None:
        entry = doc["groups"].get(key)
        if entry is not None:
            source, links, known = f"tuning file, entry {key}", entry["links"], 0
            if "probe" in entry:
                source += f", {entry['probe'].get('how', 'probed in a job')}"
                known = int(entry["probe"].get("runs", 1))
        else:  # the nearest size's link costs (table_for), no curves
            source = f"tuning file, nearest entry to {key} (link costs only)"
    else:
        table, source = _default_table(), why
    unmeasured_net = False
    if hosts > 1 and layout.uniform:
        per_host = layout.ranks_per_host
        table.local = per_host
        if "shm" not in links and per_host > 1:
            intra = table_for(doc, backend, per_host)
            if intra is not None:
                table.link = intra.link
                source += f"; intra-host link from entry {entry_key(backend, per_host)}"
        if "net" in links:
            table.inter = link_from_json(links["net"])
        elif per_host == 1 and backend in _NET_PROBED:  # an earlier group of the job measured it
            net = _NET_PROBED[backend]
            table.inter = replace(net, gamma=table.link.gamma)
            source += f"; {describe_net(net)} for an earlier group"
        else:  # the NIC's defaults; the ranks still reduce on this host's cores (its γ)
            unmeasured_net = per_host == 1
            net = DEFAULT_LINKS["net"]
            table.inter = LinkCost(net.alpha, net.beta, table.link.gamma)
        if "net_rails" in links:
            table.shard_inter = link_from_json(links["net_rails"])
        else:  # every local rank's shard crosses at once: they share the hosts' links
            table.shard_inter = shared_link(table.inter, per_host)
    return table, source, known, unmeasured_net


# The link between hosts as the job's in-job probe measured it, by engine (remember_net).
_NET_PROBED: dict[str, LinkCost] = {}


def remember_net(backend: str, link: LinkCost) -> None:
    """Keep the link between hosts that a group of engine ``backend`` measured
    (:func:`commlib.api.autotune._probe_net`): the job's later groups across hosts on it are
    priced from it instead of probing again (rank 0 of each decides, so they all agree)."""
    _NET_PROBED[backend] = link


def shared_link(inter: LinkCost, per_host: int) -> LinkCost:
    """The hosts' link as ``per_host`` ranks crossing it at once each see it (``shard_inter``,
    where no calibration measured ``net_rails``): ``per_host`` times its β."""
    return LinkCost(inter.alpha, inter.beta * per_host, inter.gamma)


def local_model(engine, layout) -> GroupModel:
    """Rank 0's model for a group on ``engine`` (its name, size and devices) with host layout
    ``layout``: what :func:`model_to_bytes` sends to the other ranks. Never raises: a failure
    gives the defaults, saying why."""
    table, source, known, unmeasured_net = None, "the engine moves no CPU memory", 0, False
    key = entry_key(engine.name, engine.size, layout.host_count)
    if "cpu" in engine.devices:
        try:
            table, source, known, unmeasured_net = _local_table(engine.name, engine.size, layout)
        except Exception as exc:  # noqa: BLE001 - rank 0 must still send a model, or the others wait
            log.warning("commlib: building the cost model failed (%s: %s); using the defaults",
                        type(exc).__name__, exc)
            table, source = _default_table(), f"defaults and probe (model failed: {exc})"
    # In-job calibration (commlib.tuning.probe) for a group of one host that nothing measured,
    # or fewer jobs than RUNS probed.
    unsure = known == -1 or 0 < known < RUNS
    budget = config.get("autotune") if unsure and engine.size > 1 and layout.host_count == 1 else 0.0
    # ... and the link between hosts, for a group of one rank per host that nothing measured
    # (commlib.tuning.probe.net_link). With several ranks per host the measured link alone made
    # the model worse: it prices every step of a flat algorithm on that link and the
    # hierarchical one's stages inside a host from the one-host defaults, and at 2 hosts x 2
    # ranks chose the hierarchical all-reduce from 16 KiB on, 1.2-7.5x slower than MPI's up to
    # 256 KiB (docs/tuning.md); a calibration measures both.
    probe_net = unmeasured_net and config.get("autotune") > 0
    return GroupModel(table, source, gpu_table() if "cuda" in engine.devices else None,
                      budget or 0.0, key, max(known, 0) if budget else 0,
                      config.get("autotune_recheck") if budget else (), probe_net)


def model_to_bytes(model: GroupModel) -> bytes:
    table = None if model.table is None else _table_json(model.table)
    return json.dumps({"table": table, "source": model.source, "probe": model.probe,
                       "key": model.key, "probed": model.probed,
                       "recheck": list(model.recheck), "probe_net": model.probe_net}).encode()


def model_from_bytes(payload: bytes, devices) -> GroupModel:
    doc = json.loads(payload.decode())
    table = None if doc["table"] is None else _table_from_json(doc["table"])
    return GroupModel(table, doc["source"], gpu_table() if "cuda" in devices else None,
                      doc["probe"], doc["key"], doc["probed"], tuple(doc["recheck"]),
                      doc["probe_net"])


def eligible(res, call: Call) -> list[str]:
    """The algorithms of ``call.collective`` that can run ``call`` on a group with resources
    ``res``."""
    return [r.name for r in records(call.collective) if r.why_not(res, call) is None]


def ineligible(res, call: Call) -> dict[str, str]:
    """Why each other algorithm of ``call.collective`` for this device cannot run ``call`` here."""
    out = {}
    for r in records(call.collective):
        if call.device not in r.devices:
            continue  # not for this kind of tensor at all: not worth a line
        why = r.why_not(res, call)
        if why is not None:
            out[r.name] = why
    return out


def predictions(call: Call, size: int, res, model: GroupModel, widen: int = 1) -> list[Prediction]:
    """Every eligible algorithm's predicted time, cheapest first (one rank: native, free).

    ``widen`` > 1: the reduction's dtype is one the engine cannot accumulate (float16/bfloat16 on
    MPI or gloo), so every algorithm but the shared-memory ones (which reduce every dtype
    themselves) runs on a copy ``widen`` times larger (float32) and pays the casts to it and
    back: two copies of ``widen * nbytes``, priced at the table's per-byte copy cost."""
    if size == 1:
        return [Prediction("native", 0.0, "formula")]
    table = model.table_for(call.device)
    if table is None:
        return []
    collective, nbytes = call.collective, call.nbytes
    names = eligible(res, call)
    if widen == 1:
        return predict(collective, nbytes, size, table, names)
    own = [r.name for r in records(collective) if r.name in names and r.reduces_natively is not None]
    rest = [n for n in names if n not in own]
    upcast = []
    if rest:
        # two passes over the wide copy at the copy cost; where the fit found none (β clamped to
        # 0 on noisy small sizes), at the reduce pass's cost, which reads and writes as a cast does
        link = table.shm or table.link
        cast = 2 * widen * nbytes * (link.beta or link.gamma)
        upcast = [Prediction(x.algorithm, x.seconds + cast, x.how + f" (x{widen} upcast)")
                  for x in predict(collective, widen * nbytes, size, table, rest)]
    return predict(collective, nbytes, size, table, own, extra=upcast)


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
    #: the algorithms that cannot run this call here, and why (``shm_twoshot``: no shm transport...)
    excluded: dict[str, str] = field(default_factory=dict)

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
        for name, why in self.excluded.items():
            lines.append(f"  not eligible: {name}: {why}")
        return "\n".join(lines)


def explain_group(call: Call, group, model: GroupModel, chosen: str, why: str,
                  widen: int = 1) -> Explanation:
    return Explanation(call.collective, call.nbytes, group.name, group.size, model.source,
                       predictions(call, group.size, group.resources, model, widen), chosen, why,
                       ineligible(group.resources, call))

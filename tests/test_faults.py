"""Fault injection on real processes under real launchers (issue 22): one rank of three is
SIGKILLed, SIGSTOPped, or raises, at a random point inside a collective; every surviving rank must
end with a typed commlib error within ``COMMLIB_TIMEOUT`` + 5 s, no process of the job may be left,
and nothing of commlib's may stay in /dev/shm. After a failure in raise mode every rank calls
``commlib.destroy_process_group()`` and ``commlib.init()`` again in the same process and checks
an all-reduce over the new world (a trainer restarting from its checkpoint without a new job).

The ranks run tests/faults/worker.py (what they do and report is described there), 3 ranks a
job, ``COMMLIB_TIMEOUT=3``. Backends: ``mpi`` (the MPI engine, ``COMMLIB_SHM=0``), ``shm``
(commlib's shared-memory collectives, forced with ``algorithm=``, over the launcher's engine),
``gloo`` (the torch engine, ``COMMLIB_SHM=0``). Launchers: ``mpiexec`` (MPICH's hydra),
``torchrun`` (``--standalone``), ``env`` (this test starts each rank itself with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT: no launcher at all).

The matrix: every valid (backend, launcher) pair x every fault, one job each, the collective kind
varied across the jobs so that each kind meets each fault somewhere (raise jobs run two fault
rounds, with a restart after each). ``mpi`` runs under mpiexec only: an MPI world needs the MPI
launcher's process manager (under torchrun or with plain variables each rank would be an MPI world
of its own). ``shm`` and ``gloo`` run under all three (gloo under mpiexec is the env:// rendezvous
from the launcher's rank, MASTER_ADDR/MASTER_PORT given). The shm backend has four collectives
(all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor); the engines have those and
reduce, all_to_all_single and barrier.

=======  ========  ===========================  ===========================  ================================
backend  launcher  kill (victim)                stop (victim)                raise: 2 rounds, restart after each
=======  ========  ===========================  ===========================  ================================
mpi      mpiexec   all_reduce (0)               broadcast (1)                reduce, all_gather_into_tensor (2)
shm      mpiexec   all_reduce (1)               broadcast (2)                all_gather, reduce_scatter (0)
shm      torchrun  broadcast (2)                all_gather_into_tensor (0)   reduce_scatter, all_reduce (1)
shm      env       all_gather_into_tensor (0)   reduce_scatter_tensor (1)    all_reduce, broadcast (2)
gloo     mpiexec   reduce_scatter_tensor (1)    all_to_all_single (2)        barrier, all_reduce (0)
gloo     torchrun  broadcast (2)                reduce (0)                   all_gather, reduce_scatter (1)
gloo     env       all_to_all_single (0)        barrier (1)                  all_reduce, broadcast (2)
=======  ========  ===========================  ===========================  ================================

(``CASES``, printed by ``pytest -v``, is the source of this table.) What the survivors see:
kill on shm: ``CommBackendError`` "rank V of group 'world' (pid P) exited during a
shared-memory collective", in ~0.1 s; kill on gloo: ``CommBackendError`` from gloo's "Connection
closed by peer" / "Connection reset by peer", in ~0.1 s; kill on mpi: ``CommBackendError``
"PeerDied: rank V (pid P) on this host died during the operation" once the survivor's operation
completes (commlib/engines/lifeline.py: MPI's single-copy reads of a dying rank's memory return
zeros, which without that check gave wrong sums), else ``CommTimeoutError``; stop and raise:
``CommTimeoutError`` after the 3 s timeout. mpiexec and torchrun end the job themselves when a
rank dies by a signal (hydra kills the others, even with -disable-auto-cleanup; torchrun's agent
sends them SIGTERM within 0.1 s), so under those two a killed rank's survivors either report their
error first or are ended by the launcher, which the test then checks named the dead rank.

Jobs run four at a time (they mostly wait: for a timeout, or for the torch import); the suite
takes 2-3 minutes on 2 cores (165 s with the machine shared, load average ~20).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, base_env, mpiexec_path, torchrun_env

WORKER = ROOT / "tests" / "faults" / "worker.py"
N = 3
TIMEOUT = 3  # COMMLIB_TIMEOUT of the ranks
SLACK = 5  # the bound: a survivor's error within TIMEOUT + SLACK s of the fault
HARD = 90  # a job still running after this is a hang: killed, and the case fails
TYPED = ("CommBackendError", "CommTimeoutError", "CommMismatchError", "CommStateError")


@dataclasses.dataclass(frozen=True)
class Case:
    backend: str  # mpi, shm, gloo
    launcher: str  # mpiexec, torchrun, env
    fault: str  # kill, stop, raise
    kinds: tuple[str, ...]
    victim: int
    seed: int

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.launcher}-{self.fault}-{'+'.join(self.kinds)}"


def _cases() -> list[Case]:
    """Every valid (backend, launcher) x fault. The collective kinds go round-robin through the
    jobs (the engines' seven kinds over the mpi and gloo jobs together; the shm kinds restarted
    one further along for each launcher), so that kill, stop and raise each meet most kinds."""
    engine_kinds = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                    "reduce_scatter_tensor", "all_to_all_single", "barrier"]
    shm_kinds = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"]
    pairs = [("mpi", "mpiexec"), ("shm", "mpiexec"), ("shm", "torchrun"), ("shm", "env"),
             ("gloo", "mpiexec"), ("gloo", "torchrun"), ("gloo", "env")]
    cases, engine_turn, shm_pairs = [], 0, 0
    for k, (backend, launcher) in enumerate(pairs):
        if backend == "shm":
            shm_pairs += 1
            turn = shm_pairs - 1
        for fault in ("kill", "stop", "raise"):
            chosen = []
            for _ in range(2 if fault == "raise" else 1):
                if backend == "shm":
                    chosen.append(shm_kinds[turn % len(shm_kinds)])
                    turn += 1
                else:
                    chosen.append(engine_kinds[engine_turn % len(engine_kinds)])
                    engine_turn += 1
            cases.append(Case(backend, launcher, fault, tuple(chosen), victim=(len(cases) + k) % N,
                              seed=1000 + len(cases)))
    return cases


CASES = _cases()


# ----- running one job ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(case: Case) -> dict:
    return dict(COMMLIB_TIMEOUT=str(TIMEOUT), COMMLIB_TIMEOUT_MODE="raise",
                COMMLIB_SHM="1" if case.backend == "shm" else "0",
                COMMLIB_SHM_SLOT_BYTES="65536",  # a 768 KiB message is 12 chunks or more
                PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo")


def _launch(case: Case, report: str) -> list[subprocess.Popen]:
    """Start the job; returns the processes this test started (each the leader of its own
    session: every process of the job is in one of those sessions)."""
    args = [str(WORKER), case.backend, case.fault, str(case.victim), ",".join(case.kinds),
            str(case.seed), report]
    popen = dict(cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)
    if case.launcher == "env":
        return [subprocess.Popen([sys.executable, *args], env=env, **popen)
                for env in torchrun_env(N, **_rank_env(case))]
    # a launcher's environment: none of another launcher's variables
    env = torchrun_env(1, **_rank_env(case))[0]
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key)
    if case.launcher == "mpiexec":
        if case.backend == "gloo":  # the env:// rendezvous, rank from the MPI launcher
            env.update(COMMLIB_BACKEND="torch", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()), WORLD_SIZE=str(N))
        cmd = [mpiexec_path(), "-n", str(N), sys.executable, *args]
    else:
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
        cmd = [torchrun, "--standalone", f"--nproc-per-node={N}", *args]
    return [subprocess.Popen(cmd, env=env, **popen)]


def _stat(pid: str):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[3])  # state, session id


def _alive_in(sessions: set[int]) -> list[int]:
    """Processes (not zombies) in any of ``sessions``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            st = _stat(pid)
            if st is not None and st[1] in sessions and st[0] not in "ZX":
                found.append(int(pid))
    return found


@dataclasses.dataclass
class Result:
    report: str
    outputs: list[str]
    codes: list[int | None]
    hung: bool
    left: list[int]  # processes of the job still alive after it ended
    shm: list[str]  # /dev/shm entries named after a rank of the job
    took: float
    ended: float  # time.time() when the last process of the job exited


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` unless it is already gone (it may exit between our look and the kill)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_case(case: Case, tmp: str) -> Result:
    report = os.path.join(tmp, f"{case.id}.report")
    open(report, "w").close()
    start = time.monotonic()
    procs = _launch(case, report)
    sessions = {p.pid for p in procs}
    survivors = N - 1
    hung, killed_victim = False, False
    outputs = ["" for _ in procs]
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() - start > HARD:
                hung = True
                break
            text = open(report).read()
            if case.fault == "stop" and not killed_victim and text.count(" done\n") >= survivors:
                # every survivor reported: the stopped victim is the test's to end
                pid = re.search(rf"^rank {case.victim} pid (\d+) start$", text, re.M)
                if pid:  # the launcher may have ended it already, when the survivors left
                    _kill(int(pid.group(1)))
                killed_victim = True
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        if hung:  # torchrun starts each rank in a session of its own: end the ranks too, or their
            # open stdout keeps communicate() below waiting for ever (seen in CI)
            for pid in re.findall(r"^rank \d+ pid (\d+) start$", open(report).read(), re.M):
                _kill(int(pid))
        outputs = [p.communicate()[0] for p in procs]
    ended = time.time()
    # the launchers have exited: their processes must be gone (a moment for the kernel)
    deadline = time.monotonic() + 5
    while (left := _alive_in(sessions)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        _kill(pid)
    text = open(report).read()
    pids = set(re.findall(r"^rank \d+ pid (\d+) start$", text, re.M))
    shm = [f for f in os.listdir("/dev/shm")
           if f.startswith("commlib-") and f.split("-")[1] in pids]
    return Result(text, outputs, [p.returncode for p in procs], hung, left, shm,
                  time.monotonic() - start, ended)


def _launcher_available(case: Case) -> str | None:
    if case.launcher == "mpiexec" and mpiexec_path() is None:
        return "mpiexec not found: install the 'mpich' extra (pip install mpich)"
    if case.backend == "shm":
        try:
            import commlib.transports._shm  # noqa: F401
        except ImportError:
            return "the shared-memory extension is not built (pip install -e .)"
    return None


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """Run the selected cases, four jobs at a time; case -> Result."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "case" in item.callspec.params]
    runnable = [c for c in selected if _launcher_available(c) is None]
    tmp = str(tmp_path_factory.mktemp("faults"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c: pool.submit(run_case, c, tmp) for c in runnable}
        return {c: f.result() for c, f in futures.items()}


def _context(result: Result) -> str:
    outs = "".join(f"\n--- process {k} (exit {code})\n{out[-4000:]}"
                   for k, (out, code) in enumerate(zip(result.outputs, result.codes)))
    return f"\n--- report\n{result.report}{outs}"


def _launcher_ends_job(case: Case) -> bool:
    """mpiexec (hydra, even with -disable-auto-cleanup) and torchrun (its agent, every 0.1 s)
    end the job when a rank dies by a signal: the survivors are killed or sent SIGTERM, often
    before they find the failure themselves."""
    return case.fault == "kill" and case.launcher in ("mpiexec", "torchrun")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fault(results, case):
    why = _launcher_available(case)
    if why:
        pytest.skip(why)
    res = results[case]
    ctx = _context(res)
    print(f"{case.id}: {res.took:.1f} s\n{res.report}")
    assert not res.hung, f"the job still ran after {HARD} s" + ctx
    assert not res.left, f"processes of the job left running: {res.left}" + ctx
    assert not res.shm, f"left in /dev/shm: {res.shm}" + ctx
    assert "completed kind" not in res.report, ctx
    faults = re.findall(rf"^rank {case.victim} fault {case.fault} kind (\w+) op \d+ at ([\d.]+)$",
                        res.report, re.M)
    assert [k for k, _ in faults] == list(case.kinds), ctx
    caught = re.findall(r"^rank (\d+) caught (\w+) kind (\w+) op \d+ at ([\d.]+) \(entered [\d.]+\)"
                        r": (.*)$", res.report, re.M)
    survivors = sorted(str(r) for r in range(N) if r != case.victim)
    for round_no, (kind, at) in enumerate(faults):
        got = [(r, err, float(t)) for r, err, k, t, _ in caught if k == kind]
        if _launcher_ends_job(case):
            # the launcher ends the job when a rank dies by a signal: a survivor reports its
            # error if it finds the failure first, else the launcher ends it
            assert {r for r, _, _ in got} <= set(survivors), ctx
            if case.launcher == "mpiexec":  # hydra kills the rest at once
                # Hydra's proxy, on the first rank it sees gone without MPI_Finalize, sets the
                # exit status of every other rank not yet reaped to 0 and SIGKILLs them
                # (pmip_cb.c, pmi_cb: "preset all exit_status except for the closed pid"). When
                # a survivor reported and left (os._exit(0)) before the proxy handled the
                # victim's death, the victim's signal is hidden: mpiexec exits 0, silent.
                if res.codes[0] == 0:
                    assert got, "mpiexec exited 0 with no survivor's report" + ctx
                else:
                    assert "Killed (signal 9)" in res.outputs[0], ctx
                assert res.ended - float(at) <= TIMEOUT + SLACK, \
                    f"the job ended {res.ended - float(at):.1f} s after the fault" + ctx
            else:  # torchrun's agent names the dead rank and sends the others SIGTERM
                assert res.codes[0] != 0, ctx
                assert f"failed (exitcode: -9) local_rank: {case.victim}" in res.outputs[0], ctx
                pids = dict(re.findall(r"^rank (\d+) pid (\d+) start$", res.report, re.M))
                for r in set(survivors) - {r for r, _, _ in got}:
                    assert f"Sending process {pids[r]} closing signal SIGTERM" in res.outputs[0], ctx
        else:
            assert sorted(r for r, _, _ in got) == survivors, f"round {round_no} ({kind})" + ctx
        for r, err, t in got:
            assert err in TYPED, f"rank {r}: untyped {err}" + ctx
            assert t - float(at) <= TIMEOUT + SLACK, f"rank {r}: {err} {t - float(at):.1f} s " \
                                                     f"after the fault" + ctx
    if case.fault == "raise":  # every rank restarted after every round, in the same process
        for round_no in range(len(case.kinds)):
            restarted = re.findall(rf"^rank (\d+) restarted round {round_no} sum 6 at", res.report,
                                   re.M)
            assert sorted(restarted) == [str(r) for r in range(N)], f"round {round_no}" + ctx
        assert res.report.count(" done\n") == N, ctx
    elif not _launcher_ends_job(case):
        assert sorted(re.findall(r"^rank (\d+) done$", res.report, re.M)) == survivors, ctx

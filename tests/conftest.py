"""Shared test helpers: run a script under ``mpiexec -n N`` with a hard timeout.

Multi-rank tests are written once as case functions in ``tests/mpi/*.py`` and run at several world
sizes by ``run_mpi``. A deadlock becomes a test failure (the whole process group is killed after
``timeout`` seconds), and ranks get ``COMMLIB_TIMEOUT`` shorter than that, so a stuck collective
raises inside the job first.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MPI_DIR = ROOT / "tests" / "mpi"


def mpiexec_path() -> str | None:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("mpiexec", path=path)


def base_env(**extra) -> dict:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("COMMLIB_")]:
        del env[key]
    # No calibration from this machine's cache (~/.cache/commlib): every run, here or on a fresh
    # CI machine, selects from the same uncalibrated model.
    # Nor a probe of its own (COMMLIB_AUTOTUNE): tests/test_autotune.py runs it, on a cache of its own.
    env.update(OMP_NUM_THREADS="1", COMMLIB_TIMEOUT="60", PYTHONPATH=str(ROOT),
               XDG_CACHE_HOME=os.path.join(tempfile.gettempdir(), "commlib-tests-cache"),
               COMMLIB_AUTOTUNE="0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


# Variables of launchers that would make commlib.init() pick another backend than torchrun's.
_LAUNCHER_VARS = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCALRANKID", "MV2_", "HYDRA_",
                  "TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")


def torchrun_env(n: int, **extra) -> list[dict]:
    """The environment of each of ``n`` ranks started the way torchrun starts them (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT on 127.0.0.1), in rank order."""
    env = base_env(**extra)
    for key in [k for k in env if k.startswith(_LAUNCHER_VARS)]:
        del env[key]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
               GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    return [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(n)]


def run_cmd(cmd, timeout: float = 180, env: dict | None = None, check: bool = True):
    """Run ``cmd`` in its own process group; kill the group and fail on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or base_env(), start_new_session=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s (deadlock?): {' '.join(map(str, cmd))}\n"
                    f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(map(str, cmd))}\n"
                    f"--- stdout\n{out[-6000:]}\n--- stderr\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_mpi(n: int, script: str, *args: str, timeout: float = 180, check: bool = True, **env):
    """``mpiexec -n n python tests/mpi/<script> args...``; returns the CompletedProcess."""
    exe = mpiexec_path()
    if exe is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra (pip install mpich)")
    cmd = [exe, "-n", str(n), sys.executable, str(MPI_DIR / script), *args]
    return run_cmd(cmd, timeout=timeout, env=base_env(**env), check=check)


def run_mpi_hosts(hosts: list[str], script: str, *args: str, timeout: float = 240,
                  check: bool = True, **env):
    """One rank per entry of ``hosts``, rank k on virtual host ``hosts[k]`` (``COMMLIB_TEST_HOST``,
    given per rank with mpiexec's MPMD syntax), running ``tests/mpi/<script> args...`` (or
    ``script`` itself when it is an absolute path)."""
    exe = mpiexec_path()
    if exe is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra (pip install mpich)")
    cmd = [exe]
    for k, host in enumerate(hosts):
        cmd += ([":"] if k else []) + ["-n", "1", "-env", "COMMLIB_TEST_HOST", host, sys.executable,
                                       str(MPI_DIR / script), *args]
    return run_cmd(cmd, timeout=timeout, env=base_env(**env), check=check)


# torch.distributed's rendezvous variables: a test that leaves one set in this process hands it to
# every later launch (run_mpi copies the environment), whose ranks then rendezvous at the wrong
# address or with the wrong world.
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _rendezvous_untouched():
    """Fail the test that changed a rendezvous variable of this process (restoring it), instead
    of a later launch that inherits it."""
    before = {k: os.environ.get(k) for k in _RENDEZVOUS}
    yield
    changed = {k: os.environ.get(k) for k in _RENDEZVOUS if os.environ.get(k) != before[k]}
    for k in changed:
        if before[k] is None:
            del os.environ[k]
        else:
            os.environ[k] = before[k]
    if changed:
        pytest.fail(f"the test left torch's rendezvous variables changed in the test process: "
                    f"{changed} (restored now); later launches would inherit them. Fix: use "
                    f"monkeypatch.setenv before changing them, so that they are restored")


@pytest.fixture
def mpirun():
    return run_mpi


@pytest.fixture
def self_world(monkeypatch):
    """commlib in this process, a world of one on the ``self`` backend, with no COMMLIB_
    variable of the caller's environment; finalized afterwards."""
    import commlib
    from commlib.runtime.progress import set_progress

    for key in [k for k in os.environ if k.startswith("COMMLIB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EXPECT_BACKEND", "self")
    commlib.finalize()
    commlib.init(backend="self")
    previous = set_progress("auto")  # a test may switch it; the next one starts from the default
    yield
    commlib.finalize()
    set_progress(previous)

"""One config surface: keyword argument > ``COMMLIB_*`` environment variable > default.

Every option lives in :data:`OPTIONS`; ``docs/configuration.md`` is generated from the same table
(``python -m commlib.config``). An unknown ``COMMLIB_*`` variable raises at :func:`commlib.init`, so
that a typo is an error and not a silently ignored setting.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CommConfigError

__all__ = ["Option", "OPTIONS", "get", "check_environment", "markdown_table"]


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _parse_timeout(text: str) -> float | None:
    value = float(text)
    if value < 0:
        raise ValueError("must be >= 0 seconds (0 disables the timeout)")
    return None if value == 0 else value


def _parse_timeout_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode not in ("abort", "raise"):
        raise ValueError("expected 'abort' or 'raise'")
    return mode


def _parse_progress(text: str) -> str:
    mode = text.strip().lower()
    if mode not in ("auto", "thread", "wait"):
        raise ValueError("expected 'auto', 'thread' or 'wait'")
    return mode


def _parse_auto_off(text: str) -> str:
    mode = text.strip().lower()
    if mode not in ("auto", "off"):
        raise ValueError("expected 'auto' or 'off'")
    return mode


def _parse_autotune(text: str) -> float:
    word = text.strip().lower()
    if word in ("off", "no", "false"):
        return 0.0
    seconds = float(word)
    if not seconds >= 0:
        raise ValueError("expected seconds >= 0 or 'off'")
    return seconds


def _parse_recheck(text: str) -> tuple[float, ...]:
    word = text.strip().lower()
    if word in ("", "off", "no", "false", "0"):
        return ()
    times = tuple(float(x) for x in word.split(","))
    if any(not t >= 0 for t in times) or list(times) != sorted(times):
        raise ValueError("expected increasing seconds >= 0, comma-separated, or 'off'")
    return times


def _parse_compress_impl(text: str) -> str:
    impl = text.strip().lower()
    if impl not in ("auto", "torch", "c"):
        raise ValueError("expected 'auto', 'torch' or 'c'")
    return impl


def _parse_nice(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 19:
        raise ValueError("must be a niceness from 0 to 19")
    return value


def _parse_positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a whole number > 0")
    return value


def _parse_level(text: str) -> str:
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("expected DEBUG, INFO, WARNING or ERROR")
    return level


def _parse_optional_str(text: str) -> str | None:
    text = text.strip()
    return text or None


# Options whose values name something registered above this module (COMMLIB_ALGO: an algorithm):
# option name -> a function listing the known names, registered by that layer.
_CHOICES: dict[str, Callable[[], list[str]]] = {}


def register_choices(option: str, names: Callable[[], list[str]]) -> None:
    """Make option ``option`` accept only the names ``names()`` lists (a typo must not silently
    fall back to the default). The algorithm registry registers ``algo``."""
    _CHOICES[option] = names


def _parse_algo(text: str) -> str | None:
    name = _parse_optional_str(text)
    if name is None or "algo" not in _CHOICES:
        return name
    known = sorted(_CHOICES["algo"]())
    if name not in known:  # a typo must not silently fall back to the automatic choice
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"no algorithm is named {name!r}{hint}; known: {known}")
    return name


def _parse_tristate(text: str) -> bool | None:
    low = text.strip().lower()
    return None if low in ("", "auto") else _parse_bool(low)


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """A size in bytes: ``4096``, ``64K``, ``16M``, ``1G`` (binary units; ``KiB``, ``MB`` and
    lower case also read). Raises ValueError naming the text otherwise."""
    t = text.strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix):
            t = t[:-len(suffix)]
            break
    mult = _UNITS.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 4096, 64K, 16M, 1G)") from None
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _parse_slot(text: str) -> int:
    value = parse_bytes(text)
    if value < 4096 or value % 4096:
        raise ValueError("must be a positive multiple of 4096 bytes")
    return value


def _parse_optional_int(text: str, parse: Callable[[str], int] = int) -> int | None:
    text = text.strip().lower()
    if text in ("", "auto"):
        return None
    value = parse(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


@dataclass(frozen=True)
class Option:
    name: str  # keyword name
    default: Any
    parse: Callable[[str], Any]
    doc: str

    @property
    def env(self) -> str:
        return "COMMLIB_" + self.name.upper()


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        Option("backend", None, _parse_optional_str,
               "Backend of the world group: `mpi`, `torch`, `nccl` or `self`. Default: detected "
               "(torch.distributed already initialized -> `torch`; launched by mpirun/mpiexec -> "
               "`mpi`; launched by torchrun -> `torch`; otherwise one process, `self`)."),
        Option("algo", None, _parse_algo,
               "Force one algorithm for every collective that has it (`native`, `ring`, "
               "`recursive_doubling`, `pipelined_doubling`, `rabenseifner`, `binomial`, `hierarchical`, "
               "`shm_oneshot`, "
               "`shm_twoshot`, `shm`, `cuda_ipc_oneshot`, `cuda_ipc_twoshot`); collectives "
               "without it keep the automatic choice (the cost "
               "model). The `algorithm=` keyword of a call wins over it."),
        Option("timeout", 600.0, _parse_timeout,
               "Seconds before a stuck operation raises `CommTimeoutError` naming the op, group "
               "and sequence number. `0` disables the timeout (blocking engine calls)."),
        Option("timeout_mode", "abort", _parse_timeout_mode,
               "What a timeout does to a blocking collective. `abort` (default, like NCCL's "
               "watchdog in PyTorch): blocking collectives run as the engine's own blocking call, "
               "and a watchdog thread ends the whole job with `CommTimeoutError` (op, group, "
               "sequence number) on stderr. `raise`: every operation is polled and raises "
               "`CommTimeoutError` in the caller (catchable; costs about 1 µs a call, more when "
               "ranks outnumber cores). Asynchronous operations (`Work.wait`) and multi-step "
               "algorithms always raise."),
        Option("debug", False, _parse_bool,
               "Exchange a fingerprint (collective, shape, dtype, op, root) before every "
               "collective; ranks that disagree raise `CommMismatchError` on every rank."),
        Option("log", "WARNING", _parse_level,
               "Log level of the `commlib` logger. `INFO` logs each choice (backend, algorithm, "
               "topology source), like `NCCL_DEBUG=INFO`."),
        Option("tuning_file", None, _parse_optional_str,
               "The tuning file the cost model reads (written by `mpirun -n N python "
               "bench/calibrate.py`). Default: the per-host cache "
               "`$XDG_CACHE_HOME/commlib/tuning-<host hash>.json`; without a file, defaults and a "
               "built-in probe. A file named here that does not exist or parse is reported at group "
               "creation (`COMMLIB_LOG=INFO`) and the defaults are used."),
        Option("autotune", 1.0, _parse_autotune,
               "Seconds a new group on one host may spend timing its own all-reduce algorithms "
               "when the tuning file has no entry for its engine and size (in-job calibration: "
               "at `commlib.init` or group creation; the result is saved in the tuning file, and "
               "the next jobs of that shape probe again until three probes are merged, each point "
               "the minimum, after which jobs read it without probing). It also measures one "
               "point-to-point step as the ranks see it when they outnumber the cores. `0` or "
               "`off`: never; the nearest calibrated size's link costs are used, as `explain` "
               "says. A group of one rank per host whose tuning file entry has no measured link "
               "between hosts times that link instead (a ping-pong of 4 KiB and 1 MiB between two hosts, "
               "about 70 ms at 1 Gb/s; not saved), unless this is `0`. Described in "
               "docs/tuning.md, \"In-job calibration\"."),
        Option("autotune_recheck", (5.0, 60.0, 240.0), _parse_recheck,
               "Seconds after an in-job probe (`COMMLIB_AUTOTUNE`) at which the job times its "
               "all-reduce algorithms again, size by size (comma-separated, increasing); where "
               "one runs 1.35x faster than the probes measured, a probe fell in a slow phase of "
               "the host and the job probes again and merges. `off`: never. Described in docs/tuning.md, "
               "\"In-job calibration\"."),
        Option("cuda_aware_mpi", None, _parse_tristate,
               "Whether MPI may be given CUDA buffers: `1`, `0` or `auto` (default, asks "
               "`MPIX_Query_cuda_support` where the MPI library has it)."),
        Option("ucx_tcp", "auto", _parse_auto_off,
               "UCX's TCP transport settings (MPI over Ethernet between hosts). `auto` (default): "
               "`import commlib`, when MPI is not initialized yet, sets those of "
               "`UCX_TCP_SNDBUF=256k` and `UCX_TCP_RX_SEG_SIZE=512k` that the environment leaves "
               "unset: with the kernel's megabytes of send buffer, a rank's eager sends complete "
               "before their bytes leave, and under DDP's skew the other rank then waited 9-18 ms "
               "longer for its last bucket than on gloo; UCX reads one receive segment per "
               "progress call (docs/torch-backend-bench.md). InfiniBand and shared memory never "
               "read them. `off`: UCX's own defaults. A program that imports `mpi4py.MPI` "
               "before commlib has initialized MPI already: import commlib first, or set them in "
               "the launcher's environment (`mpiexec -genv`)."),
        Option("abort_on_exception", True, _parse_bool,
               "An uncaught exception on one rank ends the whole job (`MPI_Abort` under "
               "mpirun; exit code 1 under torchrun, whose agent then stops the other workers) "
               "instead of leaving the other ranks waiting."),
        Option("shm", True, _parse_bool,
               "Give every group whose ranks share a host a shared-memory segment, used for "
               "CPU `all_reduce`, `reduce_scatter_tensor`, `all_gather_into_tensor` and "
               "`broadcast` in the size ranges where it wins (docs/shm.md). `0`: engine only."),
        Option("cuda_ipc", True, _parse_bool,
               "Attach CUDA IPC buffers to every group of GPU ranks on one host (2, 4, 6 or 8 "
               "GPUs, each rank its own), so that `all_reduce` of CUDA tensors may run "
               "commlib's one-shot and two-shot kernels where the cost model prefers them to "
               "NCCL (docs/shm.md). `0`: NCCL only."),
        Option("shm_slot_bytes", 1 << 20, _parse_slot,
               "Bytes of one shared-memory region (each rank has two per group); larger "
               "messages are pipelined through it in chunks. A multiple of 4096 (`1M`, `256K` "
               "and plain bytes read)."),
        Option("shm_stream_bytes", None, lambda text: _parse_optional_int(text, parse_bytes),
               "A shared-memory all-gather whose output has at least this many bytes copies "
               "into it with streaming (non-temporal) stores, which skip reading the "
               "destination first: faster once the output is too large for the caches, slower "
               "below. Default: 16 MiB (docs/shm.md); a huge value (`1G`) turns them off."),
        Option("progress", "auto", _parse_progress,
               "How asynchronous operations (`async_op=True`) advance while the caller computes. "
               "`auto` (default): a progress thread advances those of groups across hosts, and "
               "of groups on one host only when the host has more cores than ranks (there the "
               "progress is copying by the cores, which a thread can only take from the "
               "compute). `thread`: a progress thread for every group. The threads sleep in the "
               "engine or between passes, never spinning (docs/overlap.md). `wait`: only inside "
               "`Work.wait()`, `Work.is_completed()` and other commlib calls."),
        Option("affinity", "auto", _parse_auto_off,
               "CPU binding of the ranks. `auto` (default): at `commlib.init`, the ranks of a "
               "host that nobody bound (every one of them on the same mask of several CPUs: no "
               "`mpiexec -bind-to`, no `taskset`) are bound, rank k of n to its own "
               "contiguous share of the host's cores, or to core k mod cores when ranks "
               "outnumber cores, and torch's intra-op threads are limited to the share unless "
               "`OMP_NUM_THREADS` is set; `commlib.finalize` undoes it. Ranks a launcher bound, "
               "and a host's only rank, are left alone. `off`: never bind (e.g. several jobs "
               "sharing a host). Measured in docs/shm.md, \"Binding\"."),
        Option("progress_nice", 19, _parse_nice,
               "Niceness of the progress thread serving groups on one host (Linux). Their "
               "progress is copying on the cores the compute uses: at 19 it takes the room the "
               "compute leaves instead of a core (measured in docs/overlap.md). Groups across "
               "hosts are served by a thread at normal priority "
               "(`COMMLIB_PROGRESS_REMOTE_BATCH`)."),
        Option("progress_remote_batch", True, _parse_bool,
               "Run the progress thread serving groups across hosts as a batch task (Linux "
               "`SCHED_BATCH`, same priority): its wake-ups then wait for the compute thread's "
               "next switch instead of preempting it. At its fast pace it wakes hundreds of times "
               "a DDP step: at 2 hosts x 1 rank on 2 cores the caller's thread was preempted "
               "393-617 times a step as a normal task, 38-48 as a batch one (on gloo: 89-153), "
               "and commlib's backward went from 19-31 ms longer than gloo's to within -6..+9 "
               "ms (docs/torch-backend-bench.md). Off: a normal task."),
        Option("progress_min_us", 50, _parse_positive_int,
               "The progress thread's first pause, in microseconds, after a pass that completed "
               "nothing; it doubles up to `COMMLIB_PROGRESS_MAX_US` while nothing completes."),
        Option("progress_max_us", 1000, _parse_positive_int,
               "The progress thread's longest pause between passes, in microseconds: how long "
               "MPI may go without a progress call while the caller computes. Shorter pauses "
               "serve MPICH's intra-host messages better (they move a few cells per call) and "
               "cost the compute more polling (measured both ways in docs/overlap.md)."),
        Option("progress_remote_fast_us", 100, _parse_positive_int,
               "The longest pause of the progress thread serving groups across hosts for the "
               "first 10 ms after an operation is issued or advances, and while the process's "
               "other threads use under a tenth of a core (the caller waits for the result); "
               "else `COMMLIB_PROGRESS_MAX_US`. MPI over TCP answers a message's handshake and "
               "pushes its fragments only inside progress calls: with 1 ms pauses throughout, "
               "a DDP bucket of 1.25 MiB took twice as long across 1 Gb/s links, while 100 us "
               "throughout took a tenth of the hidden share from a 16 MiB all-reduce beside "
               "compute (docs/torch-backend-bench.md). Also the pause between the polls of a "
               "caller waiting on such a group once it has waited 1 ms (`WAIT_SPIN_S`): it sleeps "
               "instead of spinning a core (docs/overlap.md)."),
        Option("shm_spin", None, _parse_optional_int,
               "Polls a rank waiting on shared memory spins before it yields its core. Default: "
               "2000 (about 50 us), or 50 when the group's ranks outnumber the cores."),
        Option("compress_impl", "auto", _parse_compress_impl,
               "Which implementation the `int8`, `int4` and `fp8` codecs of `commlib.compress` "
               "use for CPU tensors (both write the same bytes). `auto` (default): the C codecs "
               "(the extension `commlib.compress._codecs`, fused loops at a large fraction of "
               "memcpy bandwidth) where they are built, else the torch definition. `torch`: the "
               "torch definition. `c`: the C codecs; where the extension is not built, the first "
               "encode or decode raises `CommConfigError` (fix: `pip install -e .` on a machine "
               "with a C compiler). Stochastic rounding always runs in torch."),
    ]
}


def get(name: str, value: Any = None) -> Any:
    """Resolve option ``name``: ``value`` if not None, else its environment variable, else default."""
    if value is not None:
        return value
    opt = OPTIONS[name]
    text = os.environ.get(opt.env)
    if text is None:
        return opt.default
    try:
        return opt.parse(text)
    except ValueError as exc:
        raise CommConfigError(
            f"commlib: environment variable {opt.env}={text!r} is malformed: {exc}. "
            f"Fix: set it to a valid value or unset it (default {opt.default!r})."
        ) from None


def check_environment(environ=None) -> None:
    """Raise on ``COMMLIB_*`` variables that name no option (a typo) or do not parse."""
    environ = os.environ if environ is None else environ
    known = {o.env for o in OPTIONS.values()}
    # Variables read by tests or tools outside the option table.
    known |= {"COMMLIB_TEST_HOST", "COMMLIB_TOPO_FILE"}
    for key in environ:
        if key.startswith("COMMLIB_") and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else "see docs/configuration.md"
            raise CommConfigError(
                f"commlib: unknown environment variable {key}: it names no commlib option. "
                f"Fix: {hint} (or unset it)."
            )
    for opt in OPTIONS.values():
        get(opt.name)


def markdown_table() -> str:
    rows = ["| variable | keyword | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS.values():
        rows.append(f"| `{o.env}` | `{o.name}` | `{o.default!r}` | {o.doc} |")
    return "\n".join(rows)

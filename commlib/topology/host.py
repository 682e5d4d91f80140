"""Which host a process runs on: the key that tells ranks sharing memory from ranks on other hosts.

Like NCCL's host hash (hostname plus the kernel's boot id, so that two containers with the same
hostname on different machines differ), with a test-only override: ``COMMLIB_TEST_HOST=<name>``
places this process on a virtual host ``<name>``, so that one machine's ranks can be split into
several "hosts" to test hierarchical and multi-host code (ranks with different values never share a
shared-memory segment; ranks with the same value must really share the machine).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from dataclasses import dataclass
from typing import Sequence

try:  # POSIX only: interface_addresses() finds none elsewhere
    import fcntl
except ImportError:
    fcntl = None

__all__ = ["host_id", "host_hash", "HostLayout", "interface_addresses"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def host_id() -> str:
    """A string naming this host: ``<hostname>:<boot id>``, or ``test:<name>`` under
    ``COMMLIB_TEST_HOST``."""
    override = os.environ.get("COMMLIB_TEST_HOST")
    if override:
        return f"test:{override}"
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def host_hash() -> int:
    """:func:`host_id` as a non-negative 63-bit integer (cheap to all-gather)."""
    digest = hashlib.blake2b(host_id().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def interface_addresses() -> list[str]:
    """This host's IPv4 addresses, one per network interface that has one, in the interfaces'
    order, loopback last ([] where they cannot be read: not Linux)."""
    if fcntl is None or not hasattr(socket, "if_nameindex"):
        return []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    found = []
    for name in names:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            continue  # no IPv4 address on this interface
        found.append(socket.inet_ntoa(packed[20:24]))
    return sorted(found, key=lambda a: a.startswith("127."))  # stable: loopback last


@dataclass(frozen=True)
class HostLayout:
    """Which ranks of a group share a host: ``hosts[k]`` lists the ranks on host k, hosts in
    order of their lowest rank (from every rank's :func:`host_hash`, gathered when the group is
    created)."""

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_hashes(cls, hashes: Sequence[int]) -> "HostLayout":
        order: dict[int, list[int]] = {}
        for rank, h in enumerate(hashes):
            order.setdefault(h, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in order.values()))

    @property
    def uniform(self) -> bool:
        return len({len(h) for h in self.hosts}) == 1

    @property
    def spans_hosts(self) -> bool:
        """Worth a hierarchical algorithm: >= 2 hosts and more than one rank on some host."""
        return len(self.hosts) > 1 and max(len(h) for h in self.hosts) > 1

    @property
    def host_count(self) -> int:
        """How many hosts the group's ranks are on (what a tuning file entry is keyed by:
        ``mpi/2`` on one host, ``mpi/2@2`` for one rank on each of two)."""
        return len(self.hosts)

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])

"""CPU time of the gateway's processes, for CPU per request and per relayed token: the
change of utime + stime (from /proc, through psutil) over a measured window, divided by
what was served in it. Far less noisy than latency on a shared machine (NVIDIA Dynamo
measures its frontend this way).

The processes are found by the TCP ports they listen on. A gateway started with
`--workers N` is a parent with N worker children that share its socket; the system
names one holder of a shared socket, often a worker, so a multiprocessing child found
that way is replaced by its parent, and the parent's whole tree is counted."""

from __future__ import annotations

from urllib.parse import urlsplit

import psutil


def listening_pids(ports: set[int]) -> set[int]:
    found = set()
    for connection in psutil.net_connections(kind="tcp"):
        listening = connection.status == psutil.CONN_LISTEN and connection.laddr and connection.pid
        if listening and connection.laddr.port in ports:
            found.add(_tree_root(connection.pid))
    return found


def _tree_root(pid: int) -> int:
    process = psutil.Process(pid)
    while "--multiprocessing-fork" in process.cmdline() and (parent := process.parent()) is not None:
        process = parent
    return process.pid


class ProcessCpu:
    """utime + stime, in seconds, of some processes and all their children."""

    def __init__(self, pids: set[int]) -> None:
        self.roots = [psutil.Process(pid) for pid in pids]

    @classmethod
    def of_urls(cls, urls: list[str]) -> ProcessCpu:
        ports = {urlsplit(url).port or 80 for url in urls}
        pids = listening_pids(ports)
        if not pids:
            raise RuntimeError(f"no process listens on {sorted(ports)} here (is the gateway on this machine?)")
        return cls(pids)

    def _processes(self) -> list[psutil.Process]:
        found = []
        for root in self.roots:
            try:
                found.append(root)
                found.extend(root.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return found

    def seconds(self) -> float:
        total = 0.0
        for process in self._processes():
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    @property
    def count(self) -> int:
        return len(self._processes())

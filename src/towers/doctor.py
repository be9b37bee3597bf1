"""``towers doctor``: a pre-flight for multi-host jobs, run on every node (or as ``towers launch ... -m towers.doctor``).

On each node it checks what a job depends on, in the order a job meets it, and says what to fix:

1. names: this host's name and what it resolves to here (127.0.1.1 on Debian);
2. the interface every link binds (``--interface``, or the one that routes to the other hosts) and
   this host's interfaces;
3. the rendezvous: its address as this host resolves it, the port (free on node 0), reachable from
   the others; while it waits it says for whom;
4. with every node joined (a Gloo group on that interface): each node's host, interface and
   address, pairwise latency, bandwidth and clock offset, and the all-reduce bus bandwidth
   (nccl-tests' definition: bytes x 2(n-1)/n / time).

Nothing read from the network is unpickled: peers exchange JSON through the store and numbers as tensors.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from towers import network
from towers.cluster.info import ProcessInfo
from towers.errors import InvalidArgumentError

__all__ = ["DoctorSpec", "Check", "DoctorReport", "run_doctor", "format_report"]

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True, kw_only=True)
class DoctorSpec:
    """What to measure: ``size_mb`` per bandwidth and all-reduce message, ``repeats`` of each, every wait <= ``timeout_s``."""

    timeout_s: float = 60.0
    size_mb: float = 16.0
    repeats: int = 5

    def __post_init__(self) -> None:
        for name, value in (("timeout_s", self.timeout_s), ("size_mb", self.size_mb)):
            if not value > 0:
                raise InvalidArgumentError(f"{name} must be > 0. Received: {value!r}. Example: --{name.replace('_', '-')} 4.")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise InvalidArgumentError(f"repeats must be an integer >= 1. Received: {self.repeats!r}. Example: --repeats 5.")


@dataclass(frozen=True)
class Check:
    """One finding: ``status`` (ok / warn / FAIL), what was checked, what was seen, and the fix (if any)."""

    status: str
    what: str
    detail: str
    fix: str = ""


@dataclass
class DoctorReport:
    """Everything ``towers doctor`` found on this node; ``ok`` is False when any check failed."""

    info: ProcessInfo
    checks: list[Check] = field(default_factory=list)
    interfaces: list[network.Interface] = field(default_factory=list)
    peers: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    all_reduce: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return all(c.status != FAIL for c in self.checks)

    def add(self, status: str, what: str, detail: str, fix: str = "") -> bool:
        """Record a check; return True unless it failed."""
        self.checks.append(Check(status, what, detail, fix))
        return status != FAIL


def _check_names(report: DoctorReport, spans: bool, chosen: network.InterfaceChoice | None) -> None:
    name = socket.gethostname()
    try:
        address = network.resolve_ipv4(name)
    except network.NetworkError as exc:
        report.add(WARN if spans else OK, "host name", str(exc), "Add this host's name to /etc/hosts or DNS "
                   "if other hosts or TF_CONFIG use it.")
        return
    if spans and address.startswith("127."):
        mine = chosen.interface.address if chosen else "this host's address"
        report.add(WARN, "host name", f"{name} resolves to {address} (loopback) here; towers binds the interface "
                   "below instead", f"Other hosts must resolve {name} to {mine} (or use that address): check their "
                   "/etc/hosts or DNS.")
    else:
        report.add(OK, "host name", f"{name} resolves to {address}")


def _check_interface(report: DoctorReport, info: ProcessInfo) -> tuple[bool, network.InterfaceChoice | None]:
    """Return (usable, the interface the job binds: None on one host without one named)."""
    report.interfaces = network.list_interfaces()
    try:
        chosen = network.interface_for(info, interfaces=report.interfaces)
    except network.NetworkError as exc:
        report.add(FAIL, "interface", str(exc), "Pass --interface NAME (towers launch / towers doctor).")
        return False, None
    if chosen is None:
        report.add(OK, "interface", "one host: torch's default (this host's name); no interface named")
    else:
        report.add(OK, "interface", f"{chosen.interface}: {chosen.reason}")
    return True, chosen


def _check_rendezvous(report: DoctorReport, info: ProcessInfo, spec: DoctorSpec,
                      progress: Callable[[str], None]) -> Any:
    """Return the job's store (node 0 hosts it unless a launcher's agent does), or None after a FAIL."""
    import torch.distributed as dist

    from towers.process_group import first_line

    where = f"{info.master_addr}:{info.master_port}"
    if info.master_port is None:
        report.add(FAIL, "rendezvous", f"no port is known for {info.master_addr}", "Pass --master-port PORT (the "
                   "same on every node), or run under towers launch.")
        return None
    try:
        address, source = network.route_to(info.master_addr)
    except network.NetworkError as exc:
        report.add(FAIL, "rendezvous", str(exc), "Pass node 0's address as this host reaches it: --master-addr.")
        return None
    hosts_store = info.rank == 0 and not info.agent_store
    if network.spans_hosts(info) and address.startswith("127.") and not hosts_store:
        report.add(FAIL, "rendezvous", f"{info.master_addr} resolves to {address} (loopback) on this host, but the "
                   "rendezvous is on node 0, another host", f"Use node 0's address or a name that resolves to it "
                   f"here (not {info.master_addr}): --master-addr.")
        return None
    started, deadline, said = time.monotonic(), time.monotonic() + spec.timeout_s, time.monotonic()
    while not hosts_store:  # a plain TCP connect first: a clear message while waiting, no torch retries
        try:
            socket.create_connection((address, int(info.master_port)), timeout=2.0).close()
            break
        except OSError as exc:
            text = exc.strerror or str(exc)
        if time.monotonic() > deadline:
            report.add(FAIL, "rendezvous", f"{where} ({address}) not reachable after "
                       f"{time.monotonic() - started:.1f} s: {text}",
                       f"Start towers doctor (or the job) on node 0 too, with --master-addr {info.master_addr}; "
                       f"check that {address} is node 0's address as this host reaches it and that no firewall "
                       f"blocks port {info.master_port}.")
            return None
        if time.monotonic() - said >= 1.0:
            progress(f"waiting for the rendezvous {where} ({address}) on node 0: {text}")
            said = time.monotonic()
        time.sleep(0.2)
    try:
        store = dist.TCPStore(info.master_addr, int(info.master_port), world_size=info.world_size,
                              is_master=hosts_store, timeout=timedelta(seconds=spec.timeout_s),
                              wait_for_workers=False, multi_tenant=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several types; each becomes one FAIL line
        fix = (f"Port {info.master_port} may be taken on this host: pick another --master-port (the same on every "
               "node)." if hosts_store else "Check that node 0 runs towers doctor (or the job) on that port.")
        report.add(FAIL, "rendezvous", f"{where} ({address}): {first_line(exc)}", fix)
        return None
    role = "served here" if hosts_store else f"reached from {source}"
    report.add(OK, "rendezvous", f"{where} -> {address}, {role} in {1000 * (time.monotonic() - started):.0f} ms")
    return store


def _join(report: DoctorReport, info: ProcessInfo, store: Any, chosen: Any, spec: DoctorSpec,
          progress: Callable[[str], None]) -> bool:
    """Publish this node's facts, wait (saying for whom) until every rank has, and read theirs."""
    address = chosen.interface.address if chosen else None
    mine = {"rank": info.rank, "node": info.node_rank, "host": socket.gethostname(),
            "interface": chosen.name if chosen else "(default)", "address": address}
    store.set(f"towers/doctor/peer/{info.rank}", json.dumps(mine))
    keys = [f"towers/doctor/peer/{r}" for r in range(info.world_size)]
    deadline, said = time.monotonic() + spec.timeout_s, time.monotonic()
    while not store.check(keys):
        missing = [r for r in range(info.world_size) if not store.check([keys[r]])]
        if time.monotonic() > deadline:
            return report.add(FAIL, "peers", f"rank(s) {missing} did not join within {spec.timeout_s:g} s",
                              f"Run towers doctor on every node (--nnodes {info.world_size}, node ranks "
                              f"0..{info.world_size - 1}) with the same --master-addr/--master-port.")
        if time.monotonic() - said >= 2.0:
            progress(f"waiting for rank(s) {missing} of {info.world_size} to join at {info.master_addr}:{info.master_port}")
            said = time.monotonic()
        time.sleep(0.1)
    report.peers = [json.loads(store.get(k)) for k in keys]
    loopback = [p["rank"] for p in report.peers if (p["address"] or "").startswith("127.")]
    if network.spans_hosts(info) and loopback:
        return report.add(FAIL, "peers", f"rank(s) {loopback} bind a loopback address, which other hosts cannot "
                          "reach", "Pass --interface NAME with the interface that reaches the other hosts.")
    hosts = len({p["host"] for p in report.peers})
    return report.add(OK, "peers", f"{info.world_size} rank(s) joined from {hosts} host(s)")


def _measure(report: DoctorReport, info: ProcessInfo, store: Any, spec: DoctorSpec) -> None:
    import torch
    import torch.distributed as dist

    n, rank = info.world_size, info.rank
    dist.init_process_group("gloo", store=dist.PrefixStore("towers/doctor/pg", store), rank=rank, world_size=n,
                            timeout=timedelta(seconds=spec.timeout_s))
    try:
        numel = max(1, int(spec.size_mb * 2**20) // 4)
        data, small, ack = torch.ones(numel), torch.zeros(2, dtype=torch.float64), torch.zeros(1)
        table = torch.zeros(n, n, 3, dtype=torch.float64)  # [i, j] = rtt_s, bytes/s, clock offset of j vs i
        pings = max(10, spec.repeats) + 2  # the first two (connection set-up) are not counted
        for i in range(n):
            for j in range(i + 1, n):
                if rank == i:
                    rtts, offsets = [], []
                    for _ in range(pings):
                        t0, p0 = time.time(), time.perf_counter()
                        dist.send(small, j)
                        dist.recv(small, j)
                        rtts.append(time.perf_counter() - p0)
                        offsets.append(small[0].item() - (t0 + time.time()) / 2)
                    dist.send(data, j)  # warm-up, not timed
                    dist.recv(ack, j)
                    began = time.perf_counter()
                    for _ in range(spec.repeats):
                        dist.send(data, j)
                        dist.recv(ack, j)
                    rate = spec.repeats * numel * 4 / (time.perf_counter() - began)
                    table[i, j] = torch.tensor([statistics.median(rtts[2:]), rate, statistics.median(offsets[2:])])
                elif rank == j:
                    for _ in range(pings):
                        dist.recv(small, i)
                        small[0] = time.time()
                        dist.send(small, i)
                    for _ in range(spec.repeats + 1):
                        dist.recv(data, i)
                        dist.send(ack, i)
                dist.barrier()
        dist.all_reduce(table)
        report.links = [{"pair": (i, j), "rtt_ms": 1e3 * table[i, j, 0].item(), "gbps": table[i, j, 1].item() / 1e9,
                         "offset_s": table[i, j, 2].item()} for i in range(n) for j in range(i + 1, n)]
        dist.all_reduce(data)  # warm-up
        dist.barrier()
        began = time.perf_counter()
        for _ in range(spec.repeats):
            dist.all_reduce(data)
        elapsed = torch.tensor([(time.perf_counter() - began) / spec.repeats])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = elapsed.item()
        report.all_reduce = {"mb": numel * 4 / 2**20, "ms": 1e3 * seconds, "ranks": n,
                             "bus_gbps": numel * 4 * 2 * (n - 1) / n / seconds / 1e9}
    finally:
        dist.destroy_process_group()
    skewed = [link for link in report.links if abs(link["offset_s"]) > 1.0]
    for link in skewed:
        report.add(WARN, "clocks", f"ranks {link['pair'][0]} and {link['pair'][1]} differ by {link['offset_s']:+.2f} s",
                   "Run NTP (chrony/systemd-timesyncd) on every host: logs and timeouts compare times.")
    report.add(OK, "links", f"{len(report.links)} pair(s) and an all-reduce measured")


def run_doctor(info: ProcessInfo, spec: DoctorSpec | None = None, *,
               progress: Callable[[str], None] = lambda line: None) -> DoctorReport:
    """Run every check for this process of the job and return the report (``report.ok``: nothing failed).

    ``progress(line)`` is called while a wait lasts, naming whom it waits for.
    """
    from towers._logging import set_rank

    spec = spec or DoctorSpec()
    set_rank(info.rank, info.world_size)
    report = DoctorReport(info)
    usable, chosen = _check_interface(report, info)
    _check_names(report, network.spans_hosts(info), chosen)
    report.checks.insert(0, report.checks.pop())  # the name first: the order a job meets them
    if not usable:
        return report
    if chosen is not None:
        network.use_interface(info)  # the group below binds what the job would bind
    if info.world_size == 1:
        report.add(OK, "rendezvous", "one process: nothing to reach (pass --nnodes/--node-rank/--master-addr, or "
                   "run under towers launch)")
        return report
    store = _check_rendezvous(report, info, spec, progress)
    if store is not None and _join(report, info, store, chosen, spec, progress):
        _measure(report, info, store, spec)
    return report


def format_report(report: DoctorReport, *, tables: bool = True) -> str:
    """Return the report as text: the checks, then (with ``tables``) peers, links, all-reduce and what to fix."""
    info = report.info
    lines = [f"towers doctor: rank {info.rank} of {info.world_size} (node {info.node_rank}), "
             f"rendezvous {info.master_addr}:{info.master_port if info.master_port is not None else '?'}"]
    lines += [f"  {c.status:<4}  {c.what:<11} {c.detail}" for c in report.checks]
    if tables:
        lines.append("interfaces on this host: " + ", ".join(str(i) for i in report.interfaces))
        if report.peers:
            lines.append(f"  {'rank':>4}  {'node':>4}  {'host':<16} {'interface':<12} address")
            lines += [f"  {p['rank']:>4}  {p['node']:>4}  {p['host']:<16} {p['interface']:<12} {p['address'] or '-'}"
                      for p in report.peers]
        if report.links:
            lines.append(f"  {'ranks':<7} {'latency (round trip)':>20} {'bandwidth':>12} {'clock offset':>13}")
            lines += [f"  {link['pair'][0]}<->{link['pair'][1]:<3} {link['rtt_ms']:>17.3f} ms "
                      f"{link['gbps']:>7.2f} GB/s {link['offset_s']:>+11.3f} s" for link in report.links]
        if report.all_reduce:
            a = report.all_reduce
            lines.append(f"  all-reduce of {a['mb']:g} MB over {a['ranks']} ranks: {a['ms']:.2f} ms, "
                         f"bus bandwidth {a['bus_gbps']:.2f} GB/s")
    fixes = [f"  - {c.what}: {c.fix}" for c in report.checks if c.fix and c.status != OK]
    lines.append("what to fix:" if fixes else "what to fix: nothing; this node is ready.")
    return "\n".join(lines + fixes)


if __name__ == "__main__":  # under a launcher: towers launch --nnodes 2 ... -m towers.doctor
    import sys

    from towers.cli import main

    sys.exit(main(["doctor", *sys.argv[1:]]))

"""The stuck-job report: which rank is stuck, where every rank is, and every rank's Python stack.

Pure functions of what the watchdogs gathered (each rank's last heartbeat, the answers to the
dump request), so the verdict is tested without processes.

A rank's *position* is ``(collective, calls)``: the sequence number of the collective it is in (or
last finished) on the default process group, from torch's flight recorder, then the number of
towers calls it entered (collectives of the synchronous strategies, requests to parameter
servers). Ranks that stopped answering, or run outside every collective while others wait,
are the stuck ones. When every rank waits, the ranks whose position differs from the majority's
are named: *ahead* (waits in a collective the others never entered: it ran one step more, or
they skipped one) or *behind*.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

__all__ = ["STUCK_EXIT_CODE", "build_report", "verdict", "describe_position"]

#: Exit code of every process that the watchdog ends (as GNU ``timeout`` uses it).
STUCK_EXIT_CODE = 124


def _collective_seq(snap: Mapping[str, Any]) -> int:
    fr = snap.get("collective")
    if not fr:
        return 0
    in_default_group = " on group " not in str(fr.get("pending_kind"))  # sub-groups number their own collectives
    pending = not fr.get("done", True) and fr.get("pending_seq") is not None and in_default_group
    return int(fr["pending_seq"] if pending else fr["seq"])


def _position(snap: Mapping[str, Any]) -> tuple[int, int]:
    return _collective_seq(snap), int(snap.get("calls", 0))


def _wait_text(snap: Mapping[str, Any]) -> str:
    fr = snap.get("collective")
    parts = []
    if fr and not fr.get("done", True):
        parts.append(f"collective #{fr['pending_seq']} ({fr['pending_kind']})")
    if snap.get("call"):
        parts.append(f"towers call #{snap['calls']} {snap['call']}")
    return ", inside ".join(parts) if parts else "an unknown wait"


def _last_text(snap: Mapping[str, Any]) -> str:
    fr = snap.get("collective")
    parts = [f"collective #{fr['seq']} ({fr['kind']})" if fr else "no collective recorded"]
    if snap.get("calls"):
        parts.append(f"towers call #{snap['calls']} {snap.get('last_call')}")
    return "last finished " + " and ".join(parts)


def describe_position(snap: Mapping[str, Any], now: float) -> str:
    """Return where a rank is, e.g. ``waits 4.2 s in collective #14 (allreduce), inside towers call #5 ...``."""
    if snap.get("waiting") and snap.get("since") is not None:
        return f"waits {max(0.0, now - float(snap['since'])):.1f} s in {_wait_text(snap)}"
    if snap.get("role") == "ps":
        return "serves the workers (see its threads below)"
    return f"runs outside any collective ({_last_text(snap)})"


def _who(rank: int, snap: Mapping[str, Any] | None) -> str:
    if not snap:
        return f"rank {rank}"
    return f"rank {rank} ({snap.get('role', 'worker')}, pid {snap.get('pid')} on {snap.get('host')})"


def verdict(snaps: Mapping[int, Mapping[str, Any]], answered: set[int], world_size: int,
            now: float) -> tuple[list[int], list[str]]:
    """Return ``(named ranks, verdict lines)`` from every rank's latest snapshot and who answered the dump."""
    lines: list[str] = []
    named: list[int] = []
    participants = [r for r in range(world_size) if (snaps.get(r) or {}).get("role", "worker") != "ps"]
    silent = [r for r in range(world_size) if r not in answered]
    waiting = [r for r in participants if r in answered and snaps[r].get("waiting")]
    running = [r for r in participants if r in answered and not snaps[r].get("waiting")]
    for r in silent:
        snap = snaps.get(r)
        age = f"its last heartbeat is {now - float(snap['time']):.1f} s old; it was: " \
              f"{describe_position(snap, float(snap['time']))}" if snap else "it never sent a heartbeat"
        lines.append(f"rank {r} did not answer: stopped or hung in C code ({age}).")
        named.append(r)
    if waiting:
        for r in running:
            lines.append(f"rank {r} is not in any collective while rank(s) {_join(waiting)} wait: it loops, computes "
                         f"or blocks outside towers ({_last_text(snaps[r])}); see its stack below.")
            named.append(r)
    if named:
        return named, lines
    groups: dict[tuple[int, int, str], list[int]] = {}
    for r in waiting:
        groups.setdefault((*_position(snaps[r]), _wait_text(snaps[r])), []).append(r)
    if len(groups) <= 1:
        ps = [r for r in range(world_size) if r not in participants]
        where = f"the parameter server(s) {_join(ps)}" if ps else "the network or one slow collective"
        lines.append(f"every worker waits in the same place ({_wait_text(snaps[waiting[0]]) if waiting else '-'}); "
                     f"no worker is behind: look at {where} in the stacks below.")
        return ps, lines
    majority = next((g for g in groups.values() if len(g) * 2 > len(waiting)), None)
    reference = majority if majority is not None else []
    if majority is None:
        lines.append(f"ranks {_join(waiting)} disagree on the next collective; every rank is named (with two ranks "
                     "the odd one out cannot be told): one skipped a collective or ran one more.")
    for r in waiting:
        if r in reference:
            continue
        others = reference or [o for o in waiting if o != r]
        mine, theirs = _position(snaps[r]), max(_position(snaps[o]) for o in others)
        if mine > theirs:
            lines.append(f"rank {r} is ahead: it waits in {_wait_text(snaps[r])}, which rank(s) {_join(others)} "
                         "never entered (it ran one step more, or they skipped a collective).")
        elif mine < theirs:
            lines.append(f"rank {r} is behind: it waits in {_wait_text(snaps[r])} and never entered the collective "
                         f"rank(s) {_join(others)} wait in (it skipped a collective, or they ran one more).")
        else:
            lines.append(f"rank {r} waits in {_wait_text(snaps[r])}, a different collective from rank(s) "
                         f"{_join(others)} at the same point.")
        named.append(r)
    return named, lines


def _join(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def build_report(*, trigger: Mapping[str, Any], snaps: Mapping[int, Mapping[str, Any]],
                 stacks: Mapping[int, str], world_size: int, now: float | None = None) -> str:
    """Return the whole report text: headline, verdict, where each rank is, and each rank's Python stack.

    ``trigger`` is the snapshot of the rank that noticed the wait (with ``min_s``/``factor`` of its bound);
    ``stacks`` holds the stacks of the ranks that answered.
    """
    now = time.time() if now is None else now
    named, lines = verdict(snaps, set(stacks), world_size, now)
    r = int(trigger["rank"])
    if trigger.get("step_s") is None:
        formula = (f"{float(trigger.get('startup_factor', 5)):g} x {float(trigger['min_s']):g} s, as no step was "
                   "measured yet")
    else:
        formula = (f"max({float(trigger['min_s']):g} s, {float(trigger['factor']):g} x the slowest recent step "
                   f"{float(trigger['step_s']):.3f} s)")
    head = (f"towers: the job is stuck. Rank {r} {describe_position(trigger, now)}, past the bound of "
            f"{float(trigger['bound_s']):.1f} s = {formula}. Every rank exits with code {STUCK_EXIT_CODE}.")
    out = [head, f"Stuck: {'rank' if len(named) == 1 else 'ranks'} {_join(named)}." if named else "Stuck: no rank named.",
           *[f"  {line}" for line in lines], "Where each rank is:"]
    for rank in range(world_size):
        snap = snaps.get(rank)
        if snap is None:
            out.append(f"  rank {rank}: no heartbeat")
            continue
        answer = "" if rank in stacks else " [did not answer]"
        step_s = snap.get("step_s")
        timing = "no step measured" if step_s is None else f"slowest recent step {float(step_s):.3f} s"
        out.append(f"  {_who(rank, snap)}: step {snap.get('steps', 0)}, {timing}; {describe_position(snap, now)}"
                   f"{answer}")
    out.append("Python stacks:")
    for rank in range(world_size):
        out.append(f"--- rank {rank} ---")
        out.append(stacks[rank].rstrip() if rank in stacks else "(no stack: the rank did not answer: stopped or hung "
                                                                 "in C code)")
    return "\n".join(out) + "\n"

"""The ledger of committed updates, in one process: the file format, the proof, and the Trainer's own records.

The proof's reference is plain arithmetic over the dataset (every index of ``range(n)`` once per epoch);
faulty histories (a doubled share, a lost batch, a restore at the wrong place) must be named with the
step where they happened, and a restore from a checkpoint must roll back exactly what it lost.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import towers
from towers import callbacks as C
from towers.checkpoint import load_checkpoint
from towers.ledger import LedgerWriter, OrderSpec, prove_ledger
from towers.ledger.proof import read_ledger
from towers.training.trainer import Trainer

N, B = 40, 8  # 5 global batches per epoch
ORDER = OrderSpec(N, B, seed=3, shuffle=True)


def _write_epochs(writer: LedgerWriter, epochs: int, *, skip: tuple[int, int] | None = None,
                  twice: tuple[int, int] | None = None, replicas: int = 2, first_step: int = 0) -> int:
    """Lines of ``epochs`` clean epochs (each global batch as ``replicas`` shares); return the last global step."""
    writer.order(ORDER)
    step = first_step
    for epoch in range(epochs):
        for g in range(N // B):
            step += 1
            for r in range(replicas):
                lo, hi = g * B + r * B // replicas, g * B + (r + 1) * B // replicas
                if (epoch, g) != skip:
                    writer.update(step, epoch, g, lo, hi)
                if (epoch, g) == twice and r == 0:
                    writer.update(step, epoch, g, lo, hi)
    return step


def _age(path: Path, to: Path) -> None:
    """Move a ledger file to ``to`` with every time an hour earlier (a process of an earlier attempt)."""
    lines = []
    for line in path.read_text().splitlines():
        kind, rest = line.split("\t", 1)
        if kind == "H":
            header = json.loads(rest)
            header["time"] -= 3600
            rest = json.dumps(header)
        else:
            t, more = rest.split("\t", 1)
            rest = f"{float(t) - 3600}\t{more}"
        lines.append(f"{kind}\t{rest}\n")
    to.write_text("".join(lines))
    path.unlink()


def test_a_clean_history_is_proved_and_the_report_is_a_table(tmp_path):
    writer = LedgerWriter(tmp_path, "rank0")
    _write_epochs(writer, 2)
    writer.close()
    proof = prove_ledger(tmp_path)
    assert proof.ok and [e.verdict for e in proof.epochs] == ["exactly once"] * 2
    assert [e.once for e in proof.epochs] == [N, N]
    text = proof.format()
    assert "exactly once" in text and "verdict: every example" in text


def test_a_doubled_share_and_a_lost_batch_are_named_with_their_steps(tmp_path):
    writer = LedgerWriter(tmp_path, "rank0")
    _write_epochs(writer, 2, skip=(0, 2), twice=(1, 3))
    proof = prove_ledger(tmp_path)
    assert not proof.ok
    lost, doubled = proof.epochs
    assert (lost.missing_count, lost.doubled_count) == (B, 0)
    order0 = torch.randperm(N, generator=torch.Generator().manual_seed(3 + 0))
    expected = ", ".join(str(int(i)) for i in order0[2 * B:3 * B])
    assert f"positions 16..23 (global batch 2; dataset indices {expected})" in lost.missing[0]
    assert "after step 2 (rank0" in lost.missing[0] and "before step 4 (rank0" in lost.missing[0]
    assert doubled.doubled_count == B // 2
    order1 = torch.randperm(N, generator=torch.Generator().manual_seed(3 + 1))
    assert doubled.doubled[0].startswith(f"example {int(order1[3 * B])} (position 24, global batch 3) trained 2 times")
    assert "step 9 (rank0" in doubled.doubled[0]
    assert "NOT exact" in proof.format()


def test_a_restore_rolls_back_what_the_dead_processes_wrote_after_its_position(tmp_path):
    old = LedgerWriter(tmp_path, "rank0")
    _write_epochs(old, 1)  # the whole epoch 0 ...
    old.close()
    _age(old.path, old.path.with_name("rank0-1.tsv"))  # ... by a process that is gone (an hour ago)
    new = LedgerWriter(tmp_path, "rank0")
    new.went_on(0, 3 * B, "restore")  # a checkpoint after 3 global batches: batches 3 and 4 were lost
    new.order(ORDER)
    for g in (3, 4):
        new.update(10 + g, 0, g, g * B, (g + 1) * B)
    new.close()
    proof = prove_ledger(tmp_path)
    assert proof.ok and proof.rolled_back == 4 and proof.epochs[0].verdict == "exactly once"
    assert "restored to epoch 0, example 24" in proof.format()


def test_a_restore_keeps_what_a_live_process_of_the_restored_job_wrote_before_it(tmp_path):
    ps = LedgerWriter(tmp_path, "ps0")  # ps task 0 of the new attempt records units applied ...
    ps.order(ORDER)
    ps.update(1, 0, 0, 0, B)
    late = LedgerWriter(tmp_path, "rank1")
    late.went_on(0, 0, "restore")  # ... before a slower worker noted where the job goes on from
    late.close()
    ps.order(ORDER)
    for g in range(1, N // B):
        ps.update(g + 1, 0, g, g * B, (g + 1) * B)
    ps.close()
    proof = prove_ledger(tmp_path)
    assert proof.ok and proof.rolled_back == 0, proof.format()


def test_a_join_rolls_nothing_back_and_an_epoch_in_progress_is_not_counted_missing(tmp_path):
    writer = LedgerWriter(tmp_path, "rank0")
    last = _write_epochs(writer, 1)
    joined = LedgerWriter(tmp_path, "rank1")
    joined.went_on(1, 2 * B, "join")
    writer.update(last + 1, 1, 0, 0, B)
    proof = prove_ledger(tmp_path)
    assert proof.ok and proof.rolled_back == 0
    assert proof.epochs[1].verdict == f"in progress ({B} of {N})"


def test_a_line_cut_short_is_skipped_and_a_foreign_file_is_refused(tmp_path):
    writer = LedgerWriter(tmp_path, "rank0")
    _write_epochs(writer, 1)
    writer.close()
    with open(writer.path, "a") as f:
        f.write("U\t1.0\t99\t0\t0")  # a process killed mid-line
    assert read_ledger(tmp_path)[0][-1].step == N // B
    (tmp_path / "ledger" / "notes.tsv").write_text("hello\n")
    with pytest.raises(ValueError, match="notes.tsv line 1 is not a ledger line"):
        prove_ledger(tmp_path)
    with pytest.raises(FileNotFoundError, match="TOWERS_LEDGER_DIR"):
        prove_ledger(tmp_path / "nothing")


def _data(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _trainer() -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loss=nn.MSELoss(reduction="none"))


def test_the_trainer_records_every_step_and_the_env_variable_turns_it_on(tmp_path, monkeypatch):
    x, y = _data()
    monkeypatch.setenv("TOWERS_LEDGER_DIR", str(tmp_path))
    trainer = Trainer(nn.Linear(4, 1), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0),
                      loss=nn.MSELoss(reduction="none"), strategy=towers.OneDeviceStrategy("cpu"))
    trainer.fit((x, y), epochs=2, global_batch_size=B)
    updates, _, _ = read_ledger(tmp_path)
    assert [(u.epoch, u.batch, u.lo, u.hi) for u in updates] == [(e, g, g * B, (g + 1) * B) for e in range(2)
                                                                 for g in range(N // B)]
    assert [u.step for u in updates] == list(range(1, 2 * N // B + 1))
    assert prove_ledger(tmp_path).ok


def test_a_crash_and_a_resume_from_backup_train_each_example_once(tmp_path):
    x, y = _data()

    class Crash(C.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs["global_step"] == 7:
                raise KeyboardInterrupt("simulated crash")

    def run(*extra: C.Callback) -> None:
        _trainer().fit((x, y), 3, B, callbacks=[C.BackupAndRestore(tmp_path / "backup", save_freq=3),
                                                C.ExampleLedger(tmp_path / "run"), *extra])

    with pytest.raises(KeyboardInterrupt):
        run(Crash())
    assert load_checkpoint(tmp_path / "backup" / "backup")["global_step"] == 6
    run()
    proof = prove_ledger(tmp_path / "run")
    assert proof.ok and [e.verdict for e in proof.epochs] == ["exactly once"] * 3, proof.format()
    assert proof.rolled_back == 1  # step 7 was trained, then lost to the crash


def test_a_resume_at_another_global_batch_doubles_examples_and_the_ledger_names_them(tmp_path, caplog):
    x, y = _data()
    trainer = _trainer()
    trainer.fit((x, y), 1, B, callbacks=[C.BackupAndRestore(tmp_path / "b", save_freq=3, delete_checkpoint=False),
                                         C.ExampleLedger(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="towers"):
        _trainer().fit((x, y), 1, 10, callbacks=[C.BackupAndRestore(tmp_path / "b", delete_checkpoint=False),
                                                 C.ExampleLedger(tmp_path)])
    assert "examples are seen twice" in caplog.text
    proof = prove_ledger(tmp_path)
    assert not proof.ok and proof.epochs[0].doubled_count == 4, proof.format()  # 24 trained, resumed at 20


def test_towers_verify_ledger_prints_the_proof_and_exits_by_its_verdict(tmp_path, capsys):
    from towers.cli import main

    writer = LedgerWriter(tmp_path / "good", "rank0")
    _write_epochs(writer, 1)
    assert main(["verify", "--ledger", str(tmp_path / "good")]) == 0
    assert "exactly once" in capsys.readouterr().out
    writer = LedgerWriter(tmp_path / "bad", "rank0")
    _write_epochs(writer, 1, skip=(0, 1))
    assert main(["verify", "--ledger", str(tmp_path / "bad")]) == 1
    assert "never trained" in capsys.readouterr().out
    assert main(["verify", "--ledger", str(tmp_path / "none")]) == 2
    assert "TOWERS_LEDGER_DIR" in capsys.readouterr().err
    assert main(["verify"]) == 2
    assert "Pass your training script" in capsys.readouterr().err


def _simulated_job(tmp_path: Path, seed: int, *, groups: int = 3, kills: int = 12,
                   seen: bool = True) -> tuple[int, int]:
    """Write the ledger of a job of ``groups`` replica groups killed ``kills`` times at seeded moments of a step.

    What each group's ``ExampleLedger`` writes under FaultTolerantStrategy: after a committed step its own
    share (``U``) and the other groups' shares of the step (``W``; not with ``seen=False``, the old ledger).
    A kill before the commit (between steps, in forward or backward) drops the step on every group, which
    retry it over the survivors; a kill after the commit and before the ledger line leaves the victim's share
    to the others; a kill after the line loses nothing. A killed group is back 1-3 steps later. Return the
    kills after a commit and the number of kills made.
    """
    import random

    from towers.data._batch import shard_bounds

    rng = random.Random(seed)
    moments = ["between", "forward", "backward", "commit", "recorded"]
    writers = {g: LedgerWriter(tmp_path, f"rank{g}", rank=g, world_size=groups) for g in range(groups)}
    for w in writers.values():
        w.order(ORDER)
    away: dict[int, int] = {}  # killed group -> steps until it is back
    lost = made = step = 0
    while step < EPOCHS * N // B:
        epoch, batch = divmod(step, N // B)
        live = [g for g in range(groups) if away.get(g, 0) == 0]
        away = {g: n - 1 for g, n in away.items() if n > 1}
        kill = made < kills and len(live) > 1 and rng.random() < 0.7
        victim, moment = (rng.choice(live), rng.choice(moments)) if kill else (None, None)
        if victim is not None:
            made += 1
            away[victim] = rng.randint(1, 3)
        if moment in ("between", "forward", "backward"):
            continue  # not committed anywhere: the same global batch again, over the survivors
        shares = [(batch * B + lo, batch * B + hi) for lo, hi in (shard_bounds(B, len(live), r) for r in range(len(live)))]
        step += 1
        for r, g in enumerate(live):
            if g == victim and moment == "commit":
                lost += 1
                continue  # killed after its commit, before its ledger line
            writers[g].update(step, epoch, batch, *shares[r])
            for other, (lo, hi) in enumerate(shares):
                if other != r and seen:
                    writers[g].witnessed(step, epoch, batch, lo, hi)
    for w in writers.values():
        w.close()
    return lost, made


EPOCHS = 6


@pytest.mark.parametrize("seed", range(4))
def test_a_share_whose_group_died_after_the_commit_is_proved_by_the_live_groups(tmp_path, seed):
    """Seeded kills at every moment of a step, 3 groups: exactly once, each lost share counted from a live record."""
    lost, made = _simulated_job(tmp_path / "seen", seed)
    assert made == 12
    proof = prove_ledger(tmp_path / "seen")
    assert proof.ok and [e.verdict for e in proof.epochs] == ["exactly once"] * EPOCHS, proof.format()
    assert proof.witnessed == lost
    if lost:  # each group recording only its own share (the old ledger): the killed groups' shares go missing
        _simulated_job(tmp_path / "own", seed, seen=False)
        old = prove_ledger(tmp_path / "own")
        assert not old.ok and sum(e.missing_count for e in old.epochs) > 0, old.format()


def test_a_seen_share_counts_once_and_never_beside_its_own_record(tmp_path):
    writer = LedgerWriter(tmp_path, "rank0")
    other = LedgerWriter(tmp_path, "rank1")
    writer.order(ORDER)
    other.order(ORDER)
    for g in range(N // B):
        writer.update(g + 1, 0, g, g * B, g * B + B // 2)
        writer.witnessed(g + 1, 0, g, g * B + B // 2, (g + 1) * B)
        other.witnessed(g + 1, 0, g, g * B, g * B + B // 2)  # recorded by its own group too: not counted again
        if g != 2:  # the share of batch 2 was seen by two groups and recorded by none: counted once
            other.update(g + 1, 0, g, g * B + B // 2, (g + 1) * B)
        else:
            other.witnessed(g + 1, 0, g, g * B + B // 2, (g + 1) * B)
    proof = prove_ledger(tmp_path)
    assert proof.ok and proof.epochs[0].verdict == "exactly once" and proof.witnessed == 1, proof.format()
    assert "1 share(s) counted from another replica's record" in proof.format()
    writer.update(99, 0, 1, B, B + 1)  # a real double (another step) is still named
    assert prove_ledger(tmp_path).epochs[0].doubled_count == 1

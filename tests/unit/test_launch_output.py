"""towers launch's worker output: whole lines with the rank, chosen by torchrun's --redirects/--tee/--local-ranks-filter."""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.api import Std

from towers.launch.output import WholeLineLogs


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {i: {"RANK": str(10 + i), "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": "0"} for i in range(n)}


def test_lines_written_in_pieces_come_out_whole_with_the_global_rank(tmp_path, capfd):
    logs = WholeLineLogs(log_dir=str(tmp_path), redirects=Std.NONE, tee=Std.NONE)
    dest = logs.reify(_envs(2))
    with open(dest.stdouts[0], "w") as out0, open(dest.stdouts[1], "w") as out1, open(dest.stderrs[1], "w") as err1:
        out0.write('{"a": ')  # half a line, flushed: must not be shown until the rest comes
        out0.flush()
        out1.write("one\ntwo\n")
        out1.flush()
        out0.write('1}\nno newline at the end')
        err1.write("warning\n")
    logs.close()
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == sorted(['[rank 10]: {"a": 1}', "[rank 10]: no newline at the end",
                                               "[rank 11]: one", "[rank 11]: two"])
    assert err.splitlines() == ["[rank 11]: warning"]
    assert os.path.isfile(dest.stdouts[0])  # --log-dir keeps the files


def test_redirects_tee_and_local_ranks_filter_choose_what_is_shown(tmp_path, capfd):
    logs = WholeLineLogs(log_dir=None, redirects=Std.OUT, tee=Std.NONE, local_ranks_filter={1})
    dest = logs.reify(_envs(2))
    for rank in (0, 1):
        with open(dest.stdouts[rank], "w") as out, open(dest.stderrs[rank], "w") as err:
            out.write(f"out {rank}\n")
            err.write(f"err {rank}\n")
    logs.close()
    out, err = capfd.readouterr()
    assert out == ""  # stdout redirected to its file only, for every rank
    assert err.splitlines() == ["[rank 11]: err 1"]  # only local rank 1 is shown
    assert not os.path.exists(logs.root_log_dir)  # no --log-dir: the files are removed


def test_tee_shows_a_redirected_stream_too(tmp_path, capfd):
    logs = WholeLineLogs(log_dir=str(tmp_path), redirects=Std.ALL, tee=Std.OUT)
    dest = logs.reify(_envs(1))
    with open(dest.stdouts[0], "w") as out, open(dest.stderrs[0], "w") as err:
        out.write("shown\n")
        err.write("file only\n")
    logs.close()
    out, err = capfd.readouterr()
    assert out.splitlines() == ["[rank 10]: shown"] and err == ""
    with open(dest.stderrs[0]) as fh:
        assert fh.read() == "file only\n"


def test_a_progress_bar_redrawing_with_carriage_returns_is_shown_as_it_goes(tmp_path, capfd):
    logs = WholeLineLogs(log_dir=str(tmp_path), redirects=Std.NONE, tee=Std.NONE)
    dest = logs.reify(_envs(1))
    with open(dest.stderrs[0], "w") as err:
        err.write("10%\r50%\r100%\r\ndone\n")
    logs.close()
    _, err = capfd.readouterr()
    assert err == "[rank 10]: 10%\r[rank 10]: 50%\r[rank 10]: 100%\r\n[rank 10]: done\n"

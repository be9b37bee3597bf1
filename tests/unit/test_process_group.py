"""Backend choice and process-group errors that name the rank and what to check."""

from __future__ import annotations

import pytest

from towers.cluster.info import ProcessInfo
from towers.launch import free_port
from towers.process_group import DistributedError, choose_backend, collective, init_process_group


@pytest.mark.parametrize("local, gpus, expected", [(2, 0, "gloo"), (1, 1, None), (4, 2, "gloo"), (2, 2, None)])
def test_backend_is_nccl_only_when_every_local_replica_has_a_gpu(local, gpus, expected):
    import torch.distributed as dist

    if expected is None:
        expected = "nccl" if dist.is_nccl_available() else "gloo"
    assert choose_backend(local, cuda_device_count=gpus) == expected


def test_init_rejects_bad_arguments():
    info = ProcessInfo(master_port=free_port())
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        init_process_group(info, timeout_s=0)
    with pytest.raises(ValueError, match="backend must be"):
        init_process_group(info, backend="tcp")


def test_rendezvous_timeout_names_rank_and_address():
    # rank 1 of 2 waits for a rank 0 that never comes: the error must say who and where, within the join timeout.
    import time

    port = free_port()
    info = ProcessInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, master_port=port, join_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(DistributedError) as err:
        init_process_group(info, timeout_s=60)
    assert 1.5 <= time.monotonic() - started < 10
    text = str(err.value)
    assert "\n" not in text and err.value.__cause__ is None  # one line, torch's text not chained
    assert text.startswith(f"[rank 1/2] the chief, rank 0, did not open the rendezvous 127.0.0.1:{port} "
                           "(MASTER_ADDR/MASTER_PORT) within the join timeout of 1.5 s"), text


def test_rendezvous_host_that_does_not_resolve_fails_at_once():
    info = ProcessInfo(rank=1, world_size=2, local_world_size=2, master_addr="no-such-host.invalid", master_port=29500)
    with pytest.raises(DistributedError, match=r"^\[rank 1/2\] the rendezvous host 'no-such-host.invalid' "
                                               r"\(MASTER_ADDR/MASTER_PORT\) does not resolve"):
        init_process_group(info, timeout_s=60)


def test_missing_port_is_a_clear_error():
    with pytest.raises(ValueError, match="MASTER_PORT is unset"):
        init_process_group(ProcessInfo(rank=0, world_size=2, local_world_size=2))


def test_collective_wraps_torch_errors_with_the_operation():
    with pytest.raises(DistributedError, match=r"\[rank 0/1\] all_reduce\(loss\) failed: Connection reset"):
        with collective("all_reduce(loss)"):
            raise RuntimeError("Connection reset by peer\nmore torch detail")


def test_each_restart_attempt_sees_only_its_own_rendezvous_keys():
    # torchrun's agent store outlives a failed attempt: a restarted rank must not read a peer's
    # address from the dead attempt (it would try to connect to a closed port).
    import dataclasses

    from towers.process_group import _rendezvous_store

    first = ProcessInfo(master_port=free_port())
    host = _rendezvous_store(first, timeout_s=5)  # rank 0, no agent: hosts the store
    host.set("rank_1_address", "old")
    again = _rendezvous_store(dataclasses.replace(first, agent_store=True), timeout_s=5)
    assert again.get("rank_1_address") == b"old"  # same attempt: same keys, through a client
    restarted = _rendezvous_store(dataclasses.replace(first, agent_store=True, restart_count=1), timeout_s=5)
    assert restarted.check(["rank_1_address"]) is False


def test_torchrun_restart_variables_reach_process_info():
    from towers.cluster import from_env

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    info = from_env(env)
    assert (info.restart_count, info.agent_store) == (2, True)
    assert (from_env({"RANK": "0", "WORLD_SIZE": "1"}).restart_count, from_env({}).agent_store) == (0, False)


def test_a_failed_group_says_after_how_long_hints_at_the_interface_and_keeps_torchs_frames_in_a_file():
    from towers.process_group import _init_error

    info = ProcessInfo(rank=1, world_size=2, local_world_size=1, master_addr="10.0.0.1", master_port=29500)
    torch_error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] connect [127.0.1.1]:5301: "
                               "Connection refused\nException raised from ... (most recent call first):\nframe #0: c10")
    error = _init_error(info, "gloo", torch_error, 4.07)
    text = str(error)
    assert "\n" not in text and "frame #" not in text
    assert text.startswith("[rank 1/2] could not create the process group (gloo) at tcp://10.0.0.1:29500 after 4.1 s: "
                           "connect [127.0.1.1]:5301: Connection refused."), text
    assert "GLOO_SOCKET_IFNAME" in text and "--interface" in text and "within" not in text
    path = text.rsplit("torch's full message: ", 1)[1].rstrip(")")
    with open(path, encoding="utf-8") as fh:
        assert "frame #0: c10" in fh.read()

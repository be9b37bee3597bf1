"""Choosing the network interface: named, routed to a peer, never loopback when peers are remote."""

from __future__ import annotations

import json

import pytest

from towers import cluster, network
from towers.launch.spec import LaunchSpec, parse_launch_args
from towers.network import Interface, NetworkError

LO = Interface("lo", "127.0.0.1", 8, is_up=True, is_loopback=True)
ETH0 = Interface("eth0", "10.0.0.5", 24)
ETH1 = Interface("eth1", "192.168.1.5", 24)
DOWN = Interface("eth2", None, None, is_up=False)
HOST = [LO, ETH0, ETH1, DOWN]

# host -> (its address, the source address this host would use to reach it)
ROUTES = {
    "peer0": ("10.0.0.7", "10.0.0.5"),
    "peer1": ("192.168.1.9", "192.168.1.5"),
    "myself": ("127.0.1.1", "127.0.0.1"),  # Debian: this host's own name
    "localhost": ("127.0.0.1", "127.0.0.1"),
}


def route(host: str) -> tuple[str, str]:
    if host not in ROUTES:
        raise NetworkError(f"Host name {host!r} does not resolve")
    return ROUTES[host]


def choose(peers, *, remote_peers=True, interfaces=HOST, default_route=None):
    return network.choose_interface(peers, remote_peers=remote_peers, interfaces=interfaces, route=route,
                                    default_route=default_route)


def test_the_interface_that_routes_to_the_first_remote_peer():
    choice = choose(["myself", "peer1", "peer0"])
    assert choice.name == "eth1" and choice.interface.address == "192.168.1.5"
    assert choice.reason == "routes to peer1 (192.168.1.9)"


def test_never_loopback_when_peers_are_remote_and_every_name_is_this_host():
    # the rendezvous host: the only peer name it knows is its own, which resolves to loopback
    assert choose(["myself"], default_route="eth1").name == "eth1"  # the default route's interface
    only = choose(["myself"], interfaces=[LO, ETH0, DOWN])
    assert only.name == "eth0" and "the only non-loopback interface" in only.reason and "127.0.1.1" in only.reason
    with pytest.raises(NetworkError) as error:  # two candidates and no default route: ask, do not guess
        choose(["myself"])
    message = str(error.value)
    assert "eth0 (10.0.0.5/24)" in message and "eth1 (192.168.1.5/24)" in message and "--interface" in message
    with pytest.raises(NetworkError, match="0 candidate"):
        choose(["myself"], interfaces=[LO, DOWN])


def test_loopback_when_every_process_is_on_this_host():
    choice = choose(["localhost"], remote_peers=False)
    assert choice.name == "lo" and choice.interface.is_loopback


def test_unresolvable_peers_are_reported_when_nothing_else_decides():
    assert choose(["nowhere", "peer0"]).name == "eth0"  # one bad name does not hide a good one
    with pytest.raises(NetworkError, match="'nowhere' does not resolve"):
        choose(["nowhere"])


def test_find_interface_names_the_choices():
    assert network.find_interface("eth1", HOST) is ETH1
    assert network.find_interface("eth0,eth1", HOST) is ETH0  # GLOO_SOCKET_IFNAME may list several
    with pytest.raises(NetworkError, match=r"No network interface called 'wlan0'.*eth0 \(10.0.0.5/24\)"):
        network.find_interface("wlan0", HOST)
    with pytest.raises(NetworkError, match="'eth2' cannot carry"):
        network.find_interface("eth2", HOST)
    assert network.find_interface("en0", []) == Interface("en0")  # none can be listed here: the name is trusted


def test_this_host_has_a_loopback_interface_and_routes_to_it():
    interfaces = network.list_interfaces()
    loopback = [i for i in interfaces if i.is_loopback]
    assert loopback and loopback[0].address == "127.0.0.1" and loopback[0].contains("127.0.1.1")
    assert network.route_to("127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    assert network.choose_interface(["127.0.0.1"], remote_peers=False).interface.is_loopback
    assert network.resolve_ipv4("10.1.2.3") == "10.1.2.3"
    with pytest.raises(NetworkError, match="does not resolve"):
        network.resolve_ipv4("no-such-host.invalid")


def test_default_route_is_read_from_the_route_table(tmp_path):
    table = tmp_path / "route"
    table.write_text("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
                     "eth1\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
                     "eth0\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\n")
    assert network.default_route_interface(str(table)) == "eth0"
    table.write_text("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n")
    assert network.default_route_interface(str(table)) is None
    assert network.default_route_interface(str(tmp_path / "missing")) is None


def _torchrun(**extra: str) -> dict[str, str]:
    return {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", **extra}


def test_process_info_reads_the_interface_and_interface_for_uses_it():
    assert cluster.from_env(_torchrun()).interface is None
    assert cluster.from_env(_torchrun(GLOO_SOCKET_IFNAME="eth1")).interface == "eth1"
    info = cluster.from_env(_torchrun(TOWERS_INTERFACE="lo", GLOO_SOCKET_IFNAME="eth1"))
    assert info.interface == "lo"  # towers' own variable first
    with pytest.raises(NetworkError, match="is loopback, but the job spans hosts"):  # never loopback across hosts
        network.interface_for(info)
    one_host = cluster.from_env(_torchrun(TOWERS_INTERFACE="lo", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"))
    choice = network.interface_for(one_host)
    assert choice is not None and choice.name == "lo" and choice.reason.startswith("given")
    with pytest.raises(NetworkError, match="No network interface called 'nope0'"):
        network.interface_for(cluster.from_env(_torchrun(TOWERS_INTERFACE="nope0")))


def test_one_host_jobs_keep_torchs_default_and_peer_hosts_come_from_the_job():
    one_host = cluster.from_env({**_torchrun(), "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert not network.spans_hosts(one_host) and network.interface_for(one_host) is None
    spec = {"cluster": {"chief": ["hosta:2222"], "worker": ["hostb:2222", "hosta:2223"], "ps": ["hostc:2222"]},
            "task": {"type": "worker", "index": 1}}
    info = cluster.from_env({"TF_CONFIG": json.dumps(spec)})
    assert network.spans_hosts(info)
    assert network.peer_hosts(info) == ("hosta", "hostb", "hostc")  # rendezvous first; its own entry left out
    # every TF_CONFIG address on this host: the job runs on one host after all, so torch's default stays
    local = {"cluster": {"chief": ["localhost:2222"], "worker": ["127.0.0.1:2223"]}, "task": {"type": "chief",
                                                                                              "index": 0}}
    info = cluster.from_env({"TF_CONFIG": json.dumps(local)})
    assert network.spans_hosts(info) and network.interface_for(info) is None


def test_launch_interface_flag_reaches_every_link_variable():
    spec = parse_launch_args(["--nproc-per-node", "2", "--interface", "lo", "train.py"], gpu_count=0, cpu_count=2)
    assert spec.interface == "lo"
    env = spec.worker_environment({})
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == env["TOWERS_INTERFACE"] == "lo"
    with pytest.raises(ValueError, match="--interface lo is loopback, but the job spans 2 nodes"):
        LaunchSpec(script="train.py", max_nodes=2, min_nodes=2, master_addr="hosta", interface="lo").worker_environment({})
    with pytest.raises(NetworkError, match="No network interface called 'nope0' on this host"):
        LaunchSpec(script="train.py", interface="nope0").worker_environment({})  # checked before anything starts
    assert "GLOO_SOCKET_IFNAME" not in LaunchSpec(script="train.py").worker_environment({})
    with pytest.raises(ValueError, match="--interface must name one network interface"):
        LaunchSpec(script="train.py", interface="eth0 eth1")

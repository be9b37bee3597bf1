"""FaultTolerantStrategy's parts, without a lighthouse: how a healing group receives the live state (``WireTransport``:
JSON and tensor bytes, never a pickle), and how gradients are summed over the groups (``GradientSync``)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")

from towers.strategies.fault_tolerant.grads import GradientSync  # noqa: E402
from towers.strategies.fault_tolerant.transport import WireTransport  # noqa: E402
from towers.strategies.parameter_server.wire import ProtocolError  # noqa: E402


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


class _Loopback:
    """Point-to-point messages of a process group, kept in memory by tag (what one peer sent, the other reads)."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    def send(self, tensors, dst, tag):
        self.sent[tag] = tensors[0].clone()
        return _Done()

    def recv(self, tensors, src, tag):
        tensors[0].copy_(self.sent[tag])
        return _Done()


def _state() -> dict:
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(net.parameters(), betas=(0.8, 0.9))
    net(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return {"user": {"model_0": {"model": net.state_dict(), "optimizer": optimizer.state_dict()}},
            "torchft": {"step": 5, "batches_committed": 10}}


def test_a_state_crosses_whole_without_pickle() -> None:
    pg = _Loopback()
    sender, receiver = WireTransport(pg, timedelta(seconds=5)), WireTransport(pg, timedelta(seconds=5))
    state = _state()
    sender.send_checkpoint([1], 5, state, timedelta(seconds=5))
    got = receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=5))
    assert got["torchft"] == {"step": 5, "batches_committed": 10}
    sent_model, got_model = state["user"]["model_0"]["model"], got["user"]["model_0"]["model"]
    assert all(torch.equal(sent_model[k], got_model[k]) for k in sent_model)
    sent_opt, got_opt = state["user"]["model_0"]["optimizer"], got["user"]["model_0"]["optimizer"]
    assert got_opt["param_groups"][0]["betas"] == (0.8, 0.9) and set(got_opt["state"]) == {0, 1}  # int keys, tuples
    assert torch.equal(got_opt["state"][0]["exp_avg"], sent_opt["state"][0]["exp_avg"])
    torch.optim.Adam(torch.nn.Linear(3, 2).parameters()).load_state_dict(got_opt)  # a usable optimizer state


def test_a_wrong_step_or_a_foreign_sender_is_refused() -> None:
    pg = _Loopback()
    transport = WireTransport(pg, timedelta(seconds=5))
    transport.send_checkpoint([1], 5, _state(), timedelta(seconds=5))
    with pytest.raises(ProtocolError, match="a state for step 5 when step 6 was asked for"):
        transport.recv_checkpoint(0, "towers-wire", 6, timedelta(seconds=5))
    with pytest.raises(ProtocolError, match="not towers' wire format"):
        transport.recv_checkpoint(0, "<n/a>", 5, timedelta(seconds=5))
    pg.sent[1] = torch.tensor([-1, 0])  # a header no sender of this format writes
    with pytest.raises(ProtocolError, match="state header"):
        transport.recv_checkpoint(0, "towers-wire", 5, timedelta(seconds=5))


class _TwoEqualGroups:
    """torchft's manager as two groups with the same gradients see it: a sum doubles every value."""

    def __init__(self) -> None:
        self.calls = 0

    def allreduce(self, tensor, reduce_op):
        self.calls += 1
        tensor.mul_(2)
        return _Done()

    def errored(self):
        return None


def test_gradients_are_summed_once_at_the_end_of_backward() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    unused = torch.nn.Linear(2, 2)  # a parameter with no gradient this step still takes part in the sum
    model = torch.nn.ModuleDict({"net": net, "unused": unused})
    manager = _TwoEqualGroups()
    sync = GradientSync(manager, model, group=0)
    x = torch.randn(5, 3)
    net(x).pow(2).sum().backward()
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    reference.load_state_dict(net.state_dict())
    reference(x).pow(2).sum().backward()
    assert manager.calls == 1  # one flat all-reduce for every parameter
    for got, want in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, 2 * want.grad)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in unused.parameters())
    with pytest.raises(RuntimeError, match="a second backward pass before optimizer.step"):
        net(x).sum().backward()
    sync.step_done()
    net(x).sum().backward()  # the next step's pass
    assert manager.calls == 2

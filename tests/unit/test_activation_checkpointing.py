"""prepare(..., activation_checkpointing=): the same maths as a plain torch loop, less kept, names unchanged; and a
one-process FullyShardedStrategy that honours cpu_offload and precision (FSDP2 on a 1-rank mesh).

What a block keeps is measured as the memory a forward leaves allocated (torch's CPU profiler): checkpointing
hides a block's saved tensors behind its own ``saved_tensors_hooks``, so a hook outside sees neither what
``"block"`` drops nor what ``"selective"`` keeps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import towers
from towers.cluster.info import ProcessInfo
from towers.models_gpt import GPT, GPTConfig
from towers.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from towers.parallel.fsdp import fsdp_modules
from towers.strategies.fully_sharded import FullyShardedStrategy

MODES = ("block", "selective")


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32))


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)  # use_cache=True, as Hugging Face configs default to


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(getattr(model, "_orig_mod", model), GPT):  # nanoGPT's model(idx, targets) -> (logits, loss)
        return model(ids, ids)[1]
    return model(input_ids=ids, labels=ids).loss


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks) if isinstance(model, GPT) else list(model.model.layers)


def _step(model: nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer,
          user_model: nn.Module | None = None) -> tuple[torch.Tensor, dict]:
    """One update; return the loss and the gradients by the user's parameter names."""
    loss = _loss(model, ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in (user_model or model).named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_training_equals_the_plain_loop_and_keeps_every_name(make, mode):
    plain = make()
    model = copy.deepcopy(plain)
    ids = _tokens(64)
    want_loss, want_grads = _step(plain, ids, torch.optim.SGD(plain.parameters(), lr=0.1))  # no towers at all

    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    prepared, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           activation_checkpointing=mode)
    assert checkpointed_blocks(model) == _blocks(model)
    recomputed = []
    first_norm = next(m for m in _blocks(model)[0].modules() if "norm" in type(m).__name__.lower())
    first_norm.register_forward_hook(lambda *_: recomputed.append(torch.is_grad_enabled()))
    loss, grads = _step(prepared, ids, optimizer)

    assert len(recomputed) == 2  # the forward, then its recomputation in backward
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()  # no "_checkpoint_wrapped_module." in any name
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=0, msg=name)
    assert list(model.state_dict()) == list(plain.state_dict())
    for name, value in plain.state_dict().items():  # the same update: a checkpoint loads with the option on or off
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-6, atol=1e-7, msg=name)
    fresh = make()
    fresh.load_state_dict(model.state_dict())  # strict: every key the same
    with torch.no_grad():  # evaluation recomputes nothing (and keeps a Hugging Face model's cache)
        torch.testing.assert_close(_loss(model, ids), _loss(fresh, ids))


def _kept_after_forward(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes a training forward leaves allocated (what autograd and checkpointing keep for backward, and the loss)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = _loss(model, ids)
    kept = sum(event.self_cpu_memory_usage for event in prof.events())
    loss.backward()  # the recomputation runs, and nothing is left over
    return kept


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_block_keeps_less_than_selective_which_keeps_less_than_off(make):
    base = make()
    ids = _tokens(64)
    kept = {mode: _kept_after_forward(apply_activation_checkpointing(copy.deepcopy(base), mode), ids)
            for mode in ("off", "selective", "block")}
    assert 0 < kept["block"] < kept["selective"] < kept["off"], kept


def test_bad_values_and_models_without_blocks_are_refused_with_the_fix():
    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    with pytest.raises(towers.InvalidArgumentError, match=r"one of 'off', 'block', 'selective'\. Received: 'full'"):
        strategy.prepare(_gpt(), activation_checkpointing="full")
    with pytest.raises(towers.InvalidArgumentError, match=r"Received: True"):
        apply_activation_checkpointing(_gpt(), True)  # type: ignore[arg-type]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # layers, not blocks
    with pytest.raises(towers.InvalidArgumentError,
                       match=r"activation_checkpointing='block'.*Sequential has none.*nn\.ModuleList.*'off'"):
        strategy.prepare(mlp, activation_checkpointing="block")
    assert strategy.prepare(mlp, activation_checkpointing="off")[0] is mlp  # off: nothing needed, nothing changed


def test_trainer_passes_activation_checkpointing_to_prepare():
    model = _gpt()
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             strategy=towers.OneDeviceStrategy("cpu", info=ProcessInfo()),
                             activation_checkpointing="selective")
    assert checkpointed_blocks(model) == list(model.blocks)
    ids = _tokens(97)
    assert len(trainer.fit((ids, ids), epochs=1, global_batch_size=4)) == 1
    with pytest.raises(towers.InvalidArgumentError, match="Received: 'yes'"):
        towers.Trainer(_gpt(), None, strategy=towers.OneDeviceStrategy("cpu", info=ProcessInfo()),
                       activation_checkpointing="yes")


# --- one process, FullyShardedStrategy ------------------------------------------------------------------
@pytest.fixture
def one_process():
    """A FullyShardedStrategy per call; each leaves the process group it made (the next test starts without one)."""
    made: list[FullyShardedStrategy] = []

    def build(**options) -> FullyShardedStrategy:
        made.append(FullyShardedStrategy(info=ProcessInfo(), **options))
        return made[-1]

    yield build
    for strategy in made:
        strategy.shutdown()
    assert not dist.is_initialized()


def test_one_process_default_sharded_is_the_plain_module(one_process):
    model = _gpt()
    prepared, _ = one_process().prepare(model)
    assert prepared is model and fsdp_modules(model) == [] and not dist.is_initialized()
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_one_process_cpu_offload_shards_on_a_one_rank_mesh_with_the_plain_maths_and_checkpointing(one_process):
    plain = _gpt()
    model = copy.deepcopy(plain)
    ids = _tokens(97)
    want_loss, want_grads = _step(plain, ids, torch.optim.SGD(plain.parameters(), lr=0.1))
    strategy = one_process(cpu_offload=True)
    prepared, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           activation_checkpointing="block")
    assert tuple(strategy.mesh.shape) == (1,) and len(fsdp_modules(model)) == len(model.blocks) + 1
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
    assert checkpointed_blocks(model) == list(model.blocks)  # checkpointed before fully_shard; FSDP's hooks outside
    loss, grads = _step(prepared, ids, optimizer)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name].full_tensor(), grad, rtol=1e-6, atol=1e-8, msg=name)
    state = strategy.full_state_dict(prepared)
    assert list(state) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_one_process_bf16_computes_in_bf16_like_a_plain_bf16_copy(one_process):
    plain = _gpt()
    model = copy.deepcopy(plain)
    ids = _tokens(97)
    bf16 = copy.deepcopy(plain).to(torch.bfloat16)  # the plain torch loop under the same casting
    logits, loss = bf16(ids, ids)
    loss.float().backward()
    strategy = one_process(precision="bf16")
    prepared, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.dtype == torch.float32 and isinstance(p, DTensor) for p in model.parameters())  # float32 masters
    seen = []
    model.blocks[0].attn.qkv.register_forward_hook(
        lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    got_logits, got_loss = prepared(ids, ids)
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # MixedPrecisionPolicy: gathered and computed in bf16
    assert got_logits.dtype == got_loss.dtype == torch.float32  # and handed back in float32
    got_loss.backward()
    # The same bf16 operations in the same order: the same numbers (FSDP2 hands the bf16 gradients over in float32).
    assert torch.equal(got_logits, logits.float()) and torch.equal(got_loss, loss.float())
    for (name, p), q in zip(model.named_parameters(), bf16.parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad.float()), name


def test_selective_checkpointing_composes_with_compile():
    plain = _gpt()
    model = copy.deepcopy(plain)
    ids = _tokens(97)
    want_loss, want_grads = _step(plain, ids, torch.optim.SGD(plain.parameters(), lr=0.1))
    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    prepared, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           compile={"backend": "aot_eager"}, activation_checkpointing="selective")
    loss, grads = _step(prepared, ids, optimizer, model)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)

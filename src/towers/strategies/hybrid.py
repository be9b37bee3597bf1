"""``HybridStrategy``: dense layers all-reduced among the workers (Mirrored's maths), embedding tables on ps tasks.

The layout of ``ParameterServerStrategy`` (the last ``num_ps`` ranks are ps tasks), but the ps
tasks hold only the model's ``ShardedEmbedding`` rows. Every dense parameter lives on every
worker, its gradient is summed over the workers by DDP (on a process group of the workers
only) and the user's optimizer steps it locally, as under ``MirroredStrategy``. The prepared
optimizer's ``step()`` first pushes the touched rows' gradients to the ps tasks, whose row-wise
optimizers update them (``sync``: one update per round from every worker's rows; ``async``).

One script, one ``prepare``; ``Trainer.fit`` works unchanged. Checkpoints hold the dense state
(every worker has it) and the tables' touched rows with their optimizer slots (fetched from the
ps tasks by ``model.state_dict()``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from towers._logging import get_logger
from towers.parallel.fsdp import broadcast_from_first
from towers.parallel.parallelize import ParallelOptions, parallelize
from towers.process_group import DEFAULT_TIMEOUT_S
from towers.strategies._comm_hooks import sum_hook
from towers.strategies._ddp import TowersDDP, check_same_parameters
from towers.strategies.base import Strategy
from towers.strategies.parameter_server.bitwise import BitwisePushes
from towers.strategies.parameter_server.embeddings import SparseTables
from towers.strategies.parameter_server.strategy import ParameterServerStrategy
from towers.strategies.precision import MixedPrecisionModule
from towers.verify_capture import before_update

__all__ = ["HybridStrategy", "HybridOptimizer"]

log = get_logger(__name__)


class HybridOptimizer(torch.optim.Optimizer):
    """The user's optimizer for the dense parameters; ``step()`` first sends the embedding rows' gradients to the ps."""

    def __init__(self, optimizer: torch.optim.Optimizer, sparse: SparseTables | None,
                 finish_gradients: Callable[[], None] = lambda: None,
                 updates_now: Callable[[], bool] = lambda: True):
        self.optimizer = optimizer
        self._updates_now = updates_now  # False on a micro-batch before the step's last (bitwise=True): no step
        self._sparse = sparse
        self._finish_gradients = finish_gradients  # weighted losses: divide by the update's global weight
        super().__init__(optimizer.param_groups, optimizer.defaults)  # shares the user's group dicts
        self.state = optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Push the rows' gradients (the ps tasks update them), then step the dense parameters; return the loss."""
        if not self._updates_now():
            return None  # bitwise=True: the step's later micro-batches are still to come
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
        self._finish_gradients()
        if self._sparse is not None:
            self._sparse.push()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the dense gradients and the rows' gradients recorded since the last step."""
        self.optimizer.zero_grad(set_to_none)
        if self._sparse is not None:
            self._sparse.zero_grad()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The dense optimizer's state (the rows' optimizer slots travel in ``model.state_dict()``)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the dense optimizer's state."""
        self.optimizer.load_state_dict(state_dict)


class HybridStrategy(ParameterServerStrategy):
    """Dense parameters all-reduced among workers, ``ShardedEmbedding`` rows on ``num_ps`` ps tasks.

    Args:
        num_ps: as ``ParameterServerStrategy``.
        mode: the embedding updates: ``"sync"`` (default: the same maths as one device) or ``"async"``.
            The dense layers are always synchronous (all-reduced every step).
        staleness: as ``ParameterServerStrategy``.
        info: as ``ParameterServerStrategy``.
        timeout_s: as ``ParameterServerStrategy``.
        exit_on_ps: as ``ParameterServerStrategy``.
        precision: as ``ParameterServerStrategy``.

    Raises:
        ValueError: as ``ParameterServerStrategy``.
    """

    name = "hybrid"
    #: The dense all-reduce needs every worker, so a dead worker ends the job: the static split is kept.
    _dispatch_batches = False

    def __init__(self, num_ps: int | None = None, mode: str = "sync", staleness: int | None = None, *,
                 info: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S, exit_on_ps: bool = True,
                 precision: str | int | None = "32", bitwise: bool = False, micro_batch_size: int | None = None):
        self._workers_group: Any = None
        self._ddp: list[TowersDDP] = []
        super().__init__(num_ps, mode, staleness, info=info, timeout_s=timeout_s, exit_on_ps=exit_on_ps,
                         precision=precision, bitwise=bitwise, micro_batch_size=micro_batch_size)

    def _bitwise_steps(self, build: Callable[..., Any]) -> BitwisePushes:
        # the dense subtrees exchanged among the workers (Mirrored's tree); every worker steps its own optimizer
        return BitwisePushes(self, build, dense_group=self._workers_group, pushes=False)

    def _before_links(self) -> None:
        # Every rank of the job takes part in creating a group, ps tasks included (they serve afterwards).
        if self.roles.num_workers > 1:
            self._workers_group = dist.new_group(list(range(self.roles.num_workers)), backend="gloo",
                                                 use_local_synchronization=False)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False, activation_checkpointing: str = "off") -> tuple[nn.Module, Any]:
        """Connect the tables to the ps tasks, wrap the dense part in DDP over the workers; return (model, optimizer).

        Raises:
            ValueError: the workers' models differ, or tables without an optimizer.
            DistributedError: a ps task is gone or silent.
        """
        client = self._require_worker("prepare")
        generation = self._generations.of(model)  # a later model gets new tables on the ps tasks
        model = parallelize(model.to(self.device), None, ParallelOptions(activation_checkpointing=activation_checkpointing))
        sparse = self._bind_tables(model, optimizer, client, generation)
        self._generations.prepared(model)
        dense = [p for p in model.parameters() if p.requires_grad]
        prepared: nn.Module
        if self._bitwise is not None:  # no DDP: the tree sums the dense gradients; every worker starts from the chief's
            self._bitwise.refuse_tables(sparse is not None)
            if self._workers_group is not None:
                check_same_parameters(model, self.all_gather_object)
                broadcast_from_first(model, self._workers_group)
            self._bitwise.steps.watch(model)
            prepared = model
        elif self._workers_group is not None and dense:
            check_same_parameters(model, self.all_gather_object)
            ddp = TowersDDP(model, precision=self._precision, process_group=self._workers_group,
                            device_ids=[self.device.index] if self.device.type == "cuda" else None)
            ddp.register_comm_hook(self._workers_group, sum_hook)  # a sum: compute_average_loss already divides
            self._ddp.append(ddp)
            prepared = ddp
        else:
            prepared = MixedPrecisionModule(model, self._precision) if self._precision.enabled else model
        prepared = self._compile(prepared, compile)
        self._optimizer = optimizer
        self._prepared_any = True
        log.info("hybrid: %d dense parameter(s) all-reduced over %d worker(s), %d table(s) on %d ps task(s)",
                 len(dense), self.roles.num_workers, len(sparse) if sparse is not None else 0, self.num_ps)
        updates_now = (lambda: self._bitwise is None or self._bitwise.last)  # bitwise: after the last micro-batch only
        return prepared, (HybridOptimizer(optimizer, sparse, self._finish_loss_weights, updates_now)
                          if optimizer is not None else None)

    @property
    def _sums_replica_gradients(self) -> bool:
        return True  # the dense layers are all-reduced (summed) among the workers in either mode

    def _finish_loss_weights(self, when: str = "step") -> None:
        for ddp in self._ddp:  # a manual accumulation's gradients whole before a step or a clip reads them
            ddp.settle_gradients()
        super()._finish_loss_weights(when)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the dense gradients (all-reduced, the same on every worker) by their norm; the rows are not included."""
        return Strategy.clip_grad_norm_(self, parameters, max_norm, norm_type)  # the ps's refuses; the base clips

    def __repr__(self) -> str:
        role = f"ps task {self.roles.index}" if self.roles.is_ps else f"worker {self.roles.index}"
        return f"HybridStrategy({role}, {self.roles.num_workers} worker(s), {self.num_ps} ps, mode={self.mode!r})"

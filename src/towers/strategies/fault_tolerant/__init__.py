"""FaultTolerantStrategy: replicated data parallelism over replica groups that survives a lost group (torchft).

Processes form *replica groups* (by default one process each). The groups agree on a quorum
before every step through torchft's lighthouse; a group that dies drops out of the next quorum
and the others go on without a restart; a restarted group joins a later quorum, fetches the
model and optimizer state from a live peer ("heals") and trains on. torchft does the quorum,
the reconfigurable Gloo process group, the per-step commit vote and the state transfer; this
package puts the towers API on top:

* ``prepare`` sums the gradients over the live groups at the end of each backward pass, in one
  all-reduce (``grads.py``; SUMMED: every replica's loss is already divided by the global batch,
  ``compute_average_loss``), and wraps the
  optimizer in a wrapper that steps only when torchft's ``should_commit`` says the step's
  all-reduce succeeded everywhere.
* ``distribute_dataset`` hands out global batch ``s`` of the data for committed step ``s``,
  split over the groups of *that step's* quorum: after a loss the survivors take the lost
  group's share. A step that was in flight when a group died does not commit; the next step
  retries the same global batch over the survivors (counted in ``steps_not_committed`` and
  logged), so no example is lost. A group lost after its share entered a step's all-reduce is in
  that step's update, which the survivors commit; each group's ledger lines name the other groups'
  shares of the step too (``BatchInfo.peer_rows``), so the lost share is proved trained. A healed
  group continues at the live peers' step. A group started again after the job's training ended
  finds the job complete and exits 0 (``towers.launch.job_end``).
* ``reduce``/``gather``/``barrier``/object exchange run over the live groups (torchft's
  process group of the current quorum).

A group is one process, or several on one node (``group_size``): replicating the model (gradients
summed inside the group, then across groups) or sharding it with FSDP2 (``shard=True``).

The knob is ``peer_timeout_s`` (default 3 s): how long a collective waits for a peer before the
step is given up, and (``start_lighthouse(peer_timeout_s=...)``) how long the lighthouse waits
for a silent group before forming a quorum without it. torchft is an optional extra:
``pip install 'towers[ft]'``.

The modules: ``strategy.py`` (``FaultTolerantStrategy``: options, ``prepare``; it holds the next two),
``steps.py`` (``QuorumSteps``: the group's torchft manager, each step's quorum and commit vote),
``collectives.py`` (``LiveGroupCollectives``: collectives over the live groups),
``batches.py`` (``FaultTolerantBatches``, the input), ``optimizer.py`` (the optimizer that steps
on a committed step), ``groups.py`` (a process's replica group, its own process group, torchft's
quorum client), ``store.py`` (where a group listens), ``grads.py`` (the gradient all-reduce),
``transport.py`` (the healing state on the wire), ``shards.py`` (a sharded group's state) and
``agreement.py`` (a collective every replica must call, ``Metric.result()``, agreed across the groups).
"""

from towers.launch.lighthouse import DEFAULT_PEER_TIMEOUT_S, Lighthouse, start_lighthouse
from towers.strategies.fault_tolerant.batches import FaultTolerantBatches
from towers.strategies.fault_tolerant.strategy import FaultTolerantStrategy

__all__ = ["FaultTolerantStrategy", "FaultTolerantBatches", "Lighthouse", "start_lighthouse", "DEFAULT_PEER_TIMEOUT_S"]

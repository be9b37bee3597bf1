"""Parameter-server training: ps tasks hold the parameters, workers push gradients and pull values.

``strategy.py`` (the Strategy), ``roles.py`` (who is ps), ``sharding.py`` (which ps holds what),
``server.py``/``requests.py``/``gather.py`` (a ps task), ``client.py``/``worker.py``/``optimizer.py``/
``comm.py`` (a worker), ``transport.py`` (the only module that talks to the wire: Gloo point-to-point)
and ``wire.py`` (what may cross it: JSON and raw tensors, never a pickle). Sparse tables:
``embeddings.py`` (``ShardedEmbedding``, a worker's side), ``tables.py`` (row shards, row-wise
optimizers), ``sparse_server.py`` (a ps task's side).
"""

from towers.strategies.parameter_server.embeddings import ShardedEmbedding
from towers.strategies.parameter_server.optimizer import ParameterServerOptimizer
from towers.strategies.parameter_server.strategy import MODES, ParameterServerStrategy

__all__ = ["ParameterServerStrategy", "ParameterServerOptimizer", "ShardedEmbedding", "MODES"]

"""Parameter-server training: ps tasks hold the parameters, workers push gradients and pull values.

``strategy.py`` (the Strategy), ``roles.py`` (who is ps), ``sharding.py`` (which ps holds what),
``server.py``/``requests.py``/``gather.py`` (a ps task), ``client.py``/``worker.py``/``optimizer.py``/
``comm.py`` (a worker), ``transport.py`` (the only module that talks to the wire: Gloo point-to-point).
"""

from towers.strategies.parameter_server.optimizer import ParameterServerOptimizer
from towers.strategies.parameter_server.strategy import MODES, ParameterServerStrategy

__all__ = ["ParameterServerStrategy", "ParameterServerOptimizer", "MODES"]

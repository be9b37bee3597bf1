"""Public path ``towers.ray``: Ray Train's ``TorchTrainer`` running a towers script (``towers.integrations.ray_train``).

Importing it needs no Ray; each function imports Ray when called and, without it, names the extra to install
(``pip install 'towers[ray]'``).
"""

from towers.integrations.ray_train import *  # noqa: F401,F403
from towers.integrations.ray_train import __all__ as __all__

"""Callbacks with Keras's hooks: ``towers.callbacks.EarlyStopping(...)`` and friends.

See ``towers.training.callbacks.base`` for the documented ``logs`` keys of each hook.
"""

from towers.training.callbacks.base import Callback, CallbackList
from towers.training.callbacks.breakdown import StepBreakdown
from towers.training.callbacks.checkpointing import BackupAndRestore, ModelCheckpoint
from towers.training.callbacks.ledger import ExampleLedger
from towers.training.callbacks.loggers import CSVLogger, TensorBoard
from towers.training.callbacks.mlflow_logger import MLflowLogger
from towers.training.callbacks.progress import ProgressBar
from towers.training.callbacks.schedule import LearningRateScheduler
from towers.training.callbacks.stopping import EarlyStopping, TerminateOnNaN
from towers.training.callbacks.wandb_logger import WandbLogger

__all__ = [
    "Callback", "CallbackList", "History", "ProgressBar", "ModelCheckpoint", "BackupAndRestore",
    "EarlyStopping", "CSVLogger", "TensorBoard", "TerminateOnNaN", "LearningRateScheduler",
    "WandbLogger", "MLflowLogger", "ExampleLedger", "StepBreakdown",
]


def __getattr__(name: str):
    # History lives in towers.training.history, which imports this package's base module.
    if name == "History":
        from towers.training.history import History

        return History
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

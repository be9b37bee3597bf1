"""``towers.callbacks``: the Trainer's callbacks, importable as the docs write them (``from towers.callbacks import X``).

The classes live in ``towers.training.callbacks``; this module is the public path to them.
"""

from towers.training.callbacks import (
    BackupAndRestore,
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    ExampleLedger,
    LearningRateScheduler,
    MLflowLogger,
    ModelCheckpoint,
    ProgressBar,
    StepBreakdown,
    TensorBoard,
    TerminateOnNaN,
    WandbLogger,
)
from towers.training.history import History

__all__ = [
    "Callback", "CallbackList", "History", "ProgressBar", "ModelCheckpoint", "BackupAndRestore",
    "EarlyStopping", "CSVLogger", "TensorBoard", "TerminateOnNaN", "LearningRateScheduler",
    "WandbLogger", "MLflowLogger", "ExampleLedger", "StepBreakdown",
]

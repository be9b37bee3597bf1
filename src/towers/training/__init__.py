"""Keras-style training on top of any strategy: ``Trainer``, ``History``, metrics and callbacks."""

from towers.training.history import History
from towers.training.trainer import Trainer

__all__ = ["Trainer", "History"]

"""Placeholder: being written."""

from towers.strategies.base import Strategy


class MirroredStrategy(Strategy):  # placeholder until implemented
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("MirroredStrategy is not implemented yet")


class MultiWorkerMirroredStrategy(Strategy):  # placeholder until implemented
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("MultiWorkerMirroredStrategy is not implemented yet")

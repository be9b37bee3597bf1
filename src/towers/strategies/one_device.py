"""Placeholder: being written."""

from towers.strategies.base import Strategy


class OneDeviceStrategy(Strategy):  # placeholder until implemented
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("OneDeviceStrategy is not implemented yet")

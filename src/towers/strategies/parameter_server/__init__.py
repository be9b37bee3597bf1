"""Placeholder: being written."""

from towers.strategies.base import Strategy


class ParameterServerStrategy(Strategy):  # placeholder until implemented
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("ParameterServerStrategy is not implemented yet")

"""N-D parallelism: the job's layout and its one device mesh, and how a model is parallelized on it.

``Layout`` holds the degrees (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``) and builds the one
``DeviceMesh`` of a process with a named sub-mesh for each use (``towers.parallel.layout``).
This package knows neither the strategies nor the models: a strategy holds a layout, a model
declares its own plans.
"""

from towers.parallel.layout import MESH_ORDER, Layout, LayoutMesh

__all__ = ["Layout", "LayoutMesh", "MESH_ORDER"]

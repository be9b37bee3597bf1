"""Where a job runs besides ``towers launch``: engines that start the processes themselves.

``ray_train.py``: an unchanged towers script inside Ray Train's ``TorchTrainer`` (public path ``towers.ray``).
Nothing here is imported by the rest of towers; each module imports its engine only when used.
"""

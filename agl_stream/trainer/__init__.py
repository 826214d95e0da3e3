"""The seed's ``Trainer``: runs an algorithm with an agent in runner processes over the pipeline.

Not the ``trainer`` role (``consumers/trainer.py``, ``agl-stream trainer``), which updates a
policy from training batches: this Trainer orchestrates roles, an algorithm may ask it for
that one among others (:meth:`agl_stream.algorithm.Algorithm.roles`).
"""

from agl_stream.trainer.progress import FitResult
from agl_stream.trainer.run_store import RunStore
from agl_stream.trainer.trainer import Trainer

__all__ = ["FitResult", "RunStore", "Trainer"]

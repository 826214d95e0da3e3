"""The algorithm layer: what decides which rollouts run and learns from them.

``Algorithm`` (the base), ``@algo`` (an algorithm as a function over the store), the built-ins
by name (``ALGORITHMS``: ``Baseline``), and the datasets they run (:mod:`.datasets`). The
Trainer (:mod:`agl_stream.trainer`) drives an algorithm; an algorithm never drives the Trainer.
"""

from agl_stream.algorithm.base import Algorithm, FastAlgorithm, MissingComponentError, RoleSpec, RunnerResources
from agl_stream.algorithm.baseline import Baseline
from agl_stream.algorithm.blocking import BlockingStore
from agl_stream.algorithm.datasets import TaskDataset, epoch_orders, load_dataset
from agl_stream.algorithm.decorator import FunctionalAlgorithm, algo
from agl_stream.algorithm.registry import ALGORITHMS, make_algorithm, register_algorithm
from agl_stream.algorithm.report import ModeReport, rewards_by_mode

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Baseline",
    "BlockingStore",
    "FastAlgorithm",
    "FunctionalAlgorithm",
    "MissingComponentError",
    "ModeReport",
    "RoleSpec",
    "RunnerResources",
    "TaskDataset",
    "algo",
    "epoch_orders",
    "load_dataset",
    "make_algorithm",
    "register_algorithm",
    "rewards_by_mode",
]

"""The algorithm layer: what decides which rollouts run and learns from them.

``Algorithm`` (the base), ``@algo`` (an algorithm as a function over the store), the built-ins
by name (``ALGORITHMS``: ``Baseline``; ``VERL``, also as "grpo"; ``APO``), and the datasets they run
(:mod:`.datasets`). The
Trainer (:mod:`agl_stream.trainer`) drives an algorithm; an algorithm never drives the Trainer.
"""

from agl_stream.algorithm.apo import APO, ModelEndpointError, PromptScore
from agl_stream.algorithm.base import Algorithm, FastAlgorithm, MissingComponentError, RoleSpec, RunnerResources
from agl_stream.algorithm.baseline import Baseline
from agl_stream.algorithm.blocking import BlockingStore
from agl_stream.algorithm.datasets import TaskDataset, epoch_orders, load_dataset
from agl_stream.algorithm.decorator import FunctionalAlgorithm, algo
from agl_stream.algorithm.registry import ALGORITHMS, make_algorithm, register_algorithm
from agl_stream.algorithm.report import ModeReport, rewards_by_mode
from agl_stream.algorithm.verl import VERL, Validation
from agl_stream.algorithm.verl_config import VerlConfig, parse_verl_config

__all__ = [
    "ALGORITHMS",
    "APO",
    "VERL",
    "Algorithm",
    "Baseline",
    "BlockingStore",
    "FastAlgorithm",
    "FunctionalAlgorithm",
    "MissingComponentError",
    "ModeReport",
    "ModelEndpointError",
    "PromptScore",
    "RoleSpec",
    "RunnerResources",
    "TaskDataset",
    "Validation",
    "VerlConfig",
    "algo",
    "epoch_orders",
    "load_dataset",
    "make_algorithm",
    "parse_verl_config",
    "register_algorithm",
    "rewards_by_mode",
]

"""Training core: triplet batches as VERL DataProtos, and policy backends that train on them.

Importing this package imports torch and VERL (a few seconds).
"""

from agl_stream.training.backend import (
    CRITIC_FREE_ESTIMATORS,
    TRAINER_STATE_FILE,
    PolicyBackend,
    TorchBackendOptions,
    TorchPolicyBackend,
)
from agl_stream.training.data import InvalidBatchError, RewardMode, batch_to_dataproto

__all__ = [
    "CRITIC_FREE_ESTIMATORS",
    "TRAINER_STATE_FILE",
    "InvalidBatchError",
    "PolicyBackend",
    "RewardMode",
    "TorchBackendOptions",
    "TorchPolicyBackend",
    "batch_to_dataproto",
]

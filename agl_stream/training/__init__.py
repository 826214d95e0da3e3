"""Training core: triplet batches as VERL DataProtos, and policy backends that train on them.

Importing this package imports torch and VERL (a few seconds); the ``verl`` backend
(``agl_stream.training.verl_backend``, VERL's FSDP engine) is imported only when used.
"""

from agl_stream.rl_options import CRITIC_FREE_ESTIMATORS
from agl_stream.training.backend import TRAINER_STATE_FILE, PolicyBackend
from agl_stream.training.data import InvalidBatchError, RewardMode, batch_to_dataproto
from agl_stream.training.factory import BackendKind, open_backend
from agl_stream.training.torch_backend import TorchBackendOptions, TorchPolicyBackend

__all__ = [
    "CRITIC_FREE_ESTIMATORS",
    "TRAINER_STATE_FILE",
    "BackendKind",
    "InvalidBatchError",
    "PolicyBackend",
    "RewardMode",
    "TorchBackendOptions",
    "TorchPolicyBackend",
    "batch_to_dataproto",
    "open_backend",
]

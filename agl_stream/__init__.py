"""agl-stream: Agent Lightning as an event-sourced pipeline over Apache Kafka."""

__version__ = "0.1.0"

from agl_stream.store.client import AglStore, connect
from agl_stream.store.types import UNSET, AttemptedRollout

__all__ = ["UNSET", "AglStore", "AttemptedRollout", "connect"]

"""Typed errors. Every error a caller can act on says what to do about it."""

from __future__ import annotations


class AglError(Exception):
    """Base class of every error agl-stream raises on purpose."""


class ConfigError(AglError):
    """A setting is missing or invalid."""


class PrerequisiteError(AglError):
    """A tool the local stack needs (Java, Maven) is missing or too old."""


class BrokerError(AglError):
    """The local Kafka broker could not be started, reached or stopped."""


class CodecError(AglError):
    """Bytes could not be decoded into a known record, or a record could not be encoded."""


class NotSingleObjectEncodedError(CodecError):
    """The bytes do not start with the Avro single-object marker (C3 01)."""


class UnknownFingerprintError(CodecError):
    """The writer schema's fingerprint is not in the schema registry."""

    def __init__(self, fingerprint: int) -> None:
        self.fingerprint = fingerprint
        super().__init__(
            f"unknown writer schema fingerprint {fingerprint:#018x}: the producer used a schema "
            "this reader does not know; upgrade agl-stream or add the schema to schemas/history"
        )


class MalformedRecordError(CodecError):
    """The body is truncated or is not valid Avro for its writer schema."""


class RecordTypeError(CodecError):
    """The record decoded fine but is not of the type the caller expected."""


class SchemaCompatibilityError(AglError):
    """A schema change would break readers or writers of existing data."""


class TopicError(AglError):
    """Topic declarations are invalid, or the cluster disagrees with them."""


class ReadSideError(AglError):
    """A read through the gateway or ClickHouse failed."""


class FenceTimeoutError(ReadSideError):
    """The sinks did not apply the fenced offsets in time: the written records are not readable yet."""


class QueryError(ReadSideError):
    """ClickHouse refused or failed the query (bad SQL, a write on the read-only path, a time limit)."""

    def __init__(self, message: str, *, code: int | None = None, name: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.name = name


class GatewayUnavailableError(ReadSideError):
    """No gateway answers where one was expected; start the stack with `agl-stream up`."""


class DatasetError(AglError, ValueError):
    """A dataset cannot be read, or holds a task that is not JSON (tasks travel as JSON)."""


class AlgorithmError(AglError, TypeError):
    """Not an algorithm (or not one this call accepts), or an unknown algorithm name."""


class TrainerError(AglError):
    """A training run cannot go on: a runner exited, the agent cannot reach the runner processes,
    or ``fit`` was called where it cannot run (inside a running event loop)."""


class AlgorithmConfigError(ConfigError, ValueError):
    """An algorithm's config holds keys it cannot use: keys that do not apply here (with why),
    unknown keys, or bad values. ``problems`` maps each such key (dotted) to what is wrong; the
    message lists them all, so one run shows every key to fix."""

    def __init__(self, algorithm: str, problems: dict[str, str]) -> None:
        self.algorithm = algorithm
        self.problems = dict(problems)
        lines = "\n".join(f"  {key}: {why}" for key, why in sorted(self.problems.items()))
        super().__init__(f"{algorithm} config: {len(self.problems)} key(s) cannot be used:\n{lines}")

"""The local stack: the processes ``agl-stream up`` starts on one machine and how they are run.

``stack`` (up, down, status of a stack under a data dir), ``supervisor`` (restarts a role that
exits), ``processes`` (start and stop a role, and a role's own half of a stop), ``monitor``
(``agl-stream status``). The local Kafka broker is ``agl_stream.kafka.broker``.
"""

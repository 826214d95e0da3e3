"""``agl-stream ingress``: task requests from external systems (agl.task-requests) -> rollouts.

The role lives in ``processors.ingress``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
The rules are agl_stream/domain/ingress.py.
"""

from __future__ import annotations

import typer

from agl_stream.cli.context import settings_of


def ingress(ctx: typer.Context) -> None:
    """Run the ingress processor until SIGTERM or Ctrl-C.

    Validates every TaskRequest on agl.task-requests (schema, sizes, mode, config, resources id)
    and enqueues it as rollout ro-<first 32 hex of sha256(request_id)>, answers a copy of a
    request already enqueued (counted, not dead-lettered), or sends it to agl.dlq with the
    reason (a request id reused with another input included). `agl-stream up` starts one; run
    more to share the partitions.
    Limits: --set ingress_max_input_bytes=N, --set ingress_max_metadata_bytes=N.
    """
    from agl_stream import metrics
    from agl_stream.local.stack import local_stack_settings
    from processors import ingress

    settings = local_stack_settings(settings_of(ctx))
    with metrics.expose(settings, "ingress"):
        ingress.main(settings)

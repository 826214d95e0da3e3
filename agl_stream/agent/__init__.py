"""The agent-facing API: what an agent's code and its runner use.

``litagent`` (LitAgent and the rollout context), ``emitters`` (rewards, messages, annotations as
spans), ``command_agent`` (an agent that is any command), ``tracing`` (the tracer that turns an
agent's OpenTelemetry spans into the store's). The names users import are re-exported by
``agl_stream`` itself.
"""

"""Producers: roles that bring records into the log from outside it.

- ``llm_proxy``: the OpenAI-compatible LLM proxy (one span per call; Agent Lightning 1.0's
  server protocol beside it).
- ``replay``: historical spans -> triplet records for offline RL.
- ``synthetic_spans``: spans shaped like an agent's LLM calls (the smoke demo, tests, benchmarks).
"""

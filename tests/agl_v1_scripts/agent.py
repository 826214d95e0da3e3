"""An Agent Lightning 1.0 agent, as 1.0's examples write one: a class with ``run()``, started by
1.0's controller in a process of its own with ``AGL_OPENAI_BASE_URL``, ``AGL_EVENT_URL`` and
``AGL_KEY``. It asks the model (the openai client) and posts its reward as an event. Runs under
Agent Lightning 1.0.2's Python (tests/seed_venv.py), never under agl-stream's."""

from __future__ import annotations

import os

import httpx
from openai import OpenAI


class Agent:
    def run(self) -> None:
        if os.environ.get("FAIL") == "true":
            raise RuntimeError("this task fails on purpose")
        client = OpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ["AGL_KEY"])
        question = os.environ["QUESTION"]
        answer = client.chat.completions.create(
            model="whatever-the-agent-names", messages=[{"role": "user", "content": question}]
        )
        text = answer.choices[0].message.content or ""
        reward = 1.0 if text.strip() == os.environ["EXPECTED"] else 0.0
        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}
        event = {"event_type": "reward", "data": {"value": reward, "source": "exact-match"}}
        httpx.post(os.environ["AGL_EVENT_URL"], json=event, headers=headers, timeout=60).raise_for_status()

"""A Python agent that knows nothing of agl-stream: the openai client as any program uses it
(OPENAI_BASE_URL and OPENAI_API_KEY from the environment), the task from $AGL_TASK_FILE, the
reward written to $AGL_REWARD_FILE: the answer's length / 10."""

import json
import os

from openai import OpenAI

task = json.loads(open(os.environ["AGL_TASK_FILE"]).read())
client = OpenAI()
completion = client.chat.completions.create(
    model=os.environ["AGL_MODEL"], messages=[{"role": "user", "content": task["question"]}], max_tokens=8
)
answer = completion.choices[0].message.content or ""
print("the model said", repr(answer))
with open(os.environ["AGL_REWARD_FILE"], "w") as reward:
    json.dump({"reward": len(answer) / 10}, reward)

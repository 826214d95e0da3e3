#!/bin/sh
# A shell agent: one chat call with curl to $OPENAI_BASE_URL, the task's question taken from
# $AGL_TASK_FILE with sed; the reward (0.5 for an answer with a message, else 0) as the last line.
# The attempt's trace context ($TRACEPARENT) goes on the call, so its span joins the attempt's trace.
set -eu
question=$(sed -n 's/.*"question": *"\([^"]*\)".*/\1/p' "$AGL_TASK_FILE")
body=$(printf '{"model": "%s", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 8}' "$AGL_MODEL" "$question")
answer=$(curl -sS --fail-with-body -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -H "traceparent: ${TRACEPARENT:-}" -d "$body" "$OPENAI_BASE_URL/chat/completions")
echo "the model said: $answer" >&2
case "$answer" in
  *'"message"'*) echo '{"reward": 0.5}' ;;
  *) echo '{"reward": 0}' ;;
esac

// A Node.js agent that knows nothing of agl-stream: it reads the task file, asks the model once
// with the official openai package (OPENAI_BASE_URL and OPENAI_API_KEY, as for any OpenAI
// endpoint), and prints its reward as the last line: the answer's length / 10. The call carries
// the trace context it was given ($TRACEPARENT), so its span joins the caller's trace.
import { readFileSync } from "node:fs";
import OpenAI from "openai";

const task = JSON.parse(readFileSync(process.env.AGL_TASK_FILE, "utf8"));
const traceparent = process.env.TRACEPARENT;
const client = new OpenAI({ defaultHeaders: traceparent ? { traceparent } : {} }); // OPENAI_BASE_URL, OPENAI_API_KEY
const completion = await client.chat.completions.create({
  model: process.env.AGL_MODEL,
  messages: [{ role: "user", content: task.question }],
  max_tokens: 8,
});
const answer = completion.choices[0].message.content ?? "";
console.log(`the model said ${JSON.stringify(answer)}`);
console.log(JSON.stringify({ reward: answer.length / 10 }));

// The dashboard's pages. Routing is the URL's hash (#/page?query), so a page is a link and the
// browser's back button works; "live" reloads the current page's data every few seconds.
import { api, ApiError, download, duration, fmt, h, pretty, span, status, table, time } from "./util.js";
import { lineChart, unitAxes } from "./charts.js";
import { deadLetters } from "./dlq.js";

const main = document.getElementById("main");
const errorBox = document.getElementById("error");
const POLL_MS = 5000;
let timer = null;
let generation = 0; // a response for a page the visitor left is dropped

function showError(e) {
  errorBox.hidden = false;
  errorBox.textContent = e instanceof ApiError ? `${e.kind}: ${e.message}` : `error: ${e.message || e}`;
}

function clearError() {
  errorBox.hidden = true;
  errorBox.textContent = "";
}

function route() {
  const [path, query] = (location.hash.slice(1) || "/overview").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { page: parts[0] || "overview", args: parts.slice(1), params: new URLSearchParams(query || "") };
}

function go(page, params = {}, args = []) {
  const query = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null)).toString();
  location.hash = `#/${[page, ...args].map(encodeURIComponent).join("/")}${query ? `?${query}` : ""}`;
}

// -- Overview -------------------------------------------------------------------------------

async function overview(view, { params }) {
  const window_ = params.get("window") || "600";
  // The backlog comes from Kafka: when it cannot be read, the rest of the page still shows.
  const [data, backlog] = await Promise.all([
    api(`/v1/dashboard/overview?window=${encodeURIComponent(window_)}`),
    api("/v1/dashboard/backlog").catch((e) => e),
  ]);
  const t = data.totals;
  const card = (label, value, testid) => h("div", { class: "card" }, h("div", { class: "muted" }, label),
    h("div", { class: "v", "data-testid": testid }, fmt(value)));
  const statuses = Object.entries(data.status).map(([s, n]) => ({ status: s, rollouts: n }));
  const charts = h("div", { class: "grid" });
  view.replaceChildren(
    h("div", { class: "cards" },
      card("rollouts", t.rollouts, "total-rollouts"), card("spans", t.spans, "total-spans"),
      card("triplets", t.triplets, "total-triplets"), card("live policy version", data.policy_version, "policy-version")),
    h("h2", {}, "Rollouts by status"),
    table(statuses, [["status", "status", status], ["rollouts", "rollouts"]], { testid: "status-table" }),
    h("h2", {}, `Throughput (per second, ${data.bucket_s} s buckets over the last ${data.window} s of data)`),
    charts,
    h("h2", {}, "Backlog per consumer (records not yet processed)"),
    backlog instanceof Error
      ? h("p", { class: "muted", "data-testid": "backlog-error" }, backlog.message)
      : table(backlog, [["consumer", "consumer group or sink"], ["topic", "topic"], ["applied", "done"],
        ["end", "log end"], ["lag", "behind"]], { testid: "backlog-table" }),
    h("h2", {}, "Mean reward per policy version"),
    rewardsView(data.rewards),
    h("h2", {}, "Trainer steps"),
    stepsView(data.steps),
  );
  // All three boxes first, then the charts: each measures its box, and the grid sizes a box
  // by how many there are.
  const rates = [["rollouts", "rollouts/s"], ["spans", "spans/s"], ["triplets", "triplets/s"]];
  const boxes = rates.map(([name]) => h("div", { class: "panel", "data-testid": `chart-${name}` }));
  charts.append(...boxes);
  rates.forEach(([name, label], i) => lineChart(boxes[i], label, data.rates[name], [label]));
}

function rewardsView(rewards) {
  // Train and validation are separate series over the policy versions (-1: no published version).
  const versions = [...new Set(rewards.map((r) => r.policy_version ?? -1))].sort((a, b) => a - b);
  const modes = [...new Set(rewards.map((r) => r.mode || "(none)"))].sort();
  const value = (mode, v) => {
    const row = rewards.find((r) => (r.mode || "(none)") === mode && (r.policy_version ?? -1) === v);
    return row && typeof row.mean_reward === "number" ? row.mean_reward : null;
  };
  const box = h("div", { class: "panel" });
  const wrap = h("div", { class: "grid" }, box, h("div", {}, table(rewards, [
    ["mode", "mode"], ["policy_version", "policy version"], ["attempts", "attempts"], ["rewarded", "rewarded"],
    ["mean_reward", "mean reward"]], { testid: "rewards-table" })));
  queueMicrotask(() => lineChart(box, "mean reward by policy version (-1: none published)",
    [versions, ...modes.map((m) => versions.map((v) => value(m, v)))], modes, { xTime: false, xLabel: "policy version" }));
  return wrap;
}

function stepsView(steps) {
  if (!steps.length) return h("p", { class: "muted", "data-testid": "steps-empty" }, "no trainer steps yet");
  const xs = steps.map((s) => s.step_time);
  const a = h("div", { class: "panel" });
  const b = h("div", { class: "panel" });
  queueMicrotask(() => {
    lineChart(a, "loss and reward", [xs, steps.map((s) => s.loss), steps.map((s) => s.reward)], ["loss", "reward"]);
    lineChart(b, "staleness and idle fraction", [xs, steps.map((s) => s.staleness), steps.map((s) => s.idle_fraction)],
      ["staleness", "idle fraction"]);
  });
  const last = steps.slice(-10).reverse();
  return h("div", {}, h("div", { class: "grid" }, a, b), table(last, [
    ["policy_version", "version", versionLink], ["step_time", "time", time], ["samples", "samples"], ["tokens", "tokens"],
    ["loss", "loss"], ["reward", "reward"], ["staleness", "staleness"], ["idle_fraction", "idle fraction"]],
  { testid: "steps-table" }));
}

// -- One policy version: what trained it ---------------------------------------------------------

function versionLink(v) {
  return v == null ? "—" : h("a", { href: `#/version/${encodeURIComponent(v)}` }, String(v));
}

function rolloutLink(v) {
  return h("a", { href: `#/rollout/${encodeURIComponent(v)}` }, v);
}

async function version(view, { args }) {
  const v = args[0] || "";
  const form = h("form", { class: "filters", "data-testid": "version-form" },
    h("label", {}, "policy version", h("input", { name: "version", value: v, size: 8, placeholder: "e.g. 3" })),
    h("button", { class: "primary", type: "submit" }, "show"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    go("version", {}, [new FormData(form).get("version")]);
  });
  if (!v) {
    view.replaceChildren(form, h("p", { class: "muted" }, "which traces trained a policy version: pick one"));
    return;
  }
  view.replaceChildren(form, h("p", { class: "muted" }, "loading ..."));
  let data;
  try {
    data = await api(`/v1/dashboard/versions/${encodeURIComponent(v)}`);
  } catch (e) {
    view.replaceChildren(form);
    view.dataset.partial = "1";
    throw e;
  }
  const spans = data.attempts.reduce((n, a) => n + a.spans, 0);
  const samples = data.attempts.reduce((n, a) => n + a.samples, 0);
  const rollouts = new Set(data.attempts.map((a) => a.rollout_id)).size;
  const traces = new Set(data.spans.map((s) => s.trace_id).filter(Boolean));
  const card = (label, value, testid) => h("div", { class: "card" }, h("div", { class: "muted" }, label),
    h("div", { class: "v", "data-testid": testid }, fmt(value)));
  view.replaceChildren(form,
    h("h2", {}, "Policy version ", h("code", { "data-testid": "version" }, String(data.policy_version)),
      ": what trained it"),
    h("div", { class: "cards" },
      card("batches", data.batches.length, "version-batches"), card("rollouts", rollouts, "version-rollouts"),
      card("samples", samples, "version-samples"), card("LLM-call spans", spans, "version-spans"),
      card("traces", data.cut ? `${traces.size}+` : traces.size, "version-traces")),
    h("h2", {}, `Trainer steps (${data.steps.length})`),
    table(data.steps, [["batch_id", "batch"], ["step_time", "time", time], ["samples", "samples"], ["tokens", "tokens"],
      ["staleness", "staleness"], ["loss", "loss"], ["reward", "reward"]], { testid: "version-steps" }),
    h("h2", {}, `Batches (${data.batches.length})`),
    table(data.batches, [["batch_id", "batch"], ["created_time", "made", time], ["n_records", "attempts"],
      ["n_triplets", "samples"], ["n_tokens", "tokens"], ["min_policy_version", "oldest version"],
      ["max_policy_version", "newest version"], ["mean_final_reward", "mean reward"]], { testid: "version-batches-table" }),
    h("h2", {}, `Rollouts and attempts (${data.attempts.length})`),
    table(data.attempts, [["rollout_id", "rollout", rolloutLink], ["attempt_id", "attempt"], ["batch_id", "batch"],
      ["served_version", "served by version", versionLink], ["samples", "samples"], ["spans", "spans"],
      ["response_tokens", "response tokens"], ["final_reward", "final reward"]], { testid: "version-attempts" }),
    h("h2", {}, `Spans, one per LLM call of each sample (${data.spans.length}${data.cut ? ", cut" : ""})`),
    table(data.spans, [["batch_id", "batch"], ["sample_index", "sample"], ["call_index", "call"],
      ["rollout_id", "rollout", rolloutLink], ["span_id", "span",
        (s, r) => h("a", { href: `#/rollout/${encodeURIComponent(r.rollout_id)}?attempt=${encodeURIComponent(r.attempt_id)}&span=${encodeURIComponent(s)}` }, s)],
      ["trace_id", "trace"]], { testid: "version-spans-table" }),
    h("details", { class: "panel" }, h("summary", {}, "the SQL (docs/sql.md, \"Traces that trained a policy version\")"),
      h("pre", { "data-testid": "version-sql" }, data.query)),
  );
}

// -- Rollouts ---------------------------------------------------------------------------------

const FILTERS = ["status", "mode", "policy_version", "group_id", "since", "until"];
const SORTABLE = ["rollout_id", "status", "mode", "policy_version", "group_id", "start_time", "took", "reward"];
const STATUSES = ["", "queuing", "preparing", "running", "succeeded", "failed", "cancelled", "requeuing"];

function toLocalInput(seconds) {
  if (!seconds) return "";
  const d = new Date(Number(seconds) * 1000);
  return new Date(d.getTime() - d.getTimezoneOffset() * 60000).toISOString().slice(0, 19);
}

async function rollouts(view, { params }) {
  const query = new URLSearchParams();
  for (const key of [...FILTERS, "limit", "offset", "sort", "order"]) if (params.get(key)) query.set(key, params.get(key));
  const form = filtersForm(params);
  view.replaceChildren(form, h("p", { class: "muted" }, "loading ..."));
  let data;
  try {
    data = await api(`/v1/dashboard/rollouts?${query}`);
  } catch (e) {
    // A bad filter: keep the form (with what was typed) so it can be corrected.
    view.replaceChildren(form);
    view.dataset.partial = "1";
    throw e;
  }
  const offset = data.offset;
  const pageParams = Object.fromEntries(params);
  const pager = h("div", { class: "pager" },
    h("button", { disabled: offset === 0, onclick: () => go("rollouts", { ...pageParams, offset: Math.max(0, offset - data.limit) }) }, "‹ newer"),
    h("span", { "data-testid": "rollouts-range" },
      `${data.total ? offset + 1 : 0}-${offset + data.rows.length} of ${data.total.toLocaleString("en-US")}`),
    h("button", { disabled: offset + data.rows.length >= data.total, onclick: () => go("rollouts", { ...pageParams, offset: offset + data.limit }) }, "older ›"),
  );
  // Sorted by the server (ORDER BY one of the whitelisted columns); the sort is in the URL.
  const sort = { by: data.sort, order: data.order, keys: SORTABLE, first: { start_time: "desc", took: "desc", reward: "desc" },
    onsort: (key, order) => go("rollouts", { ...pageParams, sort: key, order, offset: 0 }) };
  view.replaceChildren(form, pager, table(data.rows, [
    ["rollout_id", "rollout", (v) => h("a", { href: `#/rollout/${encodeURIComponent(v)}` }, v)],
    ["status", "status", status], ["mode", "mode"], ["policy_version", "version"], ["group_id", "group"],
    ["start_time", "enqueued", time], ["took", "took", (v, r) => duration(r.start_time, r.end_time)],
    ["reward", "reward", (v) => h("span", { class: "num" }, fmt(v))], ["input", "input"],
  ], { testid: "rollouts-table", sort, onclick: (r) => go("rollout", {}, [r.rollout_id]) }));
}

function filtersForm(params) {
  const field = (name, label, input) => h("label", {}, label, input);
  const text = (name, placeholder) => h("input", { name, value: params.get(name) || "", placeholder, size: 12 });
  const when = (name) => h("input", { name, type: "datetime-local", step: 1, value: toLocalInput(params.get(name)) });
  const select = h("select", { name: "status" }, STATUSES.map((s) => h("option", { value: s, selected: params.get("status") === s }, s || "any")));
  const form = h("form", { class: "filters", "data-testid": "filters" },
    field("status", "status", select),
    field("mode", "mode", text("mode", "train, val")),
    field("policy_version", "policy version", text("policy_version", "e.g. 3")),
    field("group_id", "group or rollout id", text("group_id", "")),
    field("since", "enqueued from", when("since")), field("until", "until", when("until")),
    field("limit", "rows", h("select", { name: "limit" }, [25, 50, 100, 200].map((n) => h("option", { value: n, selected: String(n) === (params.get("limit") || "50") }, n)))),
    h("button", { class: "primary", type: "submit" }, "apply"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const values = Object.fromEntries(new FormData(form));
    for (const key of ["since", "until"]) {
      // datetime-local is the visitor's local time; the API takes Unix seconds.
      values[key] = values[key] ? String(new Date(values[key]).getTime() / 1000) : "";
      if (values[key] === "NaN") values[key] = "invalid";
    }
    go("rollouts", { ...values, sort: params.get("sort"), order: params.get("order"), offset: 0 });
  });
  return form;
}

// -- One rollout: attempts, waterfall, LLM calls, rewards, exceptions, triplets --------------------

async function rollout(view, { args, params }) {
  const id = args[0];
  const data = await api(`/v1/dashboard/rollouts/${encodeURIComponent(id)}`);
  const r = data.rollout;
  const attemptId = params.get("attempt") || (data.attempts.at(-1) || {}).attempt_id;
  const kv = (pairs) => h("dl", { class: "kv" }, pairs.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  const spansBox = h("div", { "data-testid": "attempt-spans" }, attemptId ? h("p", { class: "muted" }, "loading spans ...") : h("p", { class: "muted" }, "no attempts yet"));
  view.replaceChildren(
    h("h2", {}, "Rollout ", h("code", { "data-testid": "rollout-id" }, r.rollout_id), " ", status(r.status)),
    kv([["mode", fmt(r.mode)], ["policy version", fmt(r.policy_version)], ["resources", fmt(r.resources_id)],
      ["enqueued", time(r.start_time)], ["took", duration(r.start_time, r.end_time)],
      ["input", h("pre", {}, pretty(r.input))], ["metadata", h("pre", {}, pretty(r.metadata ?? ""))]]),
    h("h2", {}, `Attempts (${data.attempts.length})`),
    table(data.attempts, [
      ["sequence_id", "#"], ["attempt_id", "attempt"], ["status", "status", status], ["worker_id", "worker"],
      ["policy_version", "version"], ["start_time", "started", time], ["end_time", "took", (v, a) => duration(a.start_time, v)],
      ["final_reward", "final reward"], ["n_triplets", "triplets"], ["spans", "spans"], ["errors", "errors"],
    ], { testid: "attempts-table", selected: (a) => a.attempt_id === attemptId,
      onclick: (a) => go("rollout", { attempt: a.attempt_id }, [id]) }),
    spansBox,
    h("h2", {}, `Triplets (${data.triplets.length})`),
    table(data.triplets, [["attempt_id", "attempt"], ["triplet_index", "#"], ["prompt_tokens", "prompt tokens"],
      ["response_tokens", "response tokens"], ["reward", "reward"], ["final_reward", "final reward"], ["mode", "mode"],
      ["policy_version", "version"]], { testid: "triplets-table" }),
  );
  if (attemptId) await attemptView(spansBox, id, attemptId, params.get("span"));
}

function indexed(attributes, prefix) {
  // gen_ai.prompt.0.role / .0.content ... -> [{role, content}, ...]
  const items = {};
  for (const [key, value] of Object.entries(attributes)) {
    const m = key.startsWith(prefix) ? key.slice(prefix.length).match(/^(\d+)\.(.+)$/) : null;
    if (m) (items[m[1]] ??= {})[m[2]] = value;
  }
  return Object.keys(items).sort((a, b) => a - b).map((k) => items[k]);
}

async function attemptView(box, rolloutId, attemptId, selectedSpan) {
  const data = await api(`/v1/dashboard/rollouts/${encodeURIComponent(rolloutId)}/attempts/${encodeURIComponent(attemptId)}/spans`);
  const spans = data.spans;
  const detail = h("div", { "data-testid": "span-detail" });
  const select = (span, row) => {
    for (const el of box.querySelectorAll(".wf-row.selected")) el.classList.remove("selected");
    row.classList.add("selected");
    detail.replaceChildren(spanDetail(span));
  };
  const rows = spans.map((s) => {
    const row = h("div", { class: "wf-row", "data-testid": "wf-row", "data-span": s.span_id, title: s.name },
      h("div", { class: "wf-name", style: `padding-left: ${0.4 + s.depth * 1.1}rem` }, s.name),
      h("div", { class: "wf-track" }, h("div", { class: `wf-bar s-${s.status || "UNSET"}`,
        style: `left: ${(s.left * 100).toFixed(3)}%; width: ${(s.width * 100).toFixed(3)}%` })),
      h("div", { class: "wf-ms" }, `${s.duration_ms.toFixed(1)} ms`));
    row.addEventListener("click", () => select(s, row));
    return row;
  });
  const llm = llmCalls(spans);
  const rewards = spans.flatMap((s) => indexed(s.attributes, "agentlightning.reward.").map((r) => ({ span: s.name, ...r })));
  const errors = spans.filter((s) => s.status === "ERROR" || s.name === "agentlightning.exception" || s.events.some((e) => e.name === "exception"));
  box.replaceChildren(
    h("h2", {}, `Spans of attempt ${attemptId} (${spans.length}${data.cut ? ", cut" : ""})`),
    spans.length ? h("div", { class: "waterfall", "data-testid": "waterfall" }, rows) : h("p", { class: "muted" }, "no spans"),
    detail,
    h("h2", {}, `LLM calls (${llm.length})`),
    llm.length ? h("div", { "data-testid": "llm-calls" }, llm.map(llmCall)) : h("p", { class: "muted" }, "none"),
    h("h2", {}, `Rewards (${rewards.length})`),
    table(rewards, [["span", "span"], ["name", "name"], ["value", "value"]], { testid: "rewards" }),
    h("h2", {}, `Errors and exceptions (${errors.length})`),
    h("div", { "data-testid": "exceptions" }, errors.map((s) => h("div", { class: "panel" },
      h("strong", {}, s.name), " ", status(s.status || "UNSET"),
      h("pre", {}, [s.attributes["exception.type"], s.attributes["exception.message"] || s.status_message,
        s.attributes["exception.stacktrace"], ...s.events.filter((e) => e.name === "exception").map((e) =>
          `${e.attributes["exception.type"] || ""}: ${e.attributes["exception.message"] || ""}`)].filter(Boolean).join("\n"))))),
  );
  const chosen = spans.findIndex((s) => s.span_id === selectedSpan);
  if (chosen >= 0) select(spans[chosen], rows[chosen]);
}

// An LLM call's spans: the agent's client span and the LLM proxy's span (its child, same
// gen_ai.response.id) describe one call; it is listed once, by the span that says most (the
// proxy's: messages and token ids).
const GENAI_KEYS = ["gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.prompt", "gen_ai.completion"];
function isLLMCall(span) {
  return Object.keys(span.attributes).some((k) => k === "gen_ai.request.model" || k === "gen_ai.operation.name"
    || GENAI_KEYS.some((g) => k === g || k.startsWith(`${g}.`)));
}
function llmCalls(spans) {
  const calls = spans.filter(isLLMCall);
  const richness = (s) => (s.attributes["gen_ai.input.messages"] ? 2 : 0) + (s.attributes["prompt_token_ids"] ? 1 : 0);
  const parents = new Set(calls.map((s) => s.parent_id).filter(Boolean));
  const best = new Map();
  for (const s of calls) {
    const key = s.attributes["gen_ai.response.id"] || (parents.has(s.span_id) ? null : s.span_id);
    if (key === null) continue;  // a client span whose call its child (the proxy's span) describes
    const kept = best.get(key);
    if (!kept || richness(s) > richness(kept)) best.set(key, s);
  }
  const kept = new Set(best.values());
  return calls.filter((s) => kept.has(s));
}

function parsed(text) {
  if (typeof text !== "string") return text;
  try { return JSON.parse(text); } catch { return null; }
}

// The call's messages as [{role, parts: [{type, ...}]}]: the GenAI conventions' attribute
// (gen_ai.input.messages / gen_ai.output.messages, the LLM proxy's), else the older JSON
// text (gen_ai.prompt / gen_ai.completion: [{role, content, tool_calls}]), else flattened
// keys (gen_ai.prompt.0.role, .0.content, ... as other instrumentations write them).
function callMessages(attributes, key, oldKey) {
  const current = parsed(attributes[key]);
  if (Array.isArray(current)) return current;
  const old = parsed(attributes[oldKey]);
  const list = Array.isArray(old) ? old : indexed(attributes, `${oldKey}.`);
  return list.map((m) => {
    const { role, content, ...rest } = m;
    const parts = content !== undefined && content !== null ? [{ type: "text", content }] : [];
    if (Object.keys(rest).length) parts.push({ type: "fields", value: rest });
    return { role, parts };
  });
}

function messagePart(part) {
  if (part.type === "text" || part.type === "reasoning") return h("pre", { class: part.type === "reasoning" ? "muted" : null }, String(part.content));
  if (part.type === "tool_call") return h("pre", {}, `tool call ${part.name || ""}${part.id ? ` [${part.id}]` : ""}: ${pretty(part.arguments)}`);
  if (part.type === "tool_call_response") return h("pre", {}, `tool result${part.id ? ` [${part.id}]` : ""}: ${pretty(part.response)}`);
  return h("pre", {}, JSON.stringify(part.value ?? part, null, 2));
}

function llmCall(span) {
  const a = span.attributes;
  const messages = (list) => list.map((m) => h("div", { "data-testid": "llm-message" },
    h("span", { class: "muted" }, `${m.role || ""}${m.finish_reason ? ` (${m.finish_reason})` : ""} `),
    (m.parts || []).map(messagePart)));
  const tools = a["gen_ai.tool.definitions"] || a["gen_ai.request.tools"];
  return h("details", { class: "panel", open: true, "data-testid": "llm-call", "data-span": span.span_id },
    h("summary", {}, `${a["gen_ai.response.model"] || a["gen_ai.request.model"] || span.name} · ${span.duration_ms.toFixed(1)} ms · `,
      `${fmt(Number(a["gen_ai.usage.input_tokens"] ?? NaN) || a["gen_ai.usage.input_tokens"])} in / `,
      `${fmt(Number(a["gen_ai.usage.output_tokens"] ?? NaN) || a["gen_ai.usage.output_tokens"])} out tokens`),
    h("div", { class: "muted" }, "prompt"), messages(callMessages(a, "gen_ai.input.messages", "gen_ai.prompt")),
    h("div", { class: "muted" }, "response"), messages(callMessages(a, "gen_ai.output.messages", "gen_ai.completion")),
    // The tools offered to the model; a tool call it made is part of its response above.
    tools ? [h("div", { class: "muted" }, "tools offered"), h("pre", {}, pretty(tools))] : null);
}

function spanDetail(span) {
  const attrs = Object.entries(span.attributes).sort(([a], [b]) => a.localeCompare(b));
  return h("div", { class: "panel" },
    h("h3", {}, span.name, " ", status(span.status || "UNSET")),
    h("dl", { class: "kv" },
      h("dt", {}, "span id"), h("dd", {}, span.span_id), h("dt", {}, "parent"), h("dd", {}, span.parent_id || "—"),
      h("dt", {}, "start"), h("dd", {}, `+${span.start_ms.toFixed(3)} ms`),
      h("dt", {}, "duration"), h("dd", {}, `${span.duration_ms.toFixed(3)} ms`),
      span.status_message ? [h("dt", {}, "status message"), h("dd", {}, span.status_message)] : null,
      attrs.map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v).length > 120 ? h("pre", {}, v) : v)])),
    span.events.length ? h("div", {}, h("h3", {}, "events"), span.events.map((e) => h("pre", {}, `${e.name} ${JSON.stringify(e.attributes, null, 2)}`))) : null);
}

// -- Resources and workers ------------------------------------------------------------------------

async function resources(view) {
  const rows = await api("/v1/dashboard/resources");
  view.replaceChildren(h("h2", {}, `Resources (${rows.length})`), ...rows.map((r) => {
    let parsed = {};
    try { parsed = JSON.parse(r.resources); } catch { parsed = { resources: r.resources }; }
    return h("details", { class: "panel", open: true, "data-testid": "resource" },
      h("summary", {}, `${r.resources_id} · version ${fmt(r.version)} · updated `, time(r.update_time)),
      Object.entries(parsed).map(([name, value]) => h("div", {}, h("h3", {}, name, " ", h("span", { class: "muted" }, value?.resource_type || "")),
        value && typeof value.template === "string"
          ? h("pre", {}, value.template)
          : h("pre", {}, JSON.stringify(value, null, 2)))));
  }));
}

async function workers(view) {
  const rows = await api("/v1/dashboard/workers");
  const gone = rows.filter((r) => r.gone).length;
  view.replaceChildren(h("h2", {}, `Workers (${rows.length}${gone ? `, ${gone} gone` : ""})`), table(rows, [
    ["worker_id", "worker"], ["status", "status", workerStatus], ["last_heartbeat_time", "last heartbeat", time],
    ["last_dequeue_time", "last dequeue", time],
    ["current_rollout_id", "current rollout", (v) => v ? h("a", { href: `#/rollout/${encodeURIComponent(v)}` }, v) : "—"],
    ["current_attempt_id", "current attempt"],
  ], { testid: "workers-table" }));
}

// A worker that left: its runner said so as it stopped, or it has not been heard from for a while
// (the gateway's threshold); its recorded status is what it last was.
function workerStatus(value, row) {
  if (!row.gone) return status(value);
  const why = row.stopped ? `stopped ${span(row.silent_s)} ago` : `no heartbeat for ${span(row.silent_s)}`;
  return h("span", { class: "status s-gone", title: `last recorded status: ${value}` }, `gone (${why})`);
}

// -- SQL console ----------------------------------------------------------------------------------

let sqlText = "SELECT status, count() AS n FROM agl.rollouts FINAL GROUP BY status ORDER BY n DESC";

// The query is in the URL (#/sql?q=...): a link to the console runs it. Running another query
// changes the URL (so the back button and a copied link follow), which renders and runs it.
async function sql(view, { params }) {
  const linked = params.get("q");
  if (linked) sqlText = linked;
  const [schema, cookbook] = await Promise.all([api("/v1/dashboard/schema"), api("/v1/dashboard/cookbook")]);
  const editor = h("textarea", { spellcheck: "false", "data-testid": "sql-editor" }, sqlText);
  const out = h("div", { "data-testid": "sql-result" });
  let ran = null; // the text of the query whose result is shown (the CSV is of it)
  const csv = h("button", { "data-testid": "sql-csv", disabled: true, title: "the result as the gateway's CSV (/v1/sql, format csv)",
    onclick: async () => {
      try {
        await download("/v1/sql", { query: ran, format: "csv" }, "query.csv");
      } catch (e) {
        showError(e);
      }
    } }, "download CSV");
  const run = async () => {
    sqlText = editor.value;
    csv.disabled = true;
    out.replaceChildren(h("p", { class: "muted" }, "running ..."));
    try {
      const result = await api("/v1/sql", { query: sqlText, format: "json" });
      clearError();
      ran = sqlText;
      csv.disabled = false;
      out.replaceChildren(sqlResult(result));
    } catch (e) {
      out.replaceChildren(h("p", { class: "error", "data-testid": "sql-error" }, e instanceof ApiError ? `${e.kind}: ${e.message}` : String(e)));
    }
  };
  const submit = (text) => {
    if (route().params.get("q") === text) run();
    else go("sql", { q: text });
  };
  editor.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) submit(editor.value); });
  view.replaceChildren(h("div", { class: "sql" },
    h("aside", {},
      h("h3", {}, "Cookbook"),
      cookbook.map((q) => h("button", { title: q.description, "data-testid": "cookbook", onclick: () => { editor.value = q.sql; submit(q.sql); } }, q.title)),
      h("h3", {}, `Tables of ${schema.database}`),
      Object.entries(schema.tables).map(([name, columns]) => h("details", { "data-testid": "schema-table" },
        h("summary", {}, name),
        h("ul", {}, columns.map(([c, t]) => h("li", {}, h("code", {}, c), " ", h("span", { class: "muted" }, t))))))),
    h("div", {}, editor,
      h("div", { class: "pager" }, h("button", { class: "primary", onclick: () => submit(editor.value), "data-testid": "sql-run" }, "run"),
        csv, h("span", { class: "muted" }, "Ctrl+Enter; read-only, one SELECT over the agl tables; the URL keeps the query")),
      out)));
  if (linked) await run();
}

function sqlResult(result) {
  const rows = result.rows.map((r) => Object.fromEntries(result.columns.map((c, i) => [c, r[i]])));
  const numeric = result.columns.filter((c, i) => result.rows.length && result.rows.every((r) => r[i] === null || typeof r[i] === "number"));
  const parts = [h("p", { class: "muted", "data-testid": "sql-summary" }, `${result.row_count} row(s) in ${result.elapsed_ms} ms`)];
  if (numeric.length >= 2 && rows.length > 1) {
    // Two numeric columns: the first is x, the others are series; rows sorted by x for a line.
    // One y axis per unit (a name's suffix, else the values' order of magnitude).
    const [x, ...ys] = numeric;
    const sorted = [...rows].sort((a, b) => (a[x] ?? 0) - (b[x] ?? 0));
    const columns = ys.map((y) => sorted.map((r) => r[y]));
    const box = h("div", { class: "panel", "data-testid": "sql-chart" });
    parts.push(box);
    queueMicrotask(() => lineChart(box, `${ys.join(", ")} by ${x}`, [sorted.map((r) => r[x]), ...columns], ys,
      { xTime: false, xLabel: x, axes: unitAxes(ys, columns) }));
  }
  parts.push(table(rows, result.columns.map((c) => [c, c]), { testid: "sql-table" }));
  return h("div", {}, parts);
}

// -- the shell ---------------------------------------------------------------------------------

const PAGES = { overview, rollouts, rollout, version, resources, workers, sql, dlq: deadLetters };
const LIVE = new Set(["overview", "rollouts", "resources", "workers", "rollout", "version", "dlq"]);

async function render(initial) {
  const r = route();
  const page = PAGES[r.page] || overview;
  const mine = ++generation;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === (r.page === "rollout" ? "rollouts" : r.page));
  // A refresh renders into a hidden twin of <main> (in the document, so charts can measure
  // their width) and swaps in, so the page does not flicker or lose its scroll.
  const view = initial ? main : h("main", { "aria-hidden": "true",
    style: `position: absolute; visibility: hidden; left: 0; top: 0; width: ${main.clientWidth}px` });
  if (!initial) document.body.append(view);
  if (initial) {
    main.replaceChildren(h("p", { class: "muted" }, "loading ..."));
    main.dataset.partial = "";
  }
  try {
    await page(view, r);
    if (mine !== generation) {
      if (!initial) view.remove();
      return;
    }
    clearError();
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    if (!initial) view.remove();
    if (mine !== generation) return;
    showError(e);
    if (initial && main.dataset.partial !== "1") main.replaceChildren(h("p", { class: "muted" }, "this page could not be loaded"));
    return;
  }
  if (!initial) {
    if (mine === generation) main.replaceChildren(...view.childNodes);
    view.remove();
  }
}

function schedule() {
  clearInterval(timer);
  timer = setInterval(() => {
    const r = route();
    // Not while the visitor is typing in a form, nor on the SQL console (its results are theirs).
    const typing = document.activeElement && ["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement.tagName);
    if (document.getElementById("live").checked && LIVE.has(r.page) && !typing && !document.hidden) render(false);
  }, POLL_MS);
}

window.addEventListener("hashchange", () => render(true));
document.getElementById("live").addEventListener("change", schedule);
render(true);
schedule();

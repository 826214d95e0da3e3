// The dead letters page: agl.dlq as the dead_letters table holds it, counted by source topic,
// rejecting role and error type, and the newest ones. Their bytes stay on the topic: each row
// names the `agl-stream dlq show` / `resubmit` command for it.
import { api, fmt, h, table, time } from "./util.js";

export async function deadLetters(view, { params }) {
  const source = params.get("source_topic") || "";
  const limit = params.get("limit") || "50";
  const query = new URLSearchParams({ limit });
  if (source) query.set("source_topic", source);
  const data = await api(`/v1/dashboard/dead-letters?${query}`);
  const pick = (topic) => h("a", { href: `#/dlq?${new URLSearchParams({ source_topic: topic, limit })}` }, topic);
  const named = (id) => h("code", { title: `agl-stream dlq show ${id}` }, id);
  view.replaceChildren(
    h("h2", {}, "Dead letters ", h("span", { "data-testid": "dlq-total" }, fmt(data.total)),
      source ? [" from ", h("code", { "data-testid": "dlq-source" }, source), " ",
        h("a", { href: `#/dlq?${new URLSearchParams({ limit })}` }, "(all sources)")] : null),
    h("p", { class: "muted" }, "Records a role could not process (agl.dlq). Read one with ",
      h("code", {}, "agl-stream dlq show ID"), "; send it back with ", h("code", {}, "agl-stream dlq resubmit ID"),
      " once its problem is fixed (docs/dlq.md)."),
    h("h2", {}, "By source, role and error"),
    data.counts.length
      ? table(data.counts, [["source_topic", "source topic", pick], ["processor", "rejected by"], ["error_type", "error"],
        ["n", "count"], ["first_time", "first", time], ["last_time", "last", time], ["newest_reason", "newest reason"]],
      { testid: "dlq-counts" })
      : h("p", { class: "muted", "data-testid": "dlq-empty" }, "no dead letters"),
    h("h2", {}, `Newest ${data.newest.length}`),
    table(data.newest, [["id", "id", named], ["time", "rejected", time], ["source_topic", "source topic", pick],
      ["source_offset", "offset", (v, r) => `${r.source_partition}:${v}`], ["processor", "rejected by"],
      ["error_type", "error"], ["reason", "reason"], ["key", "key"],
      ["value_size", "bytes", (v, r) => (r.value_kept < v ? `${fmt(r.value_kept)} of ${fmt(v)}` : fmt(v))]],
    { testid: "dlq-newest" }),
  );
}

// DOM building, the gateway's JSON API and number formatting. Every value reaches the page as a
// text node (h() never parses markup), so span text holding HTML shows as text.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "style") el.style.cssText = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

// A gateway that requires its API token: `agl-stream dashboard` prints the URL with ?token=...;
// the page keeps it for this tab only (sessionStorage) and takes it out of the address bar.
const TOKEN_KEY = "agl-stream-token";
{
  const url = new URL(location.href);
  const given = url.searchParams.get("token");
  if (given) {
    sessionStorage.setItem(TOKEN_KEY, given);
    url.searchParams.delete("token");
    history.replaceState(null, "", url);
  }
}

export class ApiError extends Error {
  constructor(kind, message) {
    super(message);
    this.kind = kind;
  }
}

// GET (or POST with a JSON body) to the gateway; a typed {"error", "message"} answer throws.
export async function api(path, body) {
  const text = await (await request(path, body)).text();
  try {
    return JSON.parse(text);
  } catch {
    throw new ApiError("bad_answer", `not JSON: ${text.slice(0, 300)}`);
  }
}

// POST ``body`` and save the answer as a file named ``filename`` (the gateway renders it: CSV,
// JSON lines, ...); an error answer throws as api() does.
export async function download(path, body, filename) {
  const blob = await (await request(path, body)).blob();
  const url = URL.createObjectURL(blob);
  const link = h("a", { href: url, download: filename, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

async function request(path, body) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { authorization: `Bearer ${token}` } : {};
  const init = body === undefined ? { headers } : {
    method: "POST", headers: { ...headers, "content-type": "application/json" }, body: JSON.stringify(body),
  };
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    throw new ApiError("unreachable", `the gateway did not answer (${e.message})`);
  }
  if (response.ok) return response;
  if (response.status === 401) {
    throw new ApiError("unauthorized", "this gateway requires its API token: open the URL `agl-stream dashboard` prints (it carries the token)");
  }
  const text = await response.text();
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new ApiError("bad_answer", `HTTP ${response.status}: ${text.slice(0, 300)}`);
  }
  throw new ApiError(data.error || "error", data.message || `HTTP ${response.status}`);
}

export function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "—";
  if (typeof value === "number") {
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    return Number(value.toFixed(digits)).toString();
  }
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

// Times: the API gives float seconds since the epoch (ISO 8601 text is read too). One formatter
// for the page: time() says how long ago ("3 min ago"), its title the UTC time to the millisecond.
export function seconds(value) {
  if (value === null || value === undefined || value === "") return null;
  const s = typeof value === "number" ? value : Date.parse(/[zZ]|[+-]\d\d:?\d\d$/.test(value) ? value : `${value}Z`) / 1000;
  return Number.isFinite(s) ? s : null;
}

export function utc(value) {
  const s = seconds(value);
  return s === null ? "—" : `${new Date(s * 1000).toISOString().replace("T", " ").slice(0, 23)} UTC`;
}

// A length of time in words: "12 s", "3 min", "5 h", "2 days".
export function span(secs) {
  const a = Math.abs(secs);
  if (a < 90) return `${Math.round(a)} s`;
  if (a < 90 * 60) return `${Math.round(a / 60)} min`;
  if (a < 36 * 3600) return `${Math.round(a / 3600)} h`;
  return `${Math.round(a / 86400)} days`;
}

export function ago(value, now = Date.now() / 1000) {
  const s = seconds(value);
  if (s === null) return "—";
  const d = now - s;
  if (Math.abs(d) < 1) return "just now";
  return d > 0 ? `${span(d)} ago` : `in ${span(d)}`;
}

export function time(value) {
  const s = seconds(value);
  if (s === null) return "—";
  return h("time", { datetime: new Date(s * 1000).toISOString(), title: utc(s), "data-t": s }, ago(s));
}

export function duration(start, end) {
  const a = seconds(start);
  const b = seconds(end);
  if (a === null || b === null) return "—";
  return `${(b - a).toFixed(3)} s`;
}

export function status(value) {
  return h("span", { class: `status s-${value}` }, value ?? "—");
}

// A table of records: columns are [key, label, render?]; numbers align right. ``sort``:
// {by, order, keys, onsort(key)}: the headers of ``keys`` are buttons that sort by that column
// (the caller orders the rows; a click on the sorted column flips the direction).
export function table(rows, columns, { onclick, testid, selected, sort } = {}) {
  const header = ([key, label]) => {
    if (!sort || !sort.keys.includes(key)) return h("th", {}, label ?? key);
    const active = sort.by === key;
    const next = active && sort.order === "desc" ? "asc" : active ? "desc" : (sort.first?.[key] ?? "asc");
    return h("th", { class: "sortable", "data-sort": key, "aria-sort": active ? `${sort.order}ending` : "none",
      title: `sort by ${label ?? key} (${next === "asc" ? "ascending" : "descending"})`,
      onclick: () => sort.onsort(key, next) },
    label ?? key, active ? (sort.order === "asc" ? " ▲" : " ▼") : "");
  };
  const head = h("tr", {}, columns.map(header));
  const body = rows.map((row, i) => h(
    "tr",
    { class: [onclick ? "clickable" : "", selected && selected(row) ? "selected" : ""].join(" ").trim() || null,
      onclick: onclick ? () => onclick(row, i) : null },
    columns.map(([key, , render]) => {
      const value = row[key];
      const cell = render ? render(value, row) : fmt(value);
      return h("td", { class: typeof value === "number" && !render ? "num" : null, "data-col": key }, cell);
    }),
  ));
  return h("table", { "data-testid": testid }, h("thead", {}, head), h("tbody", {}, body));
}

export function pretty(text) {
  if (typeof text !== "string") return JSON.stringify(text, null, 2);
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

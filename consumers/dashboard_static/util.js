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
  const text = await response.text();
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new ApiError("bad_answer", `HTTP ${response.status}: ${text.slice(0, 300)}`);
  }
  if (response.status === 401) {
    throw new ApiError("unauthorized", "this gateway requires its API token: open the URL `agl-stream dashboard` prints (it carries the token)");
  }
  if (!response.ok) throw new ApiError(data.error || "error", data.message || `HTTP ${response.status}`);
  return data;
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

export function time(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 23);
}

export function duration(start, end) {
  if (start === null || end === null || start === undefined || end === undefined) return "—";
  return `${(end - start).toFixed(3)} s`;
}

export function status(value) {
  return h("span", { class: `status s-${value}` }, value ?? "—");
}

// A table of records: columns are [key, label, render?]; numbers align right.
export function table(rows, columns, { onclick, testid, selected } = {}) {
  const head = h("tr", {}, columns.map(([key, label]) => h("th", {}, label ?? key)));
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

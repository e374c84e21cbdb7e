// Building the page: every text is a text node, every attribute set by name. Nothing here
// parses markup, so a message body, header or name is always shown as the text it is.

const SVG = "http://www.w3.org/2000/svg";
const PROPERTIES = new Set(["checked", "disabled", "value", "hidden", "type", "name"]);

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function apply(node, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "data") Object.assign(node.dataset, value);
    else if (PROPERTIES.has(key)) node[key] = value;
    else node.setAttribute(key, String(value));
  }
  return node;
}

/** An HTML element: ``el("td", {class: "num"}, text, ...)``. */
export function el(tag, attrs, ...children) {
  return append(apply(document.createElement(tag), attrs), children);
}

/** An SVG element, the same way. */
export function svg(tag, attrs, ...children) {
  return append(apply(document.createElementNS(SVG, tag), attrs), children);
}

/** A link to a console page: its path parts are encoded, whatever they hold. */
export function link(parts, ...children) {
  const hash = "#/" + parts.map((p) => encodeURIComponent(String(p))).join("/");
  return el("a", { href: hash }, ...children);
}

/** A table from a header row and rows of cells (a cell: a node, a text, or [attrs, ...]). */
export function table(headers, rows, attrs) {
  const cell = (tag, value) =>
    Array.isArray(value) ? el(tag, value[0], ...value.slice(1)) : el(tag, null, value);
  return el(
    "table",
    attrs,
    el("thead", null, el("tr", null, headers.map((h) => cell("th", h)))),
    el("tbody", null, rows.map((row) => (row instanceof Node ? row : el("tr", null, row.map((v) => cell("td", v)))))),
  );
}

/** A row of figures: ``cards([["Backlog", "12", "backlog"], ...])``. */
export function cards(items) {
  return el(
    "div",
    { class: "cards" },
    items.map(([label, value, key, note]) =>
      el("div", { class: "card", data: { metric: key } }, el("div", { class: "label" }, label), el("div", { class: "value" }, value), note ? el("div", { class: "note" }, note) : null),
    ),
  );
}

/** The broker's refusal (or any failure) of one request, shown where its data would be. */
export function refusal(error, what) {
  const status = error.status ? `${error.status} ${error.code || ""}`.trim() : "failed";
  return el("div", { class: "refusal", role: "alert" }, el("strong", null, `${what}: ${status}`), " ", error.message || "");
}

const integer = new Intl.NumberFormat("en");
const decimal = new Intl.NumberFormat("en", { maximumFractionDigits: 1 });

export function count(n) {
  return n === null || n === undefined ? "–" : integer.format(n);
}

export function rate(n) {
  return n === null || n === undefined ? "–" : decimal.format(n);
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit ? decimal.format(value) : integer.format(value)} ${units[unit]}`;
}

export function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 60) return `${decimal.format(seconds)} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes} min ${Math.floor(seconds % 60)} s`;
  const hours = Math.floor(minutes / 60);
  if (hours < 48) return `${hours} h ${minutes % 60} min`;
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

export function time(text) {
  if (!text) return "–";
  const at = new Date(text);
  return Number.isNaN(at.getTime()) ? String(text) : at.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

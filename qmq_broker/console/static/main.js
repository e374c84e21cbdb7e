// The console: hash routes to pages, a refresh every 2 s (polling the JSON API; paused
// while the tab is hidden), and a token asked for when the broker answers 401.

import { ApiError, call, setToken, token } from "./api.js";
import { el, refusal } from "./dom.js";
import * as dead from "./page-dead.js";
import * as reset from "./page-reset.js";
import * as delayed from "./page-delayed.js";
import * as overview from "./page-overview.js";
import * as routes from "./page-routes.js";
import * as subject from "./page-subject.js";

const REFRESH_MS = 2000;
const view = document.getElementById("page");
const health = document.getElementById("health");
const updated = document.getElementById("updated");
const forget = document.getElementById("forget-token");

let active = null; // {page, params, state, busy, again}
let asking = false;

function parts(hash) {
  const path = hash.replace(/^#\/?/, "");
  if (!path) return [];
  try {
    return path.split("/").map(decodeURIComponent);
  } catch {
    return null;
  }
}

function resolve(hash) {
  const p = parts(hash);
  if (p === null) return null;
  if (p.length === 0) return { page: overview, params: {} };
  if (p.length === 1 && p[0] === "delayed") return { page: delayed, params: {} };
  if (p[0] !== "subjects" || p.length < 2) return null;
  const s = p[1];
  if (p.length === 2) return { page: subject, params: { subject: s } };
  if (p.length === 3 && p[2] === "routes") return { page: routes, params: { subject: s } };
  if (p.length === 5 && p[2] === "groups" && p[4] === "reset") return { page: reset, params: { subject: s, group: p[3] } };
  if (p.length >= 5 && p[2] === "groups" && p[4] === "dead") {
    if (p.length === 5) return { page: dead, params: { subject: s, group: p[3] } };
    if (p.length === 7 && p[5] === "partitions" && /^\d+$/.test(p[6])) return { page: dead, params: { subject: s, group: p[3], partition: p[6] } };
  }
  return null;
}

function route() {
  const found = resolve(location.hash);
  if (!found) {
    active = null;
    view.replaceChildren(el("h1", null, "Not found"), el("p", null, "No console page here. ", el("a", { href: "#/" }, "Overview")));
    return;
  }
  active = { ...found, state: {}, busy: false, again: false };
  document.title = `${found.page.title} · qmq console`;
  if (asking) return; // the token form stays; once a token is given this page loads
  view.replaceChildren(el("p", { class: "quiet" }, "Loading…"));
  refresh();
}

async function refresh() {
  const current = active;
  if (!current || asking) return;
  if (current.busy) {
    current.again = true; // an action asked for fresh data: one more round after this one
    return;
  }
  current.busy = true;
  try {
    const node = await current.page.render(current.params, current.state, refresh);
    if (current === active && !asking) {
      view.replaceChildren(node);
      updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
    }
  } catch (error) {
    if (current !== active) return;
    if (error instanceof ApiError && error.status === 401) askToken(error);
    else view.replaceChildren(refusal(error, "Could not load this page"));
  } finally {
    current.busy = false;
    if (current.again && current === active) {
      current.again = false;
      refresh();
    }
  }
}

function askToken(error) {
  asking = true;
  const input = el("input", { type: "password", id: "token", name: "token", autocomplete: "off", required: true, "aria-label": "token" });
  const form = el(
    "form",
    { class: "token", id: "token-form" },
    el("h1", null, "A token, please"),
    el("p", null, token() ? "The broker refused the token this tab had: " : "The broker asks for a bearer token: ", el("em", null, error.message), "."),
    el("p", null, "Any valid token shows what it may see; redriving dead letters and resetting groups need manage. The token stays in this tab (sessionStorage) and is sent only to this broker."),
    el("label", null, "Token ", input),
    el("button", { type: "submit" }, "Use token"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setToken(input.value.trim());
    asking = false;
    forget.hidden = false;
    route();
  });
  view.replaceChildren(form);
  input.focus();
}

async function checkHealth() {
  try {
    const answer = await call("/healthz");
    health.textContent = "healthy";
    health.className = "health ok";
    return answer;
  } catch (error) {
    const status = error.status === 503 ? "not ready" : "unreachable";
    health.textContent = status;
    health.className = "health bad";
    return null;
  }
}

forget.hidden = !token();
forget.addEventListener("click", () => {
  setToken(null);
  forget.hidden = true;
  asking = false;
  route();
});
window.addEventListener("hashchange", route);
setInterval(() => {
  if (document.hidden) return;
  checkHealth();
  refresh();
}, REFRESH_MS);
checkHealth();
route();

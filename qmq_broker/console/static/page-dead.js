// A group's dead letters: error, attempts, a preview of each body (cut, and always text),
// and redrive of the selected ones or all. Refusals (a token without manage) are shown.

import { call, settle, subjectPath } from "./api.js";
import { count, el, link, refusal, table, time } from "./dom.js";

export const title = "Dead letters";
const PREVIEW_CHARS = 1024;
const PAGE = 50;
const encoder = new TextEncoder();

function preview(message) {
  if (!message) return el("span", { class: "quiet" }, "unreadable record");
  const body = message.body;
  const size = message.body_encoding === "base64" ? Math.floor((body.length * 3) / 4) - (body.endsWith("==") ? 2 : body.endsWith("=") ? 1 : 0) : encoder.encode(body).length;
  const cut = body.length > PREVIEW_CHARS;
  return el(
    "div",
    { class: "body" },
    el("pre", { class: "preview" }, cut ? body.slice(0, PREVIEW_CHARS) : body),
    el(
      "div",
      { class: "note" },
      message.body_encoding === "base64" ? "base64, " : "",
      `${count(size)} bytes`,
      cut ? `; cut: first ${count(PREVIEW_CHARS)} of ${count(body.length)} characters shown` : "",
    ),
  );
}

function about(message) {
  if (!message) return null;
  const headers = Object.entries(message.headers || {});
  return el(
    "dl",
    { class: "about" },
    el("dt", null, "id"),
    el("dd", null, el("code", null, message.id)),
    message.key !== null ? [el("dt", null, "key"), el("dd", null, el("code", null, message.key))] : null,
    message.producer !== null ? [el("dt", null, "producer"), el("dd", null, message.producer)] : null,
    el("dt", null, "stored"),
    el("dd", null, time(message.stored_at)),
    headers.length ? [el("dt", null, "headers"), el("dd", null, el("ul", { class: "headers" }, headers.map(([k, v]) => el("li", null, el("code", null, k), ": ", v))))] : null,
  );
}

async function partitions(subject) {
  const routes = await settle(subjectPath(subject, "routes"));
  if (routes.error) return [];
  const all = new Set();
  for (const version of routes.value.history) for (const range of version.ranges) all.add(range.partition);
  return [...all].sort((a, b) => a - b);
}

export async function render({ subject, group, partition }, state, refresh) {
  state.selected ||= new Set();
  state.after ||= [];
  const where = partition === undefined ? "" : ` partition ${partition}`;
  const head = el("h1", null, "Dead letters of ", el("code", null, group), " on ", link(["subjects", subject], el("code", null, subject)), where);
  const query = new URLSearchParams({ limit: String(PAGE) });
  const after = state.after[state.after.length - 1];
  if (after !== undefined) query.set("after_seq", String(after));
  if (partition !== undefined) query.set("partition", String(partition));
  const base = subjectPath(subject, "groups", group, "dead");
  const listed = await settle(`${base}?${query}`);
  const parts = [head];
  if (listed.error && listed.error.code === "partition_required") {
    const known = await partitions(subject);
    parts.push(
      el("p", null, "An ordered subject keeps dead letters per partition:"),
      el("ul", { class: "partitions" }, known.map((p) => el("li", null, link(["subjects", subject, "groups", group, "dead", "partitions", p], `partition ${p}`)))),
    );
    return el("section", null, ...parts);
  }

  const redrive = async (doc, what) => {
    const body = partition === undefined ? doc : { ...doc, partition: Number(partition) };
    try {
      const answer = await call(`${base}/redrive`, { method: "POST", body });
      state.notice = { ok: true, text: `Redriven ${answer.redriven} (${what}).` };
      state.selected.clear();
    } catch (error) {
      if (error.status === 401) throw error;
      state.notice = { ok: false, error };
    }
    await refresh();
  };
  const redriveSelected = () => {
    const seqs = [...state.selected];
    return redrive({ seqs }, `${seqs.length} selected`);
  };
  parts.push(
    el(
      "div",
      { class: "actions" },
      el("button", { type: "button", id: "redrive-selected", disabled: state.selected.size === 0, onclick: redriveSelected }, `Redrive selected (${state.selected.size})`),
      el("button", { type: "button", id: "redrive-all", onclick: () => redrive({ all: true }, "all") }, "Redrive all"),
    ),
  );
  if (state.notice) {
    parts.push(state.notice.ok ? el("div", { class: "notice", role: "status" }, state.notice.text) : refusal(state.notice.error, "Redrive refused"));
  }
  if (listed.error) {
    parts.push(refusal(listed.error, "Dead letters"));
    return el("section", null, ...parts);
  }
  const page = listed.value;
  const rows = page.dead.map((d) =>
    el(
      "tr",
      { data: { seq: String(d.seq) } },
      el(
        "td",
        null,
        el("input", {
          type: "checkbox",
          "aria-label": `select seq ${d.seq}`,
          checked: state.selected.has(d.seq),
          onchange: (event) => {
            if (event.target.checked) state.selected.add(d.seq);
            else state.selected.delete(d.seq);
            const button = document.getElementById("redrive-selected");
            if (button) {
              button.disabled = state.selected.size === 0;
              button.textContent = `Redrive selected (${state.selected.size})`;
            }
          },
        }),
      ),
      el("td", { class: "num", data: { col: "seq" } }, String(d.seq)),
      el("td", { class: "num", data: { col: "attempts" } }, count(d.attempts)),
      el("td", { data: { col: "error" } }, d.error === null ? el("span", { class: "quiet" }, "none given") : el("pre", { class: "error" }, d.error)),
      el("td", { data: { col: "dead_at" } }, time(d.dead_at), d.consumer ? el("div", { class: "note" }, "consumer ", el("code", null, d.consumer)) : null),
      el("td", { data: { col: "message" } }, about(d.message)),
      el("td", { data: { col: "body" } }, preview(d.message)),
    ),
  );
  parts.push(
    rows.length
      ? table(["", [{ class: "num" }, "Seq"], [{ class: "num" }, "Attempts"], "Error", "Dead since", "Message", "Body"], rows, { class: "dead" })
      : el("p", { class: "quiet" }, "No dead letters."),
  );
  const paging = el("div", { class: "paging" });
  if (state.after.length) paging.append(el("button", { type: "button", onclick: () => { state.after.pop(); refresh(); } }, "Previous page"));
  if (page.next_after_seq !== null) paging.append(el("button", { type: "button", onclick: () => { state.after.push(page.next_after_seq); refresh(); } }, "Next page"));
  parts.push(paging);
  return el("section", null, ...parts);
}

// Delayed messages not yet due, by the hour they are due in (GET /v1/schedule: a token with
// manage on every subject).

import { call } from "./api.js";
import { age, bytes, cards, count, el, table, time } from "./dom.js";

export const title = "Delayed";

export async function render() {
  const s = await call("/v1/schedule?limit=48");
  const most = Math.max(1, ...s.hours.map((h) => h.messages));
  const rows = s.hours.map((h) => {
    const bar = el("span", { class: "bar" });
    bar.style.width = `${((100 * h.messages) / most).toFixed(1)}%`; // CSSOM, not markup
    return el(
      "tr",
      { data: { hour: h.hour } },
      el("td", { data: { col: "hour" } }, time(h.hour)),
      el("td", { class: "num", data: { col: "messages" } }, count(h.messages)),
      el("td", { class: "num", data: { col: "bytes" } }, bytes(h.bytes)),
      el("td", { data: { col: "loaded" } }, h.loaded ? "in the timing wheel" : "on disk"),
      el("td", { class: "bars" }, bar),
    );
  });
  return el(
    "section",
    null,
    el("h1", null, "Delayed messages"),
    cards([
      ["Waiting", count(s.messages), "messages", bytes(s.bytes)],
      ["Next due", time(s.next_due_at), "next_due"],
      ["Dispatch lag", `${age(s.dispatch_lag_ms / 1000)}`, "lag"],
      ["In the wheel", count(s.wheel_messages), "wheel"],
      ["Dispatched", count(s.dispatched), "dispatched", s.last_dispatch ? `last ${time(s.last_dispatch.at)}` : null],
      ["Unreadable", count(s.unreadable), "unreadable", "lost to damaged files since start"],
    ]),
    el("h2", null, "By due hour (UTC)"),
    rows.length
      ? table(["Hour", [{ class: "num" }, "Messages"], [{ class: "num" }, "Bytes"], "Where", ""], rows, { class: "hours" })
      : el("p", { class: "quiet" }, "Nothing is waiting."),
    s.more_hours ? el("p", { class: "quiet" }, "Later hours are not shown (the first 48 with messages are).") : null,
  );
}

// The overview: broker health, rates, backlog, disk and fsync; every subject in a table.

import { call } from "./api.js";
import { age, bytes, cards, count, el, link, rate, table } from "./dom.js";

export const title = "Overview";

export async function render() {
  const o = await call("/v1/console/overview");
  const disk = o.disk;
  const fsync = o.fsync;
  const rows = o.subjects.map((s) =>
    el(
      "tr",
      { data: { subject: s.subject } },
      el("td", { data: { col: "subject" } }, link(["subjects", s.subject], s.subject), s.ordered ? el("span", { class: "badge" }, "ordered") : null),
      el("td", { class: "num", data: { col: "messages" } }, count(s.messages)),
      el("td", { class: "num", data: { col: "bytes" } }, bytes(s.bytes)),
      el("td", { class: "num", data: { col: "groups" } }, count(s.groups)),
      el("td", { class: "num", data: { col: "backlog" } }, count(s.backlog)),
      el("td", { class: "num", data: { col: "in_flight" } }, count(s.in_flight)),
      el("td", { class: "num", data: { col: "retrying" } }, count(s.retrying)),
      el("td", { class: "num", data: { col: "dead" } }, count(s.dead)),
      el("td", { class: "num", data: { col: "in_per_s" } }, rate(s.in_per_s)),
      el("td", { class: "num", data: { col: "out_per_s" } }, rate(s.out_per_s)),
      el("td", { class: "num", data: { col: "oldest_unacked" } }, age(s.oldest_unacked_age_s)),
    ),
  );
  return el(
    "section",
    { class: "overview" },
    el("h1", null, "Overview"),
    cards([
      ["Health", o.status === "ready" ? "ok" : o.status, "health"],
      ["In, msg/s", rate(o.in_per_s), "in_per_s"],
      ["Out (acked), msg/s", rate(o.out_per_s), "out_per_s"],
      ["Backlog", count(o.backlog), "backlog"],
      ["Dead letters", count(o.dead), "dead"],
      ["Oldest unacked", age(o.oldest_unacked_age_s), "oldest_unacked"],
      ["Disk used", disk ? bytes(disk.data_bytes) : "–", "disk", disk ? `${bytes(disk.free_bytes)} free of ${bytes(disk.total_bytes)}` : null],
      ["fsync", fsync.mean_ms === null ? "–" : `${rate(fsync.mean_ms)} ms`, "fsync", fsync.p99_ms === null ? `${count(fsync.fsyncs)} fsyncs` : `p99 ≤ ${rate(fsync.p99_ms)} ms, ${count(fsync.fsyncs)} fsyncs`],
    ]),
    el("h2", null, "Subjects"),
    rows.length
      ? table(
          ["Subject", ...["Messages", "Bytes", "Groups", "Backlog", "In flight", "Retrying", "Dead", "In/s", "Out/s", "Oldest unacked"].map((h) => [{ class: "num" }, h])],
          rows,
          { class: "subjects" },
        )
      : el("p", { class: "quiet" }, "No subjects yet."),
    el("p", { class: "quiet" }, `Rates over the last sample interval (${o.sample_interval_s} s); figures for the subjects and groups your token may see.`),
  );
}

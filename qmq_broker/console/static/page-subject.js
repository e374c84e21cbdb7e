// A subject: its groups (backlog, in flight, retrying, dead, consumers seen, mode) and a
// chart of its rates and backlogs over the sampled history.

import { settle, subjectPath } from "./api.js";
import { lineChart } from "./chart.js";
import { age, bytes, count, el, link, rate, refusal, table } from "./dom.js";

export const title = "Subject";

function consumers(list) {
  if (!list.length) return el("span", { class: "quiet" }, "none lately");
  return el(
    "ul",
    { class: "consumers" },
    list.map((c) => el("li", null, el("code", null, c.consumer), ` ${age(c.seen_s_ago)} ago`)),
  );
}

export async function render({ subject }) {
  const [detail, extra] = await Promise.all([settle(subjectPath(subject)), settle(`/v1/console/subjects/${encodeURIComponent(subject)}`)]);
  const head = el("h1", null, "Subject ", el("code", null, subject));
  if (detail.error) return el("section", null, head, refusal(detail.error, "Subject"));
  const s = detail.value;
  const view = extra.value;
  const seen = new Map((view ? view.groups : []).map((g) => [g.group, g]));
  const rows = s.groups.map((g) => {
    const more = seen.get(g.group);
    return el(
      "tr",
      { data: { group: g.group } },
      el("td", { data: { col: "group" } }, g.group),
      el("td", { data: { col: "mode" } }, g.mode),
      el("td", { class: "num", data: { col: "backlog" } }, count(g.backlog)),
      el("td", { class: "num", data: { col: "in_flight" } }, count(g.in_flight)),
      el("td", { class: "num", data: { col: "retrying" } }, count(g.retrying)),
      el("td", { class: "num", data: { col: "dead" } }, link(["subjects", subject, "groups", g.group, "dead"], count(g.dead))),
      el("td", { class: "num", data: { col: "acked" } }, count(g.acked)),
      el("td", { class: "num", data: { col: "oldest_unacked" } }, age(more ? more.oldest_unacked_age_s : null)),
      el("td", { data: { col: "consumers" } }, consumers(more ? more.consumers : [])),
      el("td", { data: { col: "actions" } }, link(["subjects", subject, "groups", g.group, "reset"], "Reset…")),
    );
  });
  const parts = [
    head,
    el(
      "p",
      { class: "facts" },
      `${count(s.messages)} messages kept (${bytes(s.bytes)}); next seq ${count(s.next_seq)}; `,
      `${count(s.scheduled.messages)} delayed, not due yet. `,
      s.scheduled.unreadable ? `${count(s.scheduled.unreadable)} delayed unreadable (a damaged schedule file: see the broker's log). ` : null,
      view && view.ordered ? link(["subjects", subject, "routes"], "Ordered: routes and partition owners") : null,
    ),
    el("h2", null, "Groups"),
    rows.length
      ? table(
          ["Group", "Mode", ...["Backlog", "In flight", "Retrying", "Dead", "Acked", "Oldest unacked"].map((h) => [{ class: "num" }, h]), "Consumers seen (60 s)", "Replay"],
          rows,
          { class: "groups" },
        )
      : el("p", { class: "quiet" }, "No group has pulled from this subject yet."),
  ];
  if (extra.error) {
    parts.push(refusal(extra.error, "History"));
  } else {
    const h = view.history;
    parts.push(
      el("h2", null, "Last hour"),
      el(
        "div",
        { class: "charts" },
        lineChart({
          title: "Messages per second",
          times: h.at,
          series: [
            { name: "in (stored)", values: h.in_per_s },
            { name: "out (acked)", values: h.out_per_s },
          ],
          format: rate,
        }),
        lineChart({
          title: "Backlog",
          times: h.at,
          series: h.backlog.map((b) => ({ name: b.group, values: b.values })),
          format: rate,
        }),
      ),
      el("p", { class: "quiet" }, `One sample every ${view.sample_interval_s} s, the last ${h.at.length} shown.`),
    );
  }
  return el("section", null, ...parts);
}


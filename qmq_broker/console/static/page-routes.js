// An ordered subject: its route table (logic ranges to partitions), each group's route
// version, each partition's owner (the consumer holding its partition lease), the history.

import { call, settle, subjectPath } from "./api.js";
import { age, el, link, refusal, table } from "./dom.js";

export const title = "Routes";

export async function render({ subject }) {
  const routes = await call(subjectPath(subject, "routes"));
  const extra = await settle(`/v1/console/subjects/${encodeURIComponent(subject)}`);
  const groups = routes.groups.map((g) => g.group);
  const owners = new Map();
  for (const o of extra.value ? extra.value.partitions : []) owners.set(`${o.group}\u0000${o.partition}`, o);
  const owner = (group, partition) => {
    const found = owners.get(`${group}\u0000${partition}`);
    if (!found) return el("span", { class: "quiet" }, "free");
    return el("span", null, el("code", null, found.consumer), el("span", { class: "note" }, ` ${age(found.lease_left_s)} left`));
  };
  const ranges = routes.ranges.map((r) =>
    el(
      "tr",
      { data: { partition: String(r.partition) } },
      el("td", { class: "num" }, `${r.lo}–${r.hi - 1}`),
      el("td", { class: "num", data: { col: "partition" } }, String(r.partition)),
      groups.map((g) => el("td", { data: { col: "owner", group: g } }, owner(g, r.partition))),
    ),
  );
  return el(
    "section",
    null,
    el("h1", null, "Routes of ", link(["subjects", subject], el("code", null, subject))),
    el("p", { class: "facts" }, `Route version ${routes.version}; ${routes.logic_partitions} logic partitions; dead letters ${routes.on_dead === "block" ? "block their partition" : "are skipped"}.`),
    el("h2", null, "Current ranges and owners"),
    table([[{ class: "num" }, "Logic partitions"], [{ class: "num" }, "Partition"], ...groups.map((g) => `Owner in ${g}`)], ranges, { class: "ranges" }),
    extra.error ? refusal(extra.error, "Owners") : null,
    el("h2", null, "Groups"),
    groups.length
      ? table(["Group", [{ class: "num" }, "Route version"]], routes.groups.map((g) => [g.group, [{ class: "num" }, String(g.version)]]), { class: "route-groups" })
      : el("p", { class: "quiet" }, "No group has pulled yet."),
    el("h2", null, "History"),
    table(
      [[{ class: "num" }, "Version"], "Change", "Closed", "Ranges"],
      routes.history.map((v) => [
        [{ class: "num" }, String(v.version)],
        v.change,
        v.closed.length ? v.closed.join(", ") : "–",
        v.ranges.map((r) => `${r.lo}–${r.hi - 1} → ${r.partition}`).join("; "),
      ]),
      { class: "history" },
    ),
  );
}

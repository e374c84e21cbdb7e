// Reset a group to a position (replay from a seq or a time, or skip to the end), after a
// confirmation naming what will happen. The form's values live in the page state, so the
// refresh every 2 s keeps what was typed (and the focus).

import { call, settle, subjectPath } from "./api.js";
import { count, el, link, refusal } from "./dom.js";

export const title = "Reset group";

const KINDS = [
  ["earliest", "Earliest: every retained message again"],
  ["time", "From a time: the first message stored at or after it"],
  ["seq", "From a seq"],
  ["latest", "Latest: skip everything stored so far"],
];

function position(form) {
  if (form.kind === "seq") {
    const seq = Number(form.seq);
    return form.seq.trim() !== "" && Number.isInteger(seq) && seq >= 0 ? { seq } : null;
  }
  if (form.kind === "time") {
    const text = form.time.trim();
    return text ? { time: text } : null;
  }
  return form.kind;
}

function describe(to) {
  if (typeof to === "string") return to;
  return to.seq !== undefined ? `seq ${to.seq}` : `time ${to.time}`;
}

function field(state, name, attrs) {
  const input = el("input", {
    ...attrs,
    id: `reset-${name}`,
    name,
    value: state.form[name],
    oninput: (event) => {
      state.form[name] = event.target.value;
      state.caret = event.target.selectionStart;
    },
    onfocus: () => {
      state.focus = name;
    },
  });
  if (state.focus === name) {
    // The page is rebuilt every refresh: put the caret back where it was once it is shown.
    setTimeout(() => {
      if (!input.isConnected) return;
      input.focus();
      if (state.caret !== undefined && input.setSelectionRange) input.setSelectionRange(state.caret, state.caret);
    }, 0);
  }
  return input;
}

export async function render({ subject, group }, state, refresh) {
  state.form ||= { kind: "earliest", seq: "", time: "", partition: "", force: false };
  const form = state.form;
  const head = el("h1", null, "Reset ", el("code", null, group), " on ", link(["subjects", subject], el("code", null, subject)));
  const detail = await settle(subjectPath(subject));
  if (detail.error) return el("section", null, head, refusal(detail.error, "Subject"));
  const found = detail.value.groups.find((g) => g.group === group);
  if (!found) return el("section", null, head, el("p", { class: "quiet" }, "No such group on this subject."));

  const parts = [
    head,
    el(
      "p",
      { class: "facts" },
      `Mode ${found.mode}; backlog ${count(found.backlog)}; in flight ${count(found.in_flight)}; `,
      `retrying ${count(found.retrying)}; dead ${count(found.dead)}. `,
      "Leases, retries and dead letters at or after the new position go: those messages are delivered again from there.",
    ),
  ];
  const choices = el(
    "fieldset",
    { class: "reset-to" },
    el("legend", null, "Move the group to"),
    KINDS.map(([kind, label]) =>
      el(
        "label",
        { class: "choice" },
        el("input", {
          type: "radio",
          name: "kind",
          value: kind,
          checked: form.kind === kind,
          onchange: () => {
            form.kind = kind;
            state.confirming = null;
            refresh();
          },
        }),
        ` ${label}`,
      ),
    ),
    form.kind === "seq" ? el("label", null, "Seq ", field(state, "seq", { type: "text", inputmode: "numeric", autocomplete: "off" })) : null,
    form.kind === "time" ? el("label", null, "Time (RFC 3339) ", field(state, "time", { type: "text", placeholder: "2026-11-28T09:00:00Z", autocomplete: "off" })) : null,
  );
  const options = el(
    "div",
    { class: "reset-options" },
    el("label", null, "Partition (ordered subjects; empty: all) ", field(state, "partition", { type: "text", inputmode: "numeric", autocomplete: "off" })),
    el(
      "label",
      null,
      el("input", {
        type: "checkbox",
        id: "reset-force",
        checked: form.force,
        onchange: (event) => {
          form.force = event.target.checked;
        },
      }),
      " Force: drop the messages leased out now (their acks then answer unknown)",
    ),
  );
  parts.push(choices, options);

  const ask = () => {
    const to = position(form);
    if (to === null) {
      state.notice = { ok: false, error: { code: "invalid_to", message: form.kind === "seq" ? "give a seq (a whole number)" : "give a time" } };
      refresh();
      return;
    }
    state.notice = null;
    state.confirming = { to, force: form.force, partition: form.partition.trim() };
    refresh();
  };
  const confirmReset = async () => {
    const { to, force, partition } = state.confirming;
    const body = { to, force };
    if (partition !== "") body.partition = Number(partition);
    state.confirming = null;
    try {
      const answer = await call(subjectPath(subject, "groups", group, "reset"), { method: "POST", body });
      const seqs = answer.positions.map((p) => (p.partition !== null ? `partition ${p.partition}: ${p.seq}` : p.consumer !== null ? `${p.consumer}: ${p.seq}` : `${p.seq}`));
      state.notice = { ok: true, text: `Reset to ${describe(to)}: next seq ${seqs.join(", ")}; ${answer.dropped_leases} leases dropped.` };
    } catch (error) {
      if (error.status === 401) throw error;
      state.notice = { ok: false, error };
    }
    await refresh();
  };
  if (state.confirming) {
    const c = state.confirming;
    parts.push(
      el(
        "div",
        { class: "confirm", role: "alertdialog", "aria-label": "confirm the reset" },
        el("p", null, `Reset group ${group} on ${subject} to ${describe(c.to)}${c.partition !== "" ? ` (partition ${c.partition})` : ""}${c.force ? ", dropping its leases" : ""}? Its messages from there are delivered again.`),
        el(
          "div",
          { class: "actions" },
          el("button", { type: "button", id: "reset-confirm", onclick: confirmReset }, "Confirm reset"),
          el("button", { type: "button", id: "reset-cancel", onclick: () => { state.confirming = null; refresh(); } }, "Cancel"),
        ),
      ),
    );
  } else {
    parts.push(el("div", { class: "actions" }, el("button", { type: "button", id: "reset-group", onclick: ask }, "Reset group…")));
  }
  if (state.notice) {
    parts.push(state.notice.ok ? el("div", { class: "notice", role: "status" }, state.notice.text) : refusal(state.notice.error, "Reset refused"));
  }
  return el("section", null, ...parts);
}

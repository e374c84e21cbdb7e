// A small line chart drawn as SVG: a line per series over a shared time axis, gaps where a
// series had no value. Names go into text nodes (the legend), never into markup.

import { el, svg } from "./dom.js";

const WIDTH = 640;
const HEIGHT = 160;
const LEFT = 52;
const RIGHT = 8;
const TOP = 8;
const BOTTOM = 22;
const PALETTE = 8; // CSS classes s0..s7

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (value <= step * power) return step * power;
  }
  return 10 * power;
}

function clock(ms) {
  return new Date(ms).toISOString().slice(11, 19);
}

/** ``lineChart({title, times: [rfc3339], series: [{name, values}], format})`` */
export function lineChart({ title, times, series, format = String }) {
  const at = times.map((t) => Date.parse(t));
  const figure = el("figure", { class: "chart" }, el("figcaption", null, title));
  if (at.length < 2) {
    figure.append(el("p", { class: "quiet" }, "Not enough samples yet."));
    return figure;
  }
  const t0 = at[0];
  const span = Math.max(at[at.length - 1] - t0, 1);
  const peak = niceMax(Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v !== null))));
  const x = (t) => LEFT + ((t - t0) / span) * (WIDTH - LEFT - RIGHT);
  const y = (v) => TOP + (1 - v / peak) * (HEIGHT - TOP - BOTTOM);
  const plot = svg("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, class: "plot", role: "img", "aria-label": title });
  for (const fraction of [0, 0.5, 1]) {
    const level = y(peak * fraction);
    plot.append(svg("line", { class: "grid", x1: LEFT, x2: WIDTH - RIGHT, y1: level, y2: level }));
    plot.append(svg("text", { class: "axis", x: LEFT - 6, y: level + 4, "text-anchor": "end" }, format(peak * fraction)));
  }
  plot.append(svg("text", { class: "axis", x: LEFT, y: HEIGHT - 6 }, clock(t0)));
  plot.append(svg("text", { class: "axis", x: WIDTH - RIGHT, y: HEIGHT - 6, "text-anchor": "end" }, `${clock(at[at.length - 1])} UTC`));
  series.forEach((one, index) => {
    let points = [];
    const flush = () => {
      if (points.length === 1) points.push(points[0]); // a lone sample still shows
      if (points.length) plot.append(svg("polyline", { class: `line s${index % PALETTE}`, points: points.join(" ") }));
      points = [];
    };
    one.values.forEach((value, i) => {
      if (value === null || value === undefined) flush();
      else points.push(`${x(at[i]).toFixed(1)},${y(value).toFixed(1)}`);
    });
    flush();
  });
  figure.append(plot);
  figure.append(
    el(
      "div",
      { class: "legend" },
      series.map((one, index) => el("span", { class: "key" }, el("span", { class: `swatch s${index % PALETTE}` }), one.name)),
    ),
  );
  return figure;
}

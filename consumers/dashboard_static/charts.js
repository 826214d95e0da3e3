// Line charts with uPlot (vendored, global `uPlot`), coloured from the page's CSS variables so
// that they follow the light or dark scheme.

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// A column's unit from its name's suffix: seconds, milliseconds, bytes, tokens, counts.
const UNITS = [
  [/(^|_)(s|sec|secs|seconds)$/i, "s"],
  [/(^|_)(ms|millis|milliseconds)$/i, "ms"],
  [/(^|_)(us|micros)$/i, "µs"],
  [/(^|_)(ns|nanos)$/i, "ns"],
  [/(^|_)bytes$/i, "bytes"],
  [/(^|_)tokens$/i, "tokens"],
  [/(^n$|^n_|_n$|(^|_)(count|num|total)$|^count|^num_)/i, "count"],
];

export function unitOf(name) {
  const hit = UNITS.find(([pattern]) => pattern.test(name));
  return hit ? hit[1] : null;
}

function magnitude(values) {
  const finite = values.filter((v) => typeof v === "number" && Number.isFinite(v) && v !== 0).map(Math.abs);
  return finite.length ? Math.log10(Math.max(...finite)) : null;
}

// The y axes of series ``names`` (with their ``columns`` of values): one per unit. A named unit
// (a suffix, see UNITS) is its own axis; columns without one share an axis with those of the
// same order of magnitude (their largest values within 100 times of each other), so a column
// in the millions does not flatten one in the units. Returns [{label, names}] in first-seen order.
export function unitAxes(names, columns) {
  const axes = [];
  names.forEach((name, i) => {
    const unit = unitOf(name);
    const mag = magnitude(columns[i]);
    let axis = unit
      ? axes.find((a) => a.unit === unit)
      : axes.find((a) => a.unit === null && (a.mag === null || mag === null || Math.abs(a.mag - mag) < 2));
    if (!axis) {
      axis = { unit, mag, names: [] };
      axes.push(axis);
    }
    if (axis.mag === null) axis.mag = mag;
    axis.names.push(name);
  });
  return axes.map((a) => ({ label: a.unit ?? a.names.join(", "), names: a.names }));
}

// data: [xs, ys1, ys2, ...]; names: one per y series. xTime: x is Unix seconds. axes: as
// unitAxes gives them (default: one axis for all); the first is on the left, the next on the
// right, and so on, each series drawn on its own axis's scale.
export function lineChart(container, title, data, names, { xTime = true, xLabel = "", axes = null } = {}) {
  container.replaceChildren();
  const width = Math.max(280, container.clientWidth - 8);
  const axis = { stroke: css("--muted"), grid: { stroke: css("--line") }, ticks: { stroke: css("--line") } };
  const colours = ["--series-1", "--series-2", "--series-3", "--series-4"].map(css);
  const groups = axes && axes.length > 1 ? axes : [{ label: "", names }];
  const scaleOf = (name) => `y${Math.max(0, groups.findIndex((g) => g.names.includes(name)))}`;
  const opts = {
    title, width, height: 220,
    scales: { x: { time: xTime }, ...Object.fromEntries(groups.map((_, i) => [`y${i}`, { auto: true }])) },
    axes: [{ ...axis, label: xLabel }, ...groups.map((g, i) => ({
      ...axis, scale: `y${i}`, label: groups.length > 1 ? g.label : undefined, side: i % 2 ? 1 : 3,
      size: groups.length > 1 ? 80 : 50, // room for the label beside values in the millions
      grid: i ? { show: false } : axis.grid,
    }))],
    series: [
      { label: xLabel || (xTime ? "time" : "x") },
      ...names.map((name, i) => ({ label: name, stroke: colours[i % colours.length], width: 2, scale: scaleOf(name),
        points: { show: data[0].length < 40 }, spanGaps: false })),
    ],
  };
  container.dataset.yAxes = String(groups.length);
  container.dataset.yScales = JSON.stringify(names.map(scaleOf));
  const xs = data[0].filter((x) => x !== null);
  if (xs.length && Math.min(...xs) === Math.max(...xs)) {
    // One x value leaves uPlot no range (it spans years on a time axis): a fixed one around it.
    const pad = xTime ? 60 : 1;
    opts.scales.x = { time: xTime, auto: false, range: [xs[0] - pad, xs[0] + pad] };
  }
  if (!data[0].length) {
    container.append(Object.assign(document.createElement("p"), { className: "muted", textContent: `${title}: no data yet` }));
    return null;
  }
  return new uPlot(opts, data, container); // eslint-disable-line no-undef
}

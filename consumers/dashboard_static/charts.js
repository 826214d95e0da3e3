// Line charts with uPlot (vendored, global `uPlot`), coloured from the page's CSS variables so
// that they follow the light or dark scheme.

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// data: [xs, ys1, ys2, ...]; names: one per y series. xTime: x is Unix seconds.
export function lineChart(container, title, data, names, { xTime = true, xLabel = "" } = {}) {
  container.replaceChildren();
  const width = Math.max(280, container.clientWidth - 8);
  const axis = { stroke: css("--muted"), grid: { stroke: css("--line") }, ticks: { stroke: css("--line") } };
  const colours = ["--series-1", "--series-2", "--series-3", "--series-4"].map(css);
  const opts = {
    title, width, height: 220,
    scales: { x: { time: xTime } },
    axes: [{ ...axis, label: xLabel }, { ...axis }],
    series: [
      { label: xLabel || (xTime ? "time" : "x") },
      ...names.map((name, i) => ({ label: name, stroke: colours[i % colours.length], width: 2,
        points: { show: data[0].length < 40 }, spanGaps: false })),
    ],
  };
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

// charts.js: what the dashboard, the clock page and the lab's static report share: numbers, tables and
// uPlot charts. No build step and no imports: it defines one global, `TS`.
"use strict";
(function () {
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

  // Linear-interpolated percentile of a sorted array (numpy's default; twospeed.engine.request.percentile).
  function percentile(sorted, p) {
    if (!sorted.length) return null;
    const k = (sorted.length - 1) * p / 100, lo = Math.floor(k), hi = Math.min(lo + 1, sorted.length - 1);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (k - lo);
  }
  const sortNum = (xs) => Float64Array.from(xs.filter((x) => x !== null && x !== undefined)).sort();
  const sum = (xs) => xs.reduce((a, b) => a + (b || 0), 0);

  function ms(s) { return s === null || s === undefined ? "-" : (s * 1e3).toFixed(s < 0.01 ? 2 : 1); }
  function int(n) { return n === null || n === undefined ? "-" : Math.round(n).toLocaleString("en-US"); }
  function pct(x) { return x === null || x === undefined || !isFinite(x) ? "-" : (100 * x).toFixed(1) + "%"; }
  function usd(x) { return x === null || x === undefined ? "-" : "$" + x.toFixed(x < 1 ? 4 : 2); }
  function mib(bytes) { return bytes === null || bytes === undefined ? "-" : (bytes / 1048576).toFixed(1); }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "class") e.className = v; else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c instanceof Node ? c : String(c));
    return e;
  }

  // A table: columns [{title, key(row) -> text, value(row) -> number (data-value, for tests), attrs(row)}].
  function table(columns, rows, rowAttrs) {
    const head = el("tr", {}, ...columns.map((c) => el("th", {title: c.help || null}, c.title)));
    const body = rows.map((r) => el("tr", rowAttrs ? rowAttrs(r) : {}, ...columns.map((c) => {
      const v = c.value ? c.value(r) : null;
      return el("td", {"data-col": c.id || null, "data-value": v === null || v === undefined ? null : String(v)},
                c.key(r));
    })));
    return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
  }

  // uPlot line charts that keep their object between updates (setData), sized to their box.
  class Chart {
    constructor(box, title, opts) {
      this.box = box; this.title = title; this.opts = opts; this.plot = null; this.key = "";
    }
    // series: [{label, values, color, dash}]; x: array. Rebuilt when the series change, else setData.
    update(x, series, xTime) {
      const key = series.map((s) => s.label).join("|");
      const data = [x, ...series.map((s) => s.values)];
      if (this.plot && key === this.key) { this.plot.setData(data); return; }
      if (this.plot) this.plot.destroy();
      this.box.textContent = "";
      this.key = key;
      const width = Math.max(320, this.box.clientWidth || 480);
      const o = this.opts || {};
      this.plot = new uPlot({
        title: this.title, width, height: o.height || 220, scales: {x: {time: !!xTime, distr: o.logx ? 3 : 1},
                                                                      y: {range: o.yrange || null}},
        axes: [{label: o.xlabel || null}, {label: o.ylabel || null, size: 60}],
        series: [{}, ...series.map((s, i) => ({label: s.label, stroke: s.color || PALETTE[i % PALETTE.length],
                                               dash: s.dash || null, width: 1.5, points: {show: !!o.points},
                                               paths: o.stepped ? uPlot.paths.stepped({align: 1}) : undefined}))],
        legend: {live: true},
      }, data, this.box);
    }
  }

  // A CDF per group on one x (seconds, log axis): [{label, values}] -> merged x and one y series per group.
  function cdfSeries(groups) {
    const xs = sortNum(groups.flatMap((g) => g.values)).filter((x) => x > 0);
    const uniq = Array.from(new Set(xs));
    const series = groups.map((g) => {
      const v = sortNum(g.values);
      let j = 0;
      return {label: g.label, values: uniq.map((x) => { while (j < v.length && v[j] <= x) j++; return v.length ? j / v.length : null; })};
    });
    return {x: uniq, series};
  }

  window.TS = {PALETTE, percentile, sortNum, sum, ms, int, pct, usd, mib, el, table, Chart, cdfSeries};
})();

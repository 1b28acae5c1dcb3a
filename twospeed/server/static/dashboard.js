// dashboard.js: the live page. Polls data?since=T every second (the server's history: steps, inter-token gaps,
// ended sequences, totals since start, the load), keeps the last 15 minutes here, and redraws every panel.
// A panel whose data has not got the fields it needs (speculation, the step cost model) is left out.
// The lab's static report runs the same code on one document it embeds (window.TWOSPEED_STATIC).
"use strict";
(function () {
  const {percentile, sortNum, sum, ms, int, pct, usd, mib, el, table, Chart, cdfSeries} = TS;
  const KEEP_S = 900;
  const S = {now: 0, lanes: [], config: {}, totals: {}, slo: {}, load: {}, requests: [], gaps: {t: [], lane: [], gap: []},
             steps: {t: []}, updates: 0};
  const charts = {};
  window.TWOSPEED_STATE = S;  // for a console (and the browser test)
  const $ = (id) => document.getElementById(id);

  // -- data -------------------------------------------------------------------------------------------------
  function merge(d) {
    for (const [k, v] of Object.entries(d.steps)) (S.steps[k] = S.steps[k] || new Array(S.steps.t.length - v.length).fill(null)).push(...v);
    for (const k of ["t", "lane", "gap"]) S.gaps[k].push(...d.gaps[k]);
    S.requests.push(...d.requests);
    Object.assign(S, {now: d.now, lanes: d.lanes, config: d.config, totals: d.totals, slo: d.slo, load: d.load,
                      replicas: d.replicas || null});
    trim(S.now - KEEP_S);
    S.updates++;
  }

  function trim(cutoff) {
    const cut = (cols) => { let i = 0; while (i < cols.t.length && cols.t[i] < cutoff) i++; if (i) for (const k in cols) cols[k].splice(0, i); };
    cut(S.steps); cut(S.gaps);
    S.requests = S.requests.filter((r) => r.t >= cutoff);
  }

  function windowSeconds() { return Number($("window").value); }

  function lanesShown() {
    return Array.from(new Set([...Object.keys(S.config.lanes || {}), ...S.lanes])).sort();
  }

  // -- per-lane numbers over the window ----------------------------------------------------------------------
  function laneStats(cutoff) {
    const out = {};
    for (const lane of lanesShown()) {
      const recs = S.requests.filter((r) => r.lane === lane && r.t >= cutoff && !r.aborted && r.ttft !== null);
      const gaps = [];
      for (let i = 0; i < S.gaps.t.length; i++) if (S.gaps.lane[i] === lane && S.gaps.t[i] >= cutoff) gaps.push(S.gaps.gap[i]);
      const q = (key, p) => percentile(sortNum(recs.map((r) => r[key])), p);
      const judged = recs.filter((r) => r.met !== null), missed = judged.filter((r) => !r.met);
      const causes = {};
      for (const r of missed) causes[r.cause] = (causes[r.cause] || 0) + 1;
      const itl = sortNum(gaps);
      out[lane] = {lane, n: recs.length, recs, gaps,
                   ttft_p50: q("ttft", 50), ttft_p99: q("ttft", 99), queue_p50: q("queue", 50), queue_p99: q("queue", 99),
                   prefill_p99: q("prefill", 99), tpot_p50: q("tpot", 50), itl_p50: percentile(itl, 50),
                   itl_p99: percentile(itl, 99), judged: judged.length, missed: missed.length, causes};
    }
    return out;
  }

  const CAUSE_SPEED = {queue: "prefill side (queue)", prefill: "prefill", decode_interference: "decode (interference)",
                       decode: "decode", preemption: "preemption (KV)"};

  // Which speed hurts: the lane's most common miss cause, else the larger share of its median request.
  function verdictLine(s) {
    if (!s.n) return `${s.lane}: no requests in the window`;
    if (s.missed) {
      const [cause, n] = Object.entries(s.causes).sort((a, b) => b[1] - a[1])[0];
      return `${s.lane}: ${pct(s.missed / s.judged)} missed its SLO, mostly ${CAUSE_SPEED[cause] || cause} (${n} of ${s.missed})`;
    }
    const pre = sum(s.recs.map((r) => r.ttft)), all = sum(s.recs.map((r) => r.ttlt));
    const slo = s.judged ? "every request met its SLO; " : "";
    return `${s.lane}: ${slo}time to first token is ${pct(all ? pre / all : null)} of the response time (the rest is decode)`;
  }

  // -- panels -------------------------------------------------------------------------------------------------
  function renderLanes(stats) {
    const rows = Object.values(stats);
    $("verdicts").replaceChildren(...rows.map((s) => el("li", {"data-lane": s.lane}, verdictLine(s))));
    const c = (id, title, f, help) => ({id, title, help, key: (s) => ms(s[f]), value: (s) => s[f]});
    $("lanes").replaceChildren(table([
      {id: "lane", title: "lane", key: (s) => s.lane}, {id: "n", title: "seqs", key: (s) => int(s.n), value: (s) => s.n},
      c("ttft_p50", "TTFT p50 ms", "ttft_p50"), c("ttft_p99", "TTFT p99 ms", "ttft_p99"),
      c("queue_p50", "queue p50", "queue_p50"), c("queue_p99", "queue p99", "queue_p99"),
      c("prefill_p99", "prefill p99", "prefill_p99"), c("itl_p50", "ITL p50 ms", "itl_p50"),
      c("itl_p99", "ITL p99 ms", "itl_p99"), c("tpot_p50", "TPOT p50", "tpot_p50"),
    ], rows, (s) => ({"data-lane": s.lane})));
    const cdf = (key, values) => {
      const {x, series} = cdfSeries(rows.map((s) => ({label: s.lane, values: values(s).map((v) => v * 1e3)})));
      chart(key, key === "ttft_cdf" ? "TTFT CDF per lane (ms)" : "ITL CDF per lane (ms)", {logx: true, yrange: [0, 1], xlabel: "ms"})
        .update(x, series, false);
    };
    cdf("ttft_cdf", (s) => s.recs.map((r) => r.ttft));
    cdf("itl_cdf", (s) => s.gaps);
  }

  function chart(id, title, opts) {
    if (!charts[id]) { const box = el("div", {class: "chart", id: "chart-" + id}); $("charts-" + (opts.group || "lanes")).append(box); charts[id] = new Chart(box, title, opts); }
    return charts[id];
  }

  function renderSteps(cutoff) {
    const st = S.steps, idx = [];
    for (let i = 0; i < st.t.length; i++) if (st.t[i] >= cutoff) idx.push(i);
    const col = (k) => idx.map((i) => (st[k] ? st[k][i] : null));
    const x = col("t");
    const kinds = [{label: "prefill", values: col("num_prefill_tokens")}, {label: "decode", values: col("num_decode_tokens")}];
    if (st.prefill_budget && col("prefill_budget").some((v) => v))  // the scheduler's prompt share beside decodes
      kinds.push({label: "prefill budget", values: col("prefill_budget"), dash: [4, 3]});
    chart("tokens", "tokens per step by kind", {group: "steps", points: x.length < 200}).update(x, kinds, true);
    const has = (k) => !!st[k];  // the lab's static report has tokens per step only
    if (!has("step_time")) return {prefill_tps: null, decode_tps: null, steps: idx.length, errors: null};
    const series = [{label: "step ms", values: col("step_time").map((v) => v * 1e3)}];
    if (st.predicted_time && col("predicted_time").some((v) => v !== null))
      series.push({label: "predicted ms", values: col("predicted_time").map((v) => (v === null ? null : v * 1e3)), dash: [4, 3]});
    const target = st.target_time && col("target_time").some((v) => v) ? col("target_time") : null;
    if (target || S.config.step_target_s)
      series.push({label: "target ms", values: (target || x.map(() => S.config.step_target_s)).map((v) => (v ? v * 1e3 : null)), dash: [8, 4]});
    chart("step_time", "step time (ms)", {group: "steps"}).update(x, series, true);
    let pre = 0;
    chart("load", "running / waiting sequences, preemptions (cumulative)", {group: "steps", stepped: true}).update(x, [
      {label: "running", values: col("num_running")}, {label: "waiting", values: col("num_waiting")},
      {label: "preempted", values: col("num_preempted").map((v) => (pre += v || 0))}], true);
    const blocks = S.config.num_blocks || 1;
    chart("kv", "KV pool: in use and cached prefixes (share of blocks)", {group: "steps", yrange: [0, 1]}).update(x, [
      {label: "in use", values: col("kv_blocks_used").map((v) => v / blocks)},
      {label: "cached prefixes", values: col("kv_cached_blocks").map((v) => v / blocks)}], true);
    const span = Math.max(1e-9, Math.min(windowSeconds(), x.length ? S.now - x[0] : 0));
    return {prefill_tps: sum(col("num_prefill_tokens")) / span, decode_tps: sum(col("num_decode_tokens")) / span,
            steps: idx.length, errors: costErrors(col)};
  }

  function costErrors(col) {
    const p = col("predicted_time"), m = col("step_time");
    const e = sortNum(p.map((v, i) => (v === null || !m[i] ? null : Math.abs(v - m[i]) / m[i])));
    return e.length ? {p50: percentile(e, 50), p99: percentile(e, 99)} : null;
  }

  function tile(id, label, text, value) {
    return el("div", {class: "tile", id: "tile-" + id, "data-value": value === null || value === undefined ? null : String(value)},
              el("div", {class: "v"}, text), el("div", {class: "l"}, label));
  }

  function renderKV(rates) {
    const cfg = S.config, load = S.load, tot = Object.values(S.totals);
    const queries = sum(tot.map((t) => t.prefix_queries)), hits = sum(tot.map((t) => t.prefix_hits));
    const cachedBytes = load.cached_blocks * cfg.kv_bytes_per_block;
    const running = sum(Object.values(load.running || {})), waiting = sum(Object.values(load.waiting || {}));
    const tiles = [
      tile("kv_usage", "KV blocks in use", pct(load.kv_usage), load.kv_usage),
      tile("cached_blocks", `blocks held by cached prefixes (${pct(load.cached_blocks / cfg.num_blocks)} of the pool)`,
           int(load.cached_blocks), load.cached_blocks),
      tile("cached_mib", "MiB held by cached prefixes", mib(cachedBytes), cachedBytes),
      tile("hit_rate", "prefix hit rate (prompt tokens, since start)", pct(queries ? hits / queries : null), queries ? hits / queries : null),
      tile("running", "running now", int(running), running), tile("waiting", "waiting now", int(waiting), waiting),
      tile("prefill_tps", "prefill tokens/s (window)", int(rates.prefill_tps), rates.prefill_tps),
      tile("decode_tps", "decode tokens/s (window)", int(rates.decode_tps), rates.decode_tps),
    ];
    if (rates.errors) tiles.push(tile("cost_error", "step cost model |error| p50 / p99 (window)",
                                      `${pct(rates.errors.p50)} / ${pct(rates.errors.p99)}`, rates.errors.p99));
    $("tiles").replaceChildren(...tiles);
  }

  function money(b, price) {
    return ((b.prefilled_tokens || 0) * price.input + (b.cached_tokens || 0) * price.cached_input +
            (b.output_tokens || 0) * price.output) / 1e6;
  }

  const BILL = [["prompt_tokens", "prompt"], ["cached_tokens", "cached"], ["prefilled_tokens", "prefilled"],
                ["recomputed_tokens", "recomputed"], ["output_tokens", "output"], ["forced_tokens", "forced"],
                ["spec_proposed", "spec proposed"], ["spec_accepted", "spec accepted"], ["spec_rejected", "spec rejected"],
                ["goodput_tokens", "goodput"]];

  function renderBill() {
    const price = S.config.price_per_m || {input: 0, cached_input: 0, output: 0};
    const lanes = Object.keys(S.totals).sort();
    const rows = lanes.map((l) => ({lane: l, ...S.totals[l]}));
    const all = {lane: "all"};
    for (const r of rows) for (const [k, v] of Object.entries(r)) if (k !== "lane") all[k] = (all[k] || 0) + v;
    rows.push(all);
    const cols = [{id: "lane", title: "lane", key: (r) => r.lane}];
    for (const [k, title] of BILL) if (rows.some((r) => k in r) && (!k.startsWith("spec_") || rows.some((r) => r[k])))
      cols.push({id: k, title, key: (r) => int(r[k] || 0), value: (r) => r[k] || 0});
    if (rows.some((r) => r.spec_proposed))
      cols.push({id: "spec_acceptance", title: "spec acceptance", key: (r) => pct(r.spec_proposed ? r.spec_accepted / r.spec_proposed : null),
                 value: (r) => (r.spec_proposed ? r.spec_accepted / r.spec_proposed : null)});
    cols.push({id: "usd", title: "cost", key: (r) => usd(money(r, price)), value: (r) => money(r, price)});
    cols.push({id: "good_usd", title: "cost per 1k goodput tokens",
               key: (r) => (r.goodput_tokens ? usd(1000 * money(r, price) / r.goodput_tokens) : "-")});
    $("bill").replaceChildren(table(cols, rows, (r) => ({"data-lane": r.lane})));
    $("price").textContent = `price per 1M tokens: input $${price.input}, cached input $${price.cached_input}, output $${price.output}` +
      (price.input || price.output ? "" : " (set with --price INPUT,CACHED,OUTPUT)");
  }

  const CAUSES = ["queue", "prefill", "decode_interference", "decode", "preemption"];

  function renderSLO(stats) {
    const lanes = lanesShown();
    const rows = lanes.map((l) => {
      const c = S.slo[l] || {}, judged = sum(Object.values(c)), w = stats[l] || {judged: 0, missed: 0};
      const objectives = ((S.config.lanes || {})[l] || {}).objectives || [];
      return {lane: l, judged, met: c.met || 0, c, w, objectives: objectives.map((o) => `${o.name} < ${ms(o.threshold_s)} ms`).join(", ")};
    });
    $("slo").replaceChildren(table([
      {id: "lane", title: "lane", key: (r) => r.lane}, {id: "objectives", title: "objectives", key: (r) => r.objectives || "none"},
      {id: "attainment", title: "met (since start)", key: (r) => pct(r.judged ? r.met / r.judged : null), value: (r) => (r.judged ? r.met / r.judged : null)},
      {id: "window", title: "met (window)", key: (r) => pct(r.w.judged ? 1 - r.w.missed / r.w.judged : null)},
      ...CAUSES.map((k) => ({id: k, title: `missed: ${k.replace("_", " ")}`, key: (r) => int(r.c[k] || 0), value: (r) => r.c[k] || 0})),
    ], rows, (r) => ({"data-lane": r.lane})));
  }

  function renderRequests() {
    const price = S.config.price_per_m || {input: 0, cached_input: 0, output: 0};
    const recent = S.requests.slice(-50).reverse();
    const spec = recent.some((r) => r.bill.spec_proposed);
    const cols = [
      {title: "id", key: (r) => r.id}, {title: "lane", key: (r) => r.lane}, {title: "end", key: (r) => r.finish_reason || "-"},
      {title: "cached+prefilled", key: (r) => `${int(r.bill.cached_tokens)}+${int(r.bill.prefilled_tokens)}`},
      {title: "output (forced)", key: (r) => `${int(r.bill.output_tokens)} (${int(r.bill.forced_tokens)})`},
      ...(spec ? [{title: "spec accepted/proposed", key: (r) => `${int(r.bill.spec_accepted)}/${int(r.bill.spec_proposed)}`}] : []),
      {title: "queue ms", key: (r) => ms(r.queue)},
      ...(recent.some((r) => r.route !== null && r.route !== undefined)  // behind a router: the hop, inside queue
        ? [{title: "route ms", key: (r) => ms(r.route)}, {title: "replica", key: (r) => r.replica || "-"}] : []),
      {title: "prefill ms", key: (r) => ms(r.prefill)},
      {title: "TTFT ms", key: (r) => ms(r.ttft)}, {title: "ITL p50/p99 ms", key: (r) => `${ms(r.itl_p50)} / ${ms(r.itl_p99)}`},
      {title: "TPOT ms", key: (r) => ms(r.tpot)}, {title: "TTLT ms", key: (r) => ms(r.ttlt)},
      {title: "decode steps (interfered)", key: (r) => `${int(r.decode_steps)} (${int(r.interfered_steps)})`},
      {title: "preempted", key: (r) => int(r.preemptions)},
      {title: "SLO", key: (r) => (r.met === null ? "-" : r.met ? "met" : `missed: ${r.cause}`)},
      {title: "cost", key: (r) => usd(money(r.bill, price))},
    ];
    $("requests").replaceChildren(table(cols, recent, (r) => ({"data-id": r.id, class: r.met === false ? "miss" : null})));
  }

  // Behind a router (twospeed serve --replicas N): each replica's state as the router sees it, what was routed
  // there and why, and the route time and TTFT of the sequences it served in the window.
  function renderReplicas(cutoff) {
    $("replicas-section").hidden = !S.replicas;
    if (!S.replicas) return;
    const rows = S.replicas.map((r) => {
      const recs = S.requests.filter((q) => q.replica === r.name && q.t >= cutoff && !q.aborted && q.ttft !== null);
      const q = (key, p) => percentile(sortNum(recs.map((x) => x[key]).filter((v) => v !== null && v !== undefined)), p);
      return {...r, n: recs.length, route_p50: q("route", 50), route_p99: q("route", 99), ttft_p50: q("ttft", 50),
              routed_total: sum(Object.values(r.routed))};
    });
    const reasons = Array.from(new Set(rows.flatMap((r) => Object.keys(r.routed)))).sort();
    $("replicas").replaceChildren(table([
      {id: "name", title: "replica", key: (r) => r.name}, {id: "up", title: "state", key: (r) => (r.up ? "up" : "down")},
      {id: "restarts", title: "restarts", key: (r) => int(r.restarts), value: (r) => r.restarts},
      {id: "in_flight", title: "in flight", key: (r) => int(r.in_flight), value: (r) => r.in_flight},
      {id: "running", title: "running", key: (r) => int(r.running), value: (r) => r.running},
      {id: "waiting", title: "waiting", key: (r) => int(r.waiting), value: (r) => r.waiting},
      {id: "kv_usage", title: "KV in use", key: (r) => pct(r.kv_usage), value: (r) => r.kv_usage},
      {id: "routed", title: "routed", key: (r) => int(r.routed_total), value: (r) => r.routed_total},
      ...reasons.map((k) => ({id: "routed_" + k, title: k.replace("_", " "), key: (r) => int(r.routed[k] || 0),
                              value: (r) => r.routed[k] || 0})),
      {id: "lost", title: "lost to a death", key: (r) => int(r.lost), value: (r) => r.lost},
      {id: "route_p50", title: "route p50 ms", key: (r) => ms(r.route_p50), value: (r) => r.route_p50},
      {id: "route_p99", title: "route p99 ms", key: (r) => ms(r.route_p99), value: (r) => r.route_p99},
      {id: "ttft_p50", title: "TTFT p50 ms", key: (r) => ms(r.ttft_p50), value: (r) => r.ttft_p50},
    ], rows, (r) => ({"data-replica": r.name, class: r.up ? null : "miss"})));
  }

  function render() {
    const cutoff = S.now - windowSeconds();
    const stats = laneStats(cutoff);
    renderLanes(stats);
    renderReplicas(cutoff);
    renderKV(renderSteps(cutoff));
    renderBill();
    renderSLO(stats);
    renderRequests();
    $("model").textContent = S.config.model || "";
    $("updated").textContent = new Date(S.now * 1000).toLocaleTimeString();
    document.body.dataset.updates = String(S.updates);
    document.body.dataset.now = String(S.now);
  }

  // -- polling --------------------------------------------------------------------------------------------------
  async function poll() {
    const since = S.now ? S.now : -windowSeconds();
    try {
      const r = await fetch(`dashboard/data?since=${since}`, {cache: "no-store", credentials: "same-origin"});
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      merge(await r.json());
      render();
      $("status").textContent = "live";
      $("status").className = "live";
    } catch (e) {
      $("status").textContent = `not updating: ${e.message}`;
      $("status").className = "stale";
    }
    if (!$("pause").checked) setTimeout(poll, 1000); else $("pause").onchange = () => { if (!$("pause").checked) poll(); };
  }

  window.addEventListener("DOMContentLoaded", () => {
    $("window").onchange = () => render();
    if (window.TWOSPEED_STATIC) {  // the lab's report: one finished run, no server
      merge(window.TWOSPEED_STATIC);
      const span = Math.max(60, Math.ceil(S.now - Math.min(S.now, ...S.requests.map((r) => r.arrival))));
      $("window").append(el("option", {value: String(span)}, "whole run"));
      $("window").value = String(span);
      render();
      $("status").textContent = "finished run";
      return;
    }
    poll();
  });
})();

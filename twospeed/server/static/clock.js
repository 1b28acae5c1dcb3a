// clock.js: twospeed's toy two-clocks model (twospeed/plan/clock.py) in the browser, term for term, so that the
// same inputs give the same numbers as `twospeed clock`. The server is asked for nothing but, when the toggle
// is on, its calibrated step costs (dashboard/costs), once.
"use strict";
(function () {
  const {ms, pct, el, table} = TS;
  // ToyClock's defaults (an 8B Llama in bf16 on one H100 SXM; plan/clock.py says how they were worked out).
  const TOY = {a: 5.3e-10, b: 3.2e-5, step: 4.8e-3, per_cached_token: 3.9e-8, prefill_fixed: 0};
  const KEYS = Object.keys(TOY);
  let live = null;  // the server's costs, once fetched
  const $ = (id) => document.getElementById(id);

  function parseCase(text) {
    const parts = text.replace("x", ":").split(":");
    const [p, o] = parts.map((x) => (/^\s*\d+\s*$/.test(x) ? parseInt(x, 10) : NaN));
    if (parts.length !== 2 || !Number.isInteger(p) || !Number.isInteger(o))
      throw new Error(`a case is PROMPT:OUTPUT token counts, e.g. 8000:50; got '${text}'`);
    if (p < 1 || o < 1) throw new Error(`prompt and output lengths must be >= 1, got '${text}'`);
    return [p, o];
  }

  // ToyClock.case: seconds of prefill, decode, the mean and the last inter-token gap.
  function clockCase(c, prompt, output) {
    const prefill = c.prefill_fixed + c.a * prompt * prompt + c.b * prompt;
    const steps = Math.max(0, output - 1);
    const cached = steps * prompt + steps * (steps + 1) / 2;
    const decode = steps * c.step + c.per_cached_token * cached;
    const itlLast = steps ? c.step + c.per_cached_token * (prompt + steps) : 0;
    const total = prefill + decode;
    return {prompt_tokens: prompt, output_tokens: output, prefill_s: prefill, decode_s: decode,
            itl_mean_s: steps ? decode / steps : 0, itl_last_s: itlLast, total_s: total,
            decode_share: total ? decode / total : 0};
  }

  function coefficients() {
    const c = {};
    for (const k of KEYS) {
      const v = Number($(k).value);
      if (!($(k).value.trim() !== "" && isFinite(v) && v >= 0)) throw new Error(`${k} must be a number >= 0`);
      c[k] = v;
    }
    return c;
  }

  function compute() {
    try {
      const c = coefficients();
      const cases = $("cases").value.trim().split(/[\s,]+/).filter(Boolean).map(parseCase).map(([p, o]) => clockCase(c, p, o));
      $("error").textContent = "";
      const col = (id, title, f) => ({id, title, key: (r) => f(r[id]), value: (r) => r[id]});
      $("out").replaceChildren(table([
        col("prompt_tokens", "prompt", (x) => x.toLocaleString("en-US")), col("output_tokens", "output", (x) => x.toLocaleString("en-US")),
        col("prefill_s", "prefill (~TTFT) ms", ms), col("decode_s", "decode ms", ms), col("itl_mean_s", "ITL mean ms", ms),
        col("itl_last_s", "ITL last ms", ms), col("total_s", "total ms", ms), col("decode_share", "decode share", pct),
      ], cases, (r) => ({"data-case": `${r.prompt_tokens}:${r.output_tokens}`})));
      const longest = Math.max(...cases.map((r) => r.total_s)) || 1;
      $("bars").replaceChildren(...cases.map((r) => el("div", {class: "bar"},
        el("span", {class: "lbl"}, `${r.prompt_tokens}:${r.output_tokens}`),
        el("span", {class: "pre", style: `width:${60 * r.prefill_s / longest}%`, title: "prefill"}),
        el("span", {class: "dec", style: `width:${60 * r.decode_s / longest}%`, title: "decode"}),
        el("span", {class: "lbl"}, ` ${ms(r.prefill_s)} + ${ms(r.decode_s)} ms`))));
      document.body.dataset.computed = String(Number(document.body.dataset.computed || 0) + 1);
    } catch (e) {
      $("error").textContent = e.message;
    }
  }

  function setCoefficients(c, source) {
    for (const k of KEYS) $(k).value = String(c[k] ?? 0);
    $("source").textContent = source;
    compute();
  }

  async function toggle() {
    if (!$("live").checked) { setCoefficients(TOY, "toy constants (plan/clock.py)"); return; }
    try {
      if (!live) live = await (await fetch("costs", {credentials: "same-origin"})).json();
      if (!live.available) throw new Error(live.reason);
      setCoefficients(live.toy, `${live.source}, ${live.observations ?? "?"} steps observed (fetched once)`);
    } catch (e) {
      $("live").checked = false;
      setCoefficients(TOY, `toy constants: ${e.message}`);
    }
  }

  window.addEventListener("DOMContentLoaded", () => {
    const q = new URLSearchParams(location.search);
    if (q.has("cases")) $("cases").value = q.get("cases");
    setCoefficients({...TOY, ...Object.fromEntries(KEYS.filter((k) => q.has(k)).map((k) => [k, Number(q.get(k))]))},
                    "toy constants (plan/clock.py)");
    for (const k of [...KEYS, "cases"]) $(k).oninput = compute;
    $("live").onchange = toggle;
  });
  window.TWOCLOCKS = {clockCase, parseCase, TOY};
})();

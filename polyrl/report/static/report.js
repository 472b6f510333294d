/* polyrl run report: curves drawn as inline SVG and a trajectory browser. No dependencies, works
 * from file://. Data comes as scripts: data/index.js calls polyrlIndex({...}) once; the trajectories
 * of a step are in data/step_NNNNNN.js, which calls polyrlStep(N, {...}) and is loaded on demand. */
(function () {
  "use strict";

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
  const ALL_COLOR = "#222";
  const SVGNS = "http://www.w3.org/2000/svg";
  const GROUP_PAGE = 20;   // groups rendered at once; "show more" adds another page
  const STEP_CACHE = 8;    // step files kept in memory
  const MAX_POINTS = 800;  // longer series are reduced to min/max per bucket

  let INDEX = null;
  const state = { step: null, env: null, filter: "all", shade: "adv", data: null, episode: null,
    groupsShown: GROUP_PAGE, advScale: 1 };
  const stepCache = new Map();
  const waiting = new Map();

  // ------------------------------------------------------------------------------------- helpers
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null || v === false) continue;
      if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat(Infinity)) {
      if (c != null && c !== false) node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }

  function fmt(v) {
    if (v == null || Number.isNaN(v)) return "–";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    return String(+v.toPrecision(3));
  }

  const color = (c) => (c == null || c < 0 ? ALL_COLOR : PALETTE[c % PALETTE.length]);
  const envColor = (env) => color(INDEX.envs.indexOf(env));
  const pad6 = (n) => String(n).padStart(6, "0");

  function textOf(content) {
    if (content == null) return "";
    if (typeof content === "string") return content;
    if (Array.isArray(content)) return content.map((p) => (typeof p === "string" ? p : p.text || `[${p.type}]`)).join("");
    return JSON.stringify(content);
  }

  // ------------------------------------------------------------------------------------- data loading
  window.polyrlIndex = function (index) {
    INDEX = index;
    start();
  };

  window.polyrlStep = function (step, data) {
    stepCache.set(step, data);
    while (stepCache.size > STEP_CACHE) stepCache.delete(stepCache.keys().next().value);
  };

  function loadStep(info) {
    if (stepCache.has(info.step)) return Promise.resolve(stepCache.get(info.step));
    if (waiting.has(info.step)) return waiting.get(info.step);
    const p = new Promise((resolve, reject) => {
      const tag = el("script", { src: `data/step_${pad6(info.step)}.js?v=${info.v}` });
      tag.onload = () => {
        tag.remove();
        stepCache.has(info.step) ? resolve(stepCache.get(info.step)) : reject(new Error("empty step file"));
      };
      tag.onerror = () => {
        tag.remove();
        reject(new Error(`could not load data/step_${pad6(info.step)}.js (rebuild with: polyrl report LOG_PATH)`));
      };
      document.body.append(tag);
    }).finally(() => waiting.delete(info.step));
    waiting.set(info.step, p);
    return p;
  }

  // ------------------------------------------------------------------------------------- page
  function start() {
    const run = INDEX.run;
    document.title = `${run.name} · polyrl report`;
    $("run-name").textContent = run.name;
    const done = run.last_step == null ? 0 : run.last_step + 1;
    const finished = run.finished != null ? run.finished : INDEX.checkpoints.some((c) => c.final);
    const sft = run.kind === "sft";
    document.body.dataset.kind = run.kind || "rl";
    const stalled = (INDEX.banners || []).some((b) => b.level === "bad");
    const badge = (finished ? "finished" : "in progress") + (stalled ? " · no update" : "");
    $("run-meta").replaceChildren(
      ...(sft ? [el("span", { class: "badge kind" }, "SFT")] : []),
      el("span", {}, run.model || ""),
      el("span", {}, `step ${done}${run.max_steps ? " / " + run.max_steps : ""}`),
      el("span", { id: "run-badge", class: stalled ? "badge bad" : finished ? "badge ok" : "badge" }, badge),
      el("span", { class: "muted", title: run.path }, `updated ${run.generated}`),
      ...wandbLink(run.wandb));
    $("trajectories").hidden = sft;  // SFT learns from given conversations: no episodes to browse
    document.querySelector('nav a[href="#trajectories"]').hidden = sft;
    $("env-legend").hidden = sft;
    for (const a of document.querySelectorAll("nav a")) {
      a.addEventListener("click", (ev) => {
        ev.preventDefault();
        $(a.getAttribute("href").slice(1)).scrollIntoView({ behavior: "smooth" });
      });
    }
    $("env-legend").replaceChildren(...INDEX.envs.map((e) =>
      el("span", { class: "chip" }, el("i", { style: `background:${envColor(e)}` }), e)),
    el("span", { class: "chip" }, el("i", { style: `background:${ALL_COLOR}` }), "all environments"));
    renderCharts();
    $("smooth-select").addEventListener("change", renderCharts);
    renderBanners();
    renderHeadline();
    renderConfigDiff();
    renderCheckpoints();
    $("config-json").textContent = JSON.stringify(INDEX.config, null, 2);
    window.polyrlReady = performance.now(); // charts drawn: what the load benchmark waits for
    document.body.dataset.ready = "charts";
    initBrowser();
  }

  // the run's W&B run: a link when it was logged online, its id and how to upload it when offline
  function wandbLink(w) {
    if (!w) return [];
    const label = `W&B ${w.project ? w.project + "/" : ""}${w.name || w.id}`;
    if (w.url) return [el("a", { id: "wandb-link", href: w.url, target: "_blank", rel: "noopener" }, label)];
    const how = w.dir ? `wandb sync ${w.dir}` : "wandb sync";
    return [el("span", { id: "wandb-link", class: "muted", title: `upload with: ${how}` },
      `${label} (offline run ${w.id})`)];
  }

  // ------------------------------------------------------------------------------------- first screen
  function renderBanners() {
    $("banners").replaceChildren(...(INDEX.banners || []).map((b) =>
      el("div", { class: `banner ${b.level}`, "data-kind": b.kind, role: "alert" },
        el("b", {}, b.title), el("p", {}, b.what), el("p", { class: "try" }, b.try))));
  }

  function duration(s) {
    if (s == null) return "–";
    if (s < 90) return `${Math.round(s)} s`;
    if (s < 5400) return `${Math.round(s / 60)} min`;
    return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  }

  const span = (a, b) => (a === b ? `step ${a}` : `steps ${a}–${b}`);

  // "start → end (+delta)" of a series averaged over the first and last steps
  function startEnd(v, percent, lowerIsBetter) {
    if (!v) return el("span", { class: "muted" }, "no data");
    const f = (x) => (percent ? `${Math.round(x * 100)}%` : fmt(x));
    const title = `mean of ${span(...v.start_steps)} → mean of ${span(...v.end_steps)}`;
    if (v.points < 2) return el("span", { title }, f(v.end), el("span", { class: "muted" }, " (one step)"));
    const d = v.end - v.start;
    const cls = Math.abs(d) < 1e-9 ? "delta" : (d > 0) !== !!lowerIsBetter ? "delta up" : "delta down";
    return el("span", { title }, `${f(v.start)}\u00a0→\u00a0${f(v.end)} `,
      el("span", { class: cls }, delta(d, f)));
  }

  const delta = (d, f) => (Math.abs(d) < 1e-9 ? "(±0)" : `(${d > 0 ? "+" : "−"}${f(Math.abs(d))})`);

  function firstLast(v, percent, note) {
    if (!v) return el("span", { class: "muted" }, note);
    const f = (x) => (percent ? `${Math.round(x * 100)}%` : fmt(x));
    const when = (s) => (s < 0 ? "before training" : `after step ${s}`);  // step -1: before the first step
    const title = `evaluation ${when(v.first_step)} → ${when(v.last_step)}`;
    if (v.points < 2) return el("span", { title }, f(v.last), el("span", { class: "muted" }, ` (one evaluation, ${when(v.last_step)})`));
    const d = v.last - v.first;
    const cls = Math.abs(d) < 1e-9 ? "delta" : d > 0 ? "delta up" : "delta down";
    return el("span", { title }, `${f(v.first)}\u00a0→\u00a0${f(v.last)} `, el("span", { class: cls }, delta(d, f)));
  }

  function statsLine(h) {
    const wall = h.wall_kind === "elapsed"
      ? ["wall time ", "real time from the run's start to its last logged step (pauses between relaunches not counted)"]
      : ["time in steps ", "the sum of every step's time/total (start-up and saving the last checkpoint not counted)"];
    return el("div", { class: "stats" },
      el("div", {}, el("span", { class: "muted" }, "steps done "), el("b", {}, `${h.steps_done}`), h.max_steps ? ` of ${h.max_steps}` : ""),
      el("div", { id: "wall-time", title: wall[1] }, el("span", { class: "muted" }, wall[0]), el("b", {}, duration(h.wall_s))));
  }

  function renderHeadline() {
    const h = INDEX.headline;
    if (!h) return;
    if (h.kind === "sft") return renderSftHeadline(h);
    const box = $("headline");
    const stats = statsLine(h);
    if (!h.steps_done) {
      box.replaceChildren(el("h2", {}, "Summary"), stats, el("p", { class: "muted" }, "No step logged yet."));
      return;
    }
    const metric = (h.rows.find((r) => r.held_out_metric) || {}).held_out_metric || "pass@1";
    const head = el("tr", {}, ["environment", "reward", "success", `held-out ${metric}`, "held-out reward",
      "cut at max_tokens"].map((t) => el("th", {}, t)));
    const note = "not evaluated";  // why: in the note under the table
    const rows = h.rows.map((r) => el("tr", { "data-env": r.env || "all" },
      el("td", {}, el("b", {}, r.env || "all environments"),
        r.success_def ? el("div", { class: "muted def" }, r.success_def) : null),
      el("td", { class: "num", "data-metric": "reward" }, startEnd(r.reward)),
      el("td", { class: "num", "data-metric": "success" }, startEnd(r.success, true)),
      el("td", { class: "num", "data-metric": "held_out" }, firstLast(r.held_out, true, note)),
      el("td", { class: "num", "data-metric": "held_out_reward" }, firstLast(r.held_out_reward, false, r.env ? note : "–")),
      el("td", { class: "num", "data-metric": "truncated" }, r.truncated
        ? `${Math.round(r.truncated.end * 100)}%` : el("span", { class: "muted" }, "no data"))));
    const first = h.rows.find((r) => r.reward);
    const how = first ? `reward and success: mean of ${span(...first.reward.start_steps)} → ` +
      `mean of ${span(...first.reward.end_steps)}` : "";
    const evals = h.eval_note ? h.eval_note : "held-out: the first → the last evaluation on the test splits";
    box.replaceChildren(el("h2", {}, "Summary"), stats,
      el("table", { class: "headline-table" }, el("thead", {}, head), el("tbody", {}, rows)),
      el("p", { class: "muted foot" }, [how, evals, "cut at max_tokens: share of episodes in the last steps"]
        .filter(Boolean).join(" · ")));
  }

  // a polyrl sft run: the loss per token at the start and the end, and what it learned from
  function renderSftHeadline(h) {
    const box = $("headline");
    const count = (n, what) => (n == null ? `${what}: count not recorded` : `${n} ${what}${n === 1 ? "" : "s"}`);
    const sources = (h.sources || []).map((s) => el("li", { "data-source": s.data != null ? "data" : "environment" },
      s.data != null
        ? [el("span", { class: "muted" }, "data file "), el("b", {}, s.data), ` · ${count(s.conversations, "conversation")}`]
        : [el("span", { class: "muted" }, "environment "), el("b", {}, s.environment),
          ` · ${count(s.demonstrations, "demonstration")}`]));
    const loss = h.loss;
    const how = loss ? `mean of ${span(...loss.start_steps)} → mean of ${span(...loss.end_steps)}` : "";
    box.replaceChildren(el("h2", {}, "Summary: supervised fine-tuning (polyrl sft)"), statsLine(h),
      h.steps_done
        ? el("div", { class: "sft-loss" }, el("span", { class: "muted" }, "loss per token "),
          el("b", { "data-metric": "loss" }, startEnd(loss, false, true)), how ? el("span", { class: "muted" }, ` (${how})`) : null)
        : el("p", { class: "muted" }, "No step logged yet."),
      el("h3", {}, "Learned from"),
      sources.length ? el("ul", { class: "sources" }, sources) : el("p", { class: "muted" }, "no sources recorded"));
  }

  function renderConfigDiff() {
    const diff = INDEX.config_diff || [];
    const show = (v) => (typeof v === "string" ? v : JSON.stringify(v));
    const rows = diff.map((d) => el("tr", {}, el("td", { class: "path" }, d.path),
      el("td", { class: "path" }, show(d.value)),
      el("td", { class: "muted path" }, "default" in d ? show(d.default) : "")));
    $("config-diff").replaceChildren(el("h2", {}, "Config: what differs from the defaults"),
      diff.length ? el("table", {}, el("thead", {}, el("tr", {}, ["setting", "value", "default"].map((t) => el("th", {}, t)))),
        el("tbody", {}, rows)) : el("p", { class: "muted" }, Object.keys(INDEX.config).length
        ? "Every setting is at its default." : "No config (config.json) in this run."),
      el("a", { href: "#config", onclick: (ev) => {
        ev.preventDefault();
        $("config-full").open = true;
        $("config").scrollIntoView({ behavior: "smooth" });
      } }, "every setting ↓"));
  }

  function renderCheckpoints() {
    const cps = INDEX.checkpoints;
    if (!cps.length) {
      $("checkpoint-table").replaceChildren(el("p", { class: "muted" }, "No checkpoints yet."));
      return;
    }
    const head = el("tr", {}, ["name", "step", "final", "state_path", "sampler_path"].map((h) => el("th", {}, h)));
    const rows = cps.map((c) => el("tr", {}, el("td", {}, c.name), el("td", {}, fmt(c.batch)),
      el("td", {}, c.final ? "yes" : ""), el("td", { class: "path" }, c.state_path || ""),
      el("td", { class: "path" }, c.sampler_path || "")));
    $("checkpoint-table").replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
  }

  // ------------------------------------------------------------------------------------- charts
  function renderCharts() {
    const { steps, series } = INDEX.metrics;
    const box = $("charts");
    const smooth = +$("smooth-select").value;
    box.replaceChildren();
    if (!INDEX.charts.length) box.append(el("p", { class: "muted" }, "No metrics yet."));
    for (const spec of INDEX.charts) box.append(chart(spec, steps, series, smooth));
  }

  function ema(ys, a) {  // exponential moving average, debiased at the start (as TensorBoard does)
    let acc = 0, weight = 0;
    return ys.map((y) => {
      if (y == null) return null;
      acc = a * acc + (1 - a) * y;
      weight = a * weight + (1 - a);
      return acc / weight;
    });
  }

  function niceStep(span, n) {
    const raw = span / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const r = raw / mag;
    return (r >= 7.5 ? 10 : r >= 3.5 ? 5 : r >= 1.5 ? 2 : 1) * mag;
  }

  function ticks(lo, hi, step) {
    const out = [];
    for (let t = Math.ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
    return out;
  }

  function seriesPoints(steps, ys) {
    const pts = [];
    for (let i = 0; i < steps.length; i++) if (ys[i] != null) pts.push([steps[i], ys[i]]);
    if (pts.length <= MAX_POINTS) return pts;
    const out = [];  // min and max of each bucket, in step order: keeps spikes visible
    const size = Math.ceil(pts.length / (MAX_POINTS / 2));
    for (let b = 0; b < pts.length; b += size) {
      const chunk = pts.slice(b, b + size);
      let lo = chunk[0], hi = chunk[0];
      for (const p of chunk) { if (p[1] < lo[1]) lo = p; if (p[1] > hi[1]) hi = p; }
      if (lo === hi) out.push(lo); else out.push(...(lo[0] < hi[0] ? [lo, hi] : [hi, lo]));
    }
    return out;
  }

  function marker(shape, x, y, fill) {
    if (shape === "square") return svg("rect", { x: x - 3.5, y: y - 3.5, width: 7, height: 7, fill });
    if (shape === "diamond") return svg("path", { d: `M${x} ${y - 5}L${x + 5} ${y}L${x} ${y + 5}L${x - 5} ${y}Z`, fill });
    return svg("circle", { cx: x, cy: y, r: 3.5, fill });
  }

  function chart(spec, steps, series, smooth) {
    const W = 480, H = 210, M = { l: 50, r: 12, t: 8, b: 22 };
    const lines = spec.series.map((s) => {
      const ys = series[s.key] || [];
      const raw = seriesPoints(steps, ys);
      const smoothed = smooth > 0 && s.style !== "points" ? seriesPoints(steps, ema(ys, smooth)) : null;
      return { s, pts: smoothed || raw, raw: smoothed ? raw : null };
    });
    const all = lines.flatMap((l) => (l.raw ? l.raw.concat(l.pts) : l.pts));
    if (!all.length) return el("div", { class: "chart" }, el("h3", {}, spec.title), el("p", { class: "muted" }, "no data"));
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const [x, y] of all) {
      x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
    }
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y1 - y0 <= 1e-9 * Math.max(1, Math.abs(y0), Math.abs(y1))) {  // flat (up to rounding)
      const mid = (y0 + y1) / 2, d = Math.abs(mid) * 0.1 || 1;
      y0 = mid - d; y1 = mid + d;
    }
    const ys = niceStep(y1 - y0, 4);
    y0 = Math.floor(y0 / ys + 1e-9) * ys;
    y1 = Math.ceil(y1 / ys - 1e-9) * ys;
    const X = (x) => M.l + ((x - x0) / (x1 - x0)) * (W - M.l - M.r);
    const Y = (y) => H - M.b - ((y - y0) / (y1 - y0)) * (H - M.t - M.b);

    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img", "aria-label": spec.title });
    for (const t of ticks(y0, y1, ys)) {
      root.append(svg("line", { x1: M.l, x2: W - M.r, y1: Y(t), y2: Y(t), class: "grid" }));
      const label = svg("text", { x: M.l - 5, y: Y(t) + 3.5, "text-anchor": "end", class: "tick" });
      label.textContent = fmt(t);
      root.append(label);
    }
    for (const t of ticks(x0, x1, Math.max(1, niceStep(x1 - x0, 6)))) {
      root.append(svg("line", { x1: X(t), x2: X(t), y1: H - M.b, y2: H - M.b + 4, class: "axis" }));
      const label = svg("text", { x: X(t), y: H - 6, "text-anchor": "middle", class: "tick" });
      label.textContent = fmt(t);
      root.append(label);
    }
    root.append(svg("line", { x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b, class: "axis" }));
    for (const { s, pts, raw } of lines) {
      if (!pts.length) continue;
      const c = color(s.color);
      if (raw) {
        root.append(svg("path", { d: "M" + raw.map((p) => `${X(p[0]).toFixed(1)} ${Y(p[1]).toFixed(1)}`).join("L"),
          stroke: c, class: "series-raw", "data-key": s.key }));
      }
      if (s.style === "points") {
        const g = svg("g", { class: "series-points", "data-key": s.key, "data-points": pts.length });
        if (pts.length > 1) {
          g.append(svg("path", { d: "M" + pts.map((p) => `${X(p[0]).toFixed(1)} ${Y(p[1]).toFixed(1)}`).join("L"),
            stroke: c, class: "eval-link" }));
        }
        for (const p of pts) g.append(marker(s.marker, X(p[0]), Y(p[1]), c));
        root.append(g);
      } else {
        const d = "M" + pts.map((p) => `${X(p[0]).toFixed(1)} ${Y(p[1]).toFixed(1)}`).join("L");
        root.append(svg("path", { d, stroke: c, class: "series-line", "data-key": s.key, "data-points": pts.length }));
        if (pts.length === 1) root.append(marker("circle", X(pts[0][0]), Y(pts[0][1]), c));
      }
    }

    // hover: a cursor line and the values at the nearest step; click: open that step's trajectories
    const cursor = svg("line", { y1: M.t, y2: H - M.b, class: "cursor", visibility: "hidden" });
    const hit = svg("rect", { x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b, class: "hit" });
    root.append(cursor, hit);
    const tip = el("div", { class: "tip", hidden: true });
    const nearest = (ev) => {
      const r = root.getBoundingClientRect();
      const x = x0 + (((ev.clientX - r.left) / r.width) * W - M.l) / (W - M.l - M.r) * (x1 - x0);
      let lo = 0, hi = steps.length - 1;
      while (lo < hi) { const mid = (lo + hi) >> 1; if (steps[mid] < x) lo = mid + 1; else hi = mid; }
      return lo > 0 && Math.abs(steps[lo - 1] - x) < Math.abs(steps[lo] - x) ? lo - 1 : lo;
    };
    hit.addEventListener("mousemove", (ev) => {
      const i = nearest(ev);
      cursor.setAttribute("x1", X(steps[i]));
      cursor.setAttribute("x2", X(steps[i]));
      cursor.setAttribute("visibility", "visible");
      const rows = spec.series.filter((s) => (series[s.key] || [])[i] != null)
        .map((s) => el("div", {}, el("i", { style: `background:${color(s.color)}` }), `${s.label}: ${fmt(series[s.key][i])}`));
      tip.replaceChildren(el("b", {}, `step ${steps[i]}`), ...rows);
      tip.hidden = false;
    });
    hit.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip.hidden = true; });
    hit.addEventListener("click", (ev) => {
      const step = steps[nearest(ev)];
      const with_traj = INDEX.steps.reduce((best, s) =>
        best == null || Math.abs(s.step - step) < Math.abs(best.step - step) ? s : best, null);
      if (with_traj) { selectStep(with_traj.step); $("trajectories").scrollIntoView({ behavior: "smooth" }); }
    });

    const legend = el("div", { class: "legend" }, lines.filter((l) => l.pts.length).map(({ s }) =>
      el("span", {
        class: "item", title: `${s.key} (click to hide/show)`,
        onclick: (ev) => {
          const off = ev.currentTarget.classList.toggle("off");
          for (const node of root.querySelectorAll(`[data-key="${CSS.escape(s.key)}"]`)) {
            node.style.display = off ? "none" : "";
          }
        },
      }, el("i", { class: s.style === "points" ? "pt " + s.marker : "ln", style: `background:${color(s.color)}` }),
      s.label)));
    return el("div", { class: "chart", "data-chart": spec.id },
      el("h3", {}, spec.title + (spec.unit ? ` (${spec.unit})` : "")), root, legend, tip);
  }

  // ------------------------------------------------------------------------------------- trajectory browser
  function readHash() {
    const h = new URLSearchParams(location.hash.slice(1));
    const num = (k) => (h.has(k) && h.get(k) !== "" && !Number.isNaN(+h.get(k)) ? +h.get(k) : null);
    return { step: num("step"), env: h.get("env"), ep: num("ep") };
  }

  function writeHash() {
    const h = new URLSearchParams({ step: state.step, env: state.env || "" });
    if (state.episode != null) h.set("ep", state.episode);
    history.replaceState(null, "", "#" + h.toString());
  }

  function initBrowser() {
    const steps = INDEX.steps;
    const sel = $("step-select");
    sel.replaceChildren(...steps.map((s) => {
      const n = Object.values(s.envs).reduce((a, e) => a + e.n, 0);
      return el("option", { value: s.step }, `${s.step} · ${n} episodes`);
    }));
    sel.addEventListener("change", () => selectStep(+sel.value));
    $("step-prev").addEventListener("click", () => moveStep(-1));
    $("step-next").addEventListener("click", () => moveStep(1));
    $("env-select").addEventListener("change", (ev) => {
      state.env = ev.target.value;
      state.episode = null;
      showStep();
    });
    $("filter-select").addEventListener("change", (ev) => {
      state.filter = ev.target.value;
      state.groupsShown = GROUP_PAGE;
      renderGroups();
    });
    $("shade-select").addEventListener("change", (ev) => {
      state.shade = ev.target.value;
      const ep = state.data && state.data.episodes.find((e) => e.i === state.episode);
      const box = document.querySelector("#episode .tokens");
      if (ep && box) {
        const fresh = renderTokens(ep);
        fresh.hidden = box.hidden;
        box.replaceWith(fresh);
      }
    });
    if (!steps.length) return;
    const h = readHash();
    selectStep(h.step != null ? h.step : steps[steps.length - 1].step, h.env, h.ep);
  }

  function moveStep(delta) {
    const i = INDEX.steps.findIndex((s) => s.step === state.step) + delta;
    if (i >= 0 && i < INDEX.steps.length) selectStep(INDEX.steps[i].step);
  }

  function selectStep(step, env, episode) {
    const info = INDEX.steps.find((s) => s.step === step) || INDEX.steps[INDEX.steps.length - 1];
    state.step = info.step;
    $("step-select").value = String(info.step);
    const envs = Object.keys(info.envs);
    state.env = envs.includes(env) ? env : envs.includes(state.env) ? state.env : envs[0];
    $("env-select").replaceChildren(...envs.map((e) => {
      const s = info.envs[e];
      return el("option", { value: e }, `${e} · ${s.n} episodes · reward ${fmt(s.r)}`);
    }));
    $("env-select").value = state.env;
    state.episode = episode == null ? null : episode;
    return showStep();
  }

  async function showStep() {
    const info = INDEX.steps.find((s) => s.step === state.step);
    const groups = $("groups");
    groups.replaceChildren(el("p", { class: "muted" }, `loading step ${info.step}…`));
    let data;
    try {
      data = await loadStep(info);
    } catch (e) {
      groups.replaceChildren(el("p", { class: "error" }, e.message));
      return;
    }
    if (state.step !== info.step) return; // another step was picked meanwhile
    state.data = data;
    state.groupsShown = GROUP_PAGE;
    renderGroups();
    const ep = data.episodes.find((e) => e.i === state.episode && e.env === state.env);
    if (ep) showEpisode(ep);
    else {
      state.episode = null;
      $("episode").replaceChildren(el("p", { class: "muted" }, "Pick an episode to see its turns and tokens."));
    }
    writeHash();
  }

  const FILTERS = {
    all: () => true,
    failed: (e) => !e.success,
    error: (e) => e.error != null,
    dropped: (e) => e.dropped,
  };

  function renderGroups() {
    const envEps = state.data.episodes.filter((e) => e.env === state.env);
    state.advScale = envEps.reduce((m, e) => e.adv.reduce((mm, a) => Math.max(mm, Math.abs(a)), m), 1e-9);
    const byGroup = new Map();
    for (const e of envEps) {
      if (!byGroup.has(e.group)) byGroup.set(e.group, []);
      byGroup.get(e.group).push(e);
    }
    const keep = FILTERS[state.filter];
    const shown = [...byGroup.values()].filter((g) => g.some(keep));
    const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
    $("step-summary").textContent = `${envEps.length} episodes in ${byGroup.size} groups · mean reward ` +
      `${fmt(mean(envEps.map((e) => e.reward || 0)))} · success ${fmt(mean(envEps.map((e) => +e.success)))}`;
    const nodes = shown.slice(0, state.groupsShown).map((g) => el("div", { class: "group", "data-group": g[0].group },
      el("div", { class: "group-head" }, el("b", {}, `group ${g[0].group}`),
        ` · task ${g[0].task ?? "?"} · mean reward ${fmt(mean(g.map((e) => e.reward || 0)))}`,
        g[0].lag ? ` · sampled ${g[0].lag} update${g[0].lag === 1 ? "" : "s"} behind` : "",
        g.some((e) => e.dropped) ? el("span", { class: "badge warn" }, "dropped") : null),
      el("div", { class: "episodes" }, g.map((e, k) => episodeCard(e, k, keep(e))))));
    if (!nodes.length) nodes.push(el("p", { class: "muted" }, "No episodes match."));
    if (shown.length > state.groupsShown) {
      nodes.push(el("button", {
        class: "more",
        onclick: () => { state.groupsShown += GROUP_PAGE; renderGroups(); },
      }, `show ${Math.min(GROUP_PAGE, shown.length - state.groupsShown)} more ` +
         `of ${shown.length - state.groupsShown} groups`));
    }
    $("groups").replaceChildren(...nodes);
  }

  function advColor(a, alpha0) {
    const t = Math.min(1, Math.abs(a) / state.advScale);
    if (!a) return `rgba(148,163,184,${alpha0})`;
    return a > 0 ? `rgba(37,99,235,${alpha0 + 0.55 * t})` : `rgba(220,38,38,${alpha0 + 0.55 * t})`;
  }

  function episodeCard(e, k, matches) {
    const meanAdv = e.adv.length ? e.adv.reduce((a, b) => a + b, 0) / e.adv.length : 0;
    return el("button", {
      class: ["ep-card", e.success ? "ok" : "fail", e.error != null && "err", e.dropped && "dropped",
        !matches && "dim", e.i === state.episode && "selected"].filter(Boolean).join(" "),
      "data-ep": e.i,
      title: `episode ${e.i}: ${e.turns} turns, stop: ${e.stop.join(", ")}${e.error ? "\nerror: " + e.error : ""}`,
      onclick: () => showEpisode(e),
    },
    el("div", { class: "ep-top" }, el("span", {}, `#${k}`), el("span", { class: "mark" }, e.success ? "✓" : "✗")),
    el("div", { class: "ep-reward" }, fmt(e.reward)),
    el("div", { class: "ep-adv", style: `background:${advColor(meanAdv, 0.15)}` },
      "adv ", e.adv.length > 1 ? e.adv.slice(0, 3).map(fmt).join(" ") + (e.adv.length > 3 ? " …" : "") : fmt(e.adv[0])),
    el("div", { class: "ep-meta" }, `${e.turns} turn${e.turns === 1 ? "" : "s"}`),
    e.error != null ? el("div", { class: "ep-error" }, "error") : null);
  }

  function showEpisode(e) {
    state.episode = e.i;
    for (const c of document.querySelectorAll(".ep-card")) c.classList.toggle("selected", +c.dataset.ep === e.i);
    const tools = (state.data.tools[e.env] || []).map((t) => (t.function || t).name).filter(Boolean);
    const meta = [
      ["reward", fmt(e.reward)], ["success", e.success ? "yes" : "no"],
      ["advantages", e.adv.map(fmt).join(", ") || "–"], ["turn rewards", e.step_rewards.map(fmt).join(", ") || "–"],
      ["turns", e.turns], ["stop reasons", e.stop.join(", ") || "–"], ["done by env", e.done_by_env ? "yes" : "no"],
      ["duration", e.dur == null ? "–" : `${fmt(e.dur)} s`], ["task", e.task ?? "–"],
      ["metrics", Object.entries(e.metrics).map(([k, v]) => `${k}=${fmt(v)}`).join(", ") || "–"],
      ["tools", tools.join(", ") || "–"], ["dropped", e.dropped ? "yes (not trained on)" : "no"],
      ["sampled by", e.lag == null ? "–" : e.lag ? `the policy ${e.lag} update${e.lag === 1 ? "" : "s"} behind` :
        "the policy trained"],
    ];
    const turnsView = renderTurns(e);
    const tokensView = renderTokens(e);
    tokensView.hidden = true;
    const tab = (name) => el("button", {
      class: name === "turns" ? "tab on" : "tab", "data-tab": name,
      onclick: (ev) => {
        for (const b of ev.currentTarget.parentNode.children) b.classList.toggle("on", b === ev.currentTarget);
        const current = document.querySelector("#episode .tokens");
        (name === "turns" ? turnsView : current).hidden = false;
        (name === "turns" ? current : turnsView).hidden = true;
      },
    }, name === "turns" ? `Turns (${e.messages.length} messages)` : `Tokens (${e.text.length})`);
    $("episode").replaceChildren(...[
      el("h3", {}, `step ${state.step} · ${e.env} · group ${e.group} · episode ${e.i}`),
      e.error != null ? el("p", { class: "error" }, `error: ${e.error}`) : null,
      el("dl", { class: "meta" }, meta.map(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])),
      renderJudge(e),
      el("div", { class: "tabs" }, tab("turns"), tab("tokens")),
      turnsView, tokensView].filter(Boolean));
    writeHash();
  }

  // The judge's verdict on each rubric item, beside the episode it graded (its prompt folded away).
  function renderJudge(e) {
    if (!e.judge || !e.judge.length) return null;
    return el("section", { class: "judge" }, el("h4", {}, "Judge"), e.judge.map((j, k) => {
      const score = j.failure ? `${j.failure} failure` : j.pair ?
        `reply ${j.pair[0] + 1} (A) vs reply ${j.pair[1] + 1} (B): preferred ${j.preferred}` :
        `score ${fmt(j.score)} (${fmt(j.raw)} given)`;
      const how = j.cached ? "verdict reused" : `${fmt(j.secs)} s`;
      return el("div", { class: "judge-item" },
        el("div", { class: "msg-head" }, el("span", { class: "role" }, `rubric ${k + 1}`),
          el("span", { class: j.failure ? "error" : "" }, score), el("span", { class: "muted" }, how)),
        el("pre", { class: "content muted" }, j.rubric || ""),
        j.verdict != null ? el("pre", { class: "content judge-verdict" }, j.verdict) : null,
        j.error ? el("p", { class: "error" }, j.error) : null,
        el("details", {}, el("summary", {}, "the judge's prompt"), el("pre", { class: "content" }, j.prompt || "")));
    }));
  }

  function prettyArgs(args) {
    if (typeof args !== "string") return JSON.stringify(args, null, 2);
    try { return JSON.stringify(JSON.parse(args), null, 2); } catch (_) { return args; }
  }

  function renderTurns(e) {
    const names = {};
    let turn = 0;
    const items = e.messages.map((m) => {
      const head = [el("span", { class: `role role-${m.role}` }, m.role)];
      if (m.role === "assistant") {
        const a = e.adv[turn];
        head.push(el("span", { class: "turn-no" }, `turn ${turn + 1}`),
          a != null ? el("span", { class: "adv", style: `background:${advColor(a, 0.2)}` }, `adv ${fmt(a)}`) : null,
          e.step_rewards[turn] != null ? el("span", {}, `reward ${fmt(e.step_rewards[turn])}`) : null,
          e.stop[turn] ? el("span", { class: "muted" }, `stop: ${e.stop[turn]}`) : null);
        turn += 1;
      }
      if (m.role === "tool") {
        head.push(el("span", { class: "muted" }, `result of ${names[m.tool_call_id] || "call"}` +
          (m.tool_call_id ? ` (${m.tool_call_id})` : "")));
      }
      const body = [];
      if (m.reasoning_content) {
        body.push(el("details", { class: "reasoning" }, el("summary", {}, "reasoning"), el("pre", {}, m.reasoning_content)));
      }
      if (Array.isArray(m.content) && m.content.some((p) => p && p.type === "image")) {
        for (const p of m.content) {
          if (p && p.type === "image") body.push(imageFigure(p));
          else if (p && p.text) body.push(el("pre", { class: "content" }, p.text));
        }
      } else {
        const text = textOf(m.content);
        if (text) body.push(el("pre", { class: "content" }, text));
      }
      for (const call of m.tool_calls || []) {
        const fn = call.function || {};
        names[call.id] = fn.name;
        body.push(el("div", { class: "tool-call" }, el("span", { class: "tool-name" }, `→ ${fn.name || "?"}`),
          call.id ? el("span", { class: "muted" }, ` (${call.id})`) : null, el("pre", {}, prettyArgs(fn.arguments))));
      }
      for (const err of m.tool_call_errors || []) {
        body.push(el("div", { class: "error" }, `tool call error: ${typeof err === "string" ? err : JSON.stringify(err)}`));
      }
      if (!body.length) body.push(el("pre", { class: "content muted" }, "(empty)"));
      return el("div", { class: `msg msg-${m.role}`, "data-role": m.role }, el("div", { class: "msg-head" }, head), body);
    });
    return el("div", { class: "turns" }, items);
  }

  // An image part of a message (or of the token sequence): the stored file, in place, with its size.
  function imageFigure(p, tokens) {
    const size = p.width && p.height ? `${p.width} × ${p.height}` : "";
    const caption = [size, tokens ? `${tokens} tokens` : ""].filter(Boolean).join(" · ");
    if (!p.image) return el("div", { class: "content muted" }, `[image${caption ? " " + caption : ""}]`);
    return el("figure", { class: "image" },
      el("img", { src: `../${p.image}`, alt: `image ${caption}`, title: p.image, loading: "lazy" }),
      caption ? el("figcaption", { class: "muted" }, caption) : null);
  }

  function renderTokens(e) {
    const n = e.text.length;
    const sampled = new Uint8Array(n);
    for (const [a, b] of e.mask) sampled.fill(1, a, b);
    const turnOf = new Int32Array(n).fill(-1);
    e.spans.forEach(([a, b], k) => turnOf.fill(k, a, b));
    const imageAt = new Map((e.images || []).map((im) => [im.start, im]));
    const frag = document.createDocumentFragment();
    for (let i = 0; i < n; i++) {
      const im = imageAt.get(i);
      if (im) {  // one picture stands for its tokens
        frag.append(imageFigure(im, im.length));
        i += im.length - 1;
        continue;
      }
      const t = e.text[i].replace(/\n/g, "↵\n");
      if (!sampled[i]) { frag.append(t); continue; }
      const lp = e.lp[i] || 0;
      const a = turnOf[i] >= 0 ? e.adv[turnOf[i]] : null;
      const span = el("span", { class: "tok", title: `logprob ${fmt(lp)} · p ${fmt(Math.exp(lp))} · advantage ${fmt(a)}` }, t);
      if (state.shade === "adv") span.style.background = advColor(a || 0, 0.15);
      else if (state.shade === "lp") span.style.background = `rgba(234,88,12,${(0.05 + 0.75 * (1 - Math.exp(lp))).toFixed(3)})`;
      frag.append(span);
    }
    const key = {
      adv: `sampled tokens shaded by their turn's advantage: blue > 0, red < 0, grey = 0 (full color at ±${fmt(state.advScale)})`,
      lp: "sampled tokens shaded by logprob: darker = less likely under the sampler",
      none: "sampled tokens outlined",
    }[state.shade];
    return el("div", { class: "tokens" }, el("p", { class: "muted key" }, key, "; prompt and environment tokens plain"),
      el("div", { class: `token-text shade-${state.shade}` }, frag));
  }

  window.polyrlReport = { selectStep, showEpisode: (i) => {
    const ep = state.data && state.data.episodes.find((e) => e.i === i);
    if (ep) showEpisode(ep);
    return !!ep;
  } }; // for tests and the load benchmark

  // index.js failed to load (or the page was opened without data)
  window.addEventListener("load", () => {
    if (!INDEX) {
      const p = $("load-error");
      p.textContent = "data/index.js is missing or broken: rebuild with `polyrl report LOG_PATH`.";
      p.hidden = false;
    }
  });
})();

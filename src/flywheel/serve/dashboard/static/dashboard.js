// flywheel's live dashboard: no libraries, no network but this server's API.
// The key lives in sessionStorage ("flywheel.key"); every call sends it as a Bearer token.
// Data is put into the page with textContent / attributes only, never parsed as HTML.
"use strict";

const KEY = "flywheel.key";
const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let timer = null;

// ------------------------------------------------------------------ small helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const plural = (n, word) => fmt.int(n) + " " + word + (n === 1 ? "" : "s");
const fmt = {
  int: (x) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US")),
  num: (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toPrecision(d).replace(/\.?0+(e|$)/, "$1")),
  usd: (x) => (x === null || x === undefined ? "–" : x < 0.01 && x > 0 ? "$" + x.toPrecision(2) : "$" + x.toFixed(2)),
  pct: (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"),
  pts: (x) => (x === null || x === undefined ? "–" : (x >= 0 ? "+" : "") + x.toFixed(1) + " pts"),
  time: (t) => (t ? new Date(t * 1000).toLocaleTimeString("en-GB") : "–"),
};

function table(headers, rows, attrs) {
  if (!rows.length) return el("p", { class: "empty" }, "none yet");
  return el("table", attrs || {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function card(label, value, detail, testid, long) {  // long: a name rather than a number
  return el("div", { class: "card", "data-testid": testid },
    el("div", { class: "label" }, label), el("div", { class: long ? "value long" : "value" }, value),
    detail ? el("div", { class: "detail" }, detail) : null);
}

function badge(text, kind) {
  return el("span", { class: "badge " + (kind || String(text).replace(/[^a-z]/gi, "-")) }, text);
}

function jobLink(id) {
  return el("a", { href: "/dashboard/jobs/" + encodeURIComponent(id), "data-job": id }, id);
}

// ------------------------------------------------------------------ charts (SVG, drawn here)

// A line chart of points [[x, y], ...]: axes' ends labelled, the newest value in the title.
function lineChart(title, points, opts = {}) {
  const W = 340, H = 150, L = 44, R = 10, T = 10, B = 22;
  const box = el("figure", { class: "chart", "data-metric": title });
  const last = points.length ? points[points.length - 1][1] : null;
  box.append(el("figcaption", {}, title, " ", el("b", {}, last === null ? "" : fmt.num(last, 4))));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  if (!points.length) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "muted" }, "no points yet"));
    box.append(root);
    return box;
  }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }),
    svg("text", { x: L - 4, y: T + 8, "text-anchor": "end", class: "tick" }, fmt.num(y1)),
    svg("text", { x: L - 4, y: H - B, "text-anchor": "end", class: "tick" }, fmt.num(y0)),
    svg("text", { x: L, y: H - 6, class: "tick" }, (opts.xLabel || "step") + " " + fmt.num(x0, 4)),
    svg("text", { x: W - R, y: H - 6, "text-anchor": "end", class: "tick" }, fmt.num(x1, 4)));
  const d = points.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
  root.append(svg("path", { d, class: "line" }));
  if (points.length <= 60) {
    for (const p of points) root.append(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, class: "dot" }));
  }
  box.append(root);
  return box;
}

// Bars of requests per minute with failures drawn over them.
function barChart(all, failed) {
  const W = 640, H = 150, L = 34, B = 20, T = 8;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "requests per minute" });
  const top = Math.max(1, ...all.map((p) => p[1]));
  const bw = (W - L) / Math.max(1, all.length);
  const sy = (y) => (H - B) - (y / top) * (H - B - T);
  root.append(svg("line", { x1: L, y1: H - B, x2: W, y2: H - B, class: "axis" }),
    svg("text", { x: L - 4, y: T + 8, "text-anchor": "end", class: "tick" }, fmt.int(top)),
    svg("text", { x: L - 4, y: H - B, "text-anchor": "end", class: "tick" }, "0"));
  all.forEach((p, i) => {
    const x = L + i * bw + 1;
    root.append(svg("rect", { x, y: sy(p[1]), width: Math.max(1, bw - 2), height: H - B - sy(p[1]), class: "bar" }));
    const f = failed[i] ? failed[i][1] : 0;
    if (f) root.append(svg("rect", { x, y: sy(f), width: Math.max(1, bw - 2), height: H - B - sy(f), class: "bar fail" }));
  });
  if (all.length) {
    root.append(svg("text", { x: L, y: H - 5, class: "tick" }, fmt.time(all[0][0])),
      svg("text", { x: W, y: H - 5, "text-anchor": "end", class: "tick" }, fmt.time(all[all.length - 1][0])));
  }
  return root;
}

const ORDER = ["train_reward_mean", "reward", "train_loss", "loss", "valid_loss", "kl", "tokens_per_s"];
function charts(series) {
  const names = Object.keys(series).sort((a, b) => {
    const ia = ORDER.findIndex((k) => a.includes(k)), ib = ORDER.findIndex((k) => b.includes(k));
    return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || a.localeCompare(b);
  });
  return names.map((n) => lineChart(n, series[n]));
}

// ------------------------------------------------------------------ the API

class Unauthorized extends Error {}

async function api(path) {
  const key = sessionStorage.getItem(KEY);
  const r = await fetch(path, { headers: key ? { Authorization: "Bearer " + key } : {}, cache: "no-store" });
  const body = await r.json().catch(() => ({}));
  if (r.status === 401) throw new Unauthorized(body.error ? body.error.message : "unauthorized");
  if (!r.ok) throw new Error(body.error ? body.error.message : "HTTP " + r.status);
  return body;
}

// ------------------------------------------------------------------ the front page

function renderTraffic(t, cost) {
  const judged = (t.outcomes.pass || 0) + (t.outcomes.fail || 0);
  $("cards").replaceChildren(
    card("Requests", fmt.int(t.requests), t.available ? fmt.int(t.with_feedback) + " with feedback" : "no trace store",
      "requests"),
    card("Failures", fmt.int(t.outcomes.fail || 0), judged ? fmt.pct((t.outcomes.fail || 0) / judged) + " of " +
      fmt.int(judged) + " judged" : "none judged", "failures"),
    card("Tokens", fmt.int(t.prompt_tokens + t.completion_tokens), fmt.int(t.prompt_tokens) + " prompt · " +
      fmt.int(t.completion_tokens) + " completion", "tokens"),
    card("Serving $/1M tokens", fmt.usd(t.cost.usd_per_million_tokens), "estimate · " + (t.cost.hardware || "no price"),
      "serving-cost"),
    card("Training $/1M tokens", fmt.usd(cost.usd_per_million_tokens), fmt.usd(cost.usd) + " over " +
      plural(cost.jobs, "job"), "training-cost"));
  $("per-minute").replaceChildren(barChart(t.per_minute, t.failures_per_minute));
  $("groups").replaceChildren(table(["group", "requests", "passes", "failures", "failure rate"], t.groups.map((g) =>
    el("tr", { "data-group": g.name },
      el("td", {}, g.name, " ", el("small", {}, g.kind)), el("td", { class: "n" }, fmt.int(g.requests)),
      el("td", { class: "n" }, fmt.int(g.passes)), el("td", { class: "n" }, fmt.int(g.failures)),
      el("td", {}, el("span", { class: "meter" }, el("span", { style: null, "data-w": g.failure_rate })),
        " " + fmt.pct(g.failure_rate)))), { "data-testid": "groups" }));
  for (const m of $("groups").querySelectorAll("[data-w]")) {
    const w = Number(m.getAttribute("data-w"));
    m.style.width = (isFinite(w) ? Math.round(100 * w) : 0) + "%";  // CSSOM, allowed by the page's CSP
  }
  $("cost-note").textContent = "Serving cost: " + t.cost.note + ". Training cost: " + cost.note + ". Window: the " +
    fmt.int(t.window) + " newest traces.";
}

const CYCLE_COLUMNS = ["cycle", "status", "gate", "reasons", "gain", "cost", "pts/$", "version", "job"];
function renderCycle(c) {
  const decision = c.promote === null ? badge(c.status, "pending") : badge(c.promote ? "promote" : "reject");
  return el("tr", { "data-testid": "cycle", "data-cycle": c.number, "data-outcome": c.outcome || "" },
    el("td", { class: "n" }, "#" + c.number), el("td", {}, badge(c.status)),
    el("td", {}, decision, " ", c.outcome ? badge(c.outcome) : ""),
    el("td", { class: "reasons" }, c.reasons.length ? el("ul", {}, c.reasons.map((r) => el("li", {}, r))) : c.reason),
    el("td", { class: "n" }, fmt.pts(c.gain_points)), el("td", { class: "n" }, fmt.usd(c.usd)),
    el("td", { class: "n" }, fmt.num(c.points_per_usd)), el("td", {}, c.version || "–"), el("td", {}, jobLink(c.job_id)));
}

function renderFlywheels(list) {
  if (!list.length) return $("flywheels").replaceChildren(el("p", { class: "empty" }, "no managed flywheels"));
  $("flywheels").replaceChildren(...list.map((f) => el("div", { class: "panel flywheel", "data-flywheel": f.id },
    el("h3", {}, f.alias, " ", badge(f.status)),
    el("div", { class: "cards small" },
      card("Production", f.production_version, f.production_model, "production"),
      card("Promotions", fmt.int(f.promotions), "generation " + f.generation, "promotions"),
      card("Rollbacks", fmt.int(f.rollbacks), null, "rollbacks"),
      card("Spent", fmt.usd(f.usd), fmt.pts(f.points) + " realised"),
      card("Points per $", fmt.num(f.points_per_usd), null, "points-per-usd")),
    table(CYCLE_COLUMNS,
      f.cycles.map(renderCycle), { class: "cycles" }))));
}

function renderJobs(jobs) {
  $("jobs").replaceChildren(table(["job", "method", "status", "model", "fine-tuned model", "tokens", "cost", "latest"],
    jobs.map((j) => el("tr", { "data-testid": "job" },
      el("td", {}, jobLink(j.id)), el("td", {}, j.method + (j.cycle ? " #" + j.cycle : "")), el("td", {}, badge(j.status)),
      el("td", {}, j.model), el("td", { class: "mono" }, j.fine_tuned_model || "–"),
      el("td", { class: "n" }, fmt.int(j.trained_tokens)), el("td", { class: "n" }, fmt.usd(j.estimated_cost)),
      el("td", {}, Object.entries(j.last_metrics).map(([k, v]) => k + " " + fmt.num(v, 4)).join(" · ") || "–")))));
}

function renderLive(live) {
  if (!live.length) return $("live").replaceChildren(el("p", { class: "empty" }, "no job has reported metrics yet"));
  $("live").replaceChildren(...live.map((j) => el("div", { class: "live", "data-live": j.job_id },
    el("h3", {}, jobLink(j.job_id), " ", badge(j.status)), el("div", { class: "charts" }, charts(j.series)))));
}

function renderSummary(s) {
  $("tenant").textContent = "tenant " + s.tenant;
  renderTraffic(s.traffic, s.training_cost);
  renderFlywheels(s.flywheels);
  renderLive(s.live);
  renderJobs(s.jobs);
}

// ------------------------------------------------------------------ one job

function renderJob(d) {
  const j = d.job;
  $("tenant").textContent = "";
  $("job-title").textContent = "Job " + j.id;
  $("job-facts").replaceChildren(card("Status", j.status, j.method, "job-status"), card("Model", j.model, null, null, true),
    card("Fine-tuned model", j.fine_tuned_model || "–", null, null, true), card("Trained tokens", fmt.int(j.trained_tokens)),
    card("Cost", fmt.usd(j.estimated_cost)));
  $("job-cycle").replaceChildren(d.cycle ? el("div", { class: "panel" }, el("h3", {}, "Flywheel " + j.flywheel_id),
    table(CYCLE_COLUMNS, [renderCycle(d.cycle)],
      { class: "cycles" })) : "");
  const names = Object.keys(d.series);
  $("job-charts").replaceChildren(...(names.length ? charts(d.series) :
    [el("p", { class: "empty" }, "no metrics events yet")]));
  $("job-events").replaceChildren(table(["time", "level", "message"], d.events.slice().reverse().map((e) =>
    el("tr", { "data-testid": "event", class: e.type }, el("td", { class: "n" }, fmt.time(e.created_at)),
      el("td", {}, badge(e.level)), el("td", {}, e.message)))));
  $("job-checkpoints").replaceChildren(table(["step", "checkpoint", "metrics"], d.checkpoints.map((c) =>
    el("tr", {}, el("td", { class: "n" }, c.step), el("td", { class: "mono" }, c.fine_tuned_model_checkpoint),
      el("td", {}, Object.entries(c.metrics).map(([k, v]) => k + " " + fmt.num(v, 4)).join(" · "))))));
}

// ------------------------------------------------------------------ routing, polling, login

function route() {
  const m = location.pathname.match(/^\/dashboard\/jobs\/([^/]+)$/) || location.hash.match(/^#\/jobs\/([^/]+)$/);
  return m ? { view: "job", id: decodeURIComponent(m[1]) } : { view: "overview" };
}

function show(id) {
  for (const s of ["login", "overview", "job"]) $(s).hidden = s !== id;
  $("signout").hidden = id === "login" || !sessionStorage.getItem(KEY);
}

async function tick() {
  clearTimeout(timer);
  const r = route();
  try {
    if (r.view === "job") renderJob(await api("/v1/dashboard/jobs/" + encodeURIComponent(r.id)));
    else renderSummary(await api("/v1/dashboard/summary"));
    show(r.view);
    $("status").textContent = "live · updated " + new Date().toLocaleTimeString("en-GB");
    $("status").className = "status ok";
  } catch (e) {
    if (e instanceof Unauthorized) {
      const had = sessionStorage.getItem(KEY);
      sessionStorage.removeItem(KEY);
      $("login-error").textContent = had ? e.message : "";
      $("status").textContent = "signed out";
      show("login");
      return;  // no polling until a key is given
    }
    $("status").textContent = "error: " + e.message + " (retrying)";
    $("status").className = "status bad";
  }
  timer = setTimeout(tick, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    tick();
  });
  $("signout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    $("login-error").textContent = "";
    clearTimeout(timer);
    show("login");
  });
  window.addEventListener("hashchange", tick);
  tick();
});

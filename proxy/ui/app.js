// The status page: polls the admin API and draws tenants and replicas.
// Vanilla JS, no build step. The admin token, when one is needed, lives in a
// variable and sessionStorage (gone with the tab), and is only ever sent as
// the Authorization header: never in a URL, never in localStorage.
"use strict";

const POLL_MS = 2000;
const TOKEN_KEY = "admission-proxy-admin-token";
const SVG = "http://www.w3.org/2000/svg";
const REASON_COLORS = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00", "#56b4e9", "#f0e442", "#000000"];
const LAYERS = ["entrance", "queue", "first_byte"];

const needsToken = document.querySelector('meta[name="admin-auth"]').content !== "open";
let token = sessionStorage.getItem(TOKEN_KEY) || "";
let points = [];      // history points, oldest first
let lastT = null;     // the newest point's t: the next poll asks for newer ones only
let waits = {};
let windowS = 600;
let intervalS = 2;
let timer = null;
let generation = 0;   // only the newest poll schedules the next one
const reasonColor = new Map();

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "onclick") el.addEventListener("click", value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function svg(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  return el;
}

function setStatus(text, isError) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.classList.toggle("error", Boolean(isError));
}

class Unauthorized extends Error {}

async function api(path, method) {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = "Bearer " + token;
  const response = await fetch(path, { method: method || "GET", headers, cache: "no-store", credentials: "omit" });
  if (response.status === 401) throw new Unauthorized();
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

function askToken(note) {
  clearTimeout(timer);
  token = "";
  sessionStorage.removeItem(TOKEN_KEY);
  document.getElementById("main").hidden = true;
  const form = document.getElementById("login");
  form.hidden = false;
  document.getElementById("login-note").textContent = note || "";
  setStatus("the admin API needs its token");
  document.getElementById("token").focus();
}

function onLogin(event) {
  event.preventDefault();
  const input = document.getElementById("token");
  token = input.value.trim();
  input.value = "";
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  document.getElementById("login").hidden = true;
  poll();
}

async function poll() {
  clearTimeout(timer);
  const mine = ++generation;
  try {
    const query = lastT === null ? "" : "?since=" + encodeURIComponent(lastT);
    const [state, history] = await Promise.all([api("/admin/state"), api("/admin/history" + query)]);
    mergeHistory(history);
    render(state);
    document.getElementById("main").hidden = false;
    const when = new Date().toLocaleTimeString();
    const minutes = ((points.length * intervalS) / 60).toFixed(1);
    const missing = state.workers ? state.workers.unanswered.length : 0;
    setStatus(`updated ${when} · ${minutes} min of history` + workersText(state.workers) + (state.shutting_down ? " · SHUTTING DOWN" : ""), missing > 0);
  } catch (err) {
    if (err instanceof Unauthorized) {
      askToken(token ? "that token was refused" : "");
      return;
    }
    setStatus("cannot reach the admin API: " + err.message + " (retrying)", true);
  }
  if (mine === generation) timer = setTimeout(poll, POLL_MS);
}

// serve --workers N: how many workers this answer counts, and which did not answer.
function workersText(workers) {
  if (!workers) return "";
  const missing = workers.unanswered;
  return ` · ${workers.answered} workers` + (missing.length ? ` (not answering: pid ${missing.join(", ")})` : "");
}

function mergeHistory(history) {
  windowS = history.window_s;
  intervalS = history.interval_s;
  waits = history.waits;
  for (const point of history.points) if (lastT === null || point.t > lastT) points.push(point);
  if (points.length) lastT = points[points.length - 1].t;
  const oldest = history.now - windowS;
  while (points.length && points[0].t < oldest) points.shift();
  for (const el of document.querySelectorAll(".window")) el.textContent = Math.round(windowS / 60);
  for (const el of document.querySelectorAll(".wait-window")) el.textContent = Math.round(history.wait_window_s / 60);
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? Math.round(value * 1000) + " ms" : value.toFixed(value < 10 ? 2 : 1) + " s";
}

function bar(value, limit, headroom) {
  const max = limit + (headroom || 0);
  const label = `${value} / ${limit === null ? "no cap" : limit}` + (headroom ? ` (+${headroom})` : "");
  const wrap = h("span", { class: "meter" }, h("span", { class: "meter-text" }, label));
  if (limit !== null && max > 0) {
    const track = h("span", { class: "track", "aria-hidden": "true" });
    const used = h("span", { class: "fill" + (value > limit ? " over" : "") });
    used.style.width = Math.min(100, (100 * value) / max) + "%";
    track.append(used);
    wrap.append(track);
  }
  return wrap;
}

function colorOf(reason) {
  if (!reasonColor.has(reason)) reasonColor.set(reason, REASON_COLORS[reasonColor.size % REASON_COLORS.length]);
  return reasonColor.get(reason);
}

function refusalsChart(name) {
  const buckets = 30;
  const totals = {};
  const series = Array.from({ length: buckets }, () => ({}));
  const now = points.length ? points[points.length - 1].t : 0;
  // The x axis spans the history the page has (a minute at least), not the whole window.
  const span = Math.max(60, points.length ? now - points[0].t + intervalS : 0);
  for (const point of points) {
    const refused = (point.tenants[name] || {}).refused || {};
    const index = Math.max(0, buckets - 1 - Math.floor((now - point.t) / (span / buckets)));
    for (const [reason, count] of Object.entries(refused)) {
      totals[reason] = (totals[reason] || 0) + count;
      series[index][reason] = (series[index][reason] || 0) + count;
    }
  }
  const reasons = Object.keys(totals).sort();
  if (!reasons.length) return h("span", { class: "none" }, "none");
  const peak = Math.max(1, ...series.map((b) => Object.values(b).reduce((a, c) => a + c, 0)));
  const chart = svg("svg", { width: 150, height: 28, viewBox: "0 0 150 28", role: "img", "aria-label": `not served over the last ${Math.round(span)} s` });
  chart.append(svg("rect", { x: 0, y: 0, width: 150, height: 28, class: "chart-bg" }));
  series.forEach((bucket, i) => {
    let y = 28;
    for (const reason of reasons) {
      const count = bucket[reason] || 0;
      if (!count) continue;
      const height = (26 * count) / peak;
      y -= height;
      chart.append(svg("rect", { x: i * 5, y, width: 4, height, fill: colorOf(reason) }));
    }
  });
  const list = h("ul", { class: "reasons" }, reasons.map((reason) => {
    const key = h("span", { class: "swatch", "aria-hidden": "true" });
    key.style.background = colorOf(reason);
    return h("li", {}, key, `${reason} ${totals[reason]}`);
  }));
  return h("div", { class: "refusals" }, chart, list);
}

function goodput(name) {
  let good = 0;
  let ended = 0;
  for (const point of points) {
    const t = point.tenants[name] || {};
    good += t.good || 0;
    ended += (t.completed || 0) + Object.values(t.refused || {}).reduce((a, c) => a + c, 0);
  }
  if (!ended) return "–";
  const span = Math.max(1, points.length * intervalS);
  return `${Math.round((100 * good) / ended)}% (${(good / span).toFixed(1)}/s)`;
}

function waitCell(name, layer) {
  const w = (waits[name] || {})[layer];
  if (!w) return h("td", { class: "num" }, "–");
  return h("td", { class: "num", title: `${w.count} requests` }, `${seconds(w.p50)} / ${seconds(w.p95)}`);
}

function renderTenants(tenants) {
  const rows = Object.entries(tenants).map(([name, t]) => {
    const quota = t.quota ? `${t.quota.used} / ${t.quota.limit} ${t.quota.unit || "tokens"}` : "no quota";
    return h("tr", { "data-tenant": name },
      h("th", { scope: "row" }, name, h("small", {}, ` ${t.priority}, weight ${t.weight}`)),
      h("td", { class: "queued" }, bar(t.queued, t.queue_capacity)),
      h("td", { class: "inflight" }, bar(t.inflight, t.max_concurrency)),
      h("td", { class: "quota" }, quota),
      LAYERS.map((layer) => waitCell(name, layer)),
      h("td", { class: "refused" }, refusalsChart(name)),
      h("td", { class: "goodput num" }, goodput(name)));
  });
  document.querySelector("#tenants tbody").replaceChildren(...rows);
}

function sparkline(name, limit) {
  const values = points.map((p) => ((p.replicas || {})[name] || {}).inflight || 0);
  const chart = svg("svg", { width: 90, height: 24, viewBox: "0 0 90 24", role: "img", "aria-label": "in flight over time" });
  chart.append(svg("rect", { x: 0, y: 0, width: 90, height: 24, class: "chart-bg" }));
  if (values.length > 1) {
    const top = Math.max(limit, ...values, 1);
    const coords = values.map((v, i) => `${((90 * i) / (values.length - 1)).toFixed(1)},${(23 - (22 * v) / top).toFixed(1)}`);
    chart.append(svg("polyline", { points: coords.join(" "), class: "spark" }));
  }
  return chart;
}

function badge(text, kind) {
  return h("span", { class: "badge " + kind }, text);
}

function engineText(engine) {
  if (!engine) return "–";
  const kv = engine.kv_cache === null || engine.kv_cache === undefined ? "–" : Math.round(engine.kv_cache * 100) + "%";
  return `waiting ${engine.waiting ?? "–"} · running ${engine.running ?? "–"} · KV ${kv}`;
}

function gpuText(gpu) {
  if (!gpu || !gpu.memory_total) return "unknown";
  const gib = (bytes) => (bytes / 2 ** 30).toFixed(1);
  return `${gib(gpu.memory_used)} / ${gib(gpu.memory_total)} GiB (${Math.round((100 * gpu.memory_used) / gpu.memory_total)}%)`;
}

async function act(name, action) {
  try {
    await api(`/admin/replicas/${encodeURIComponent(name)}/${action}`, "POST");
  } catch (err) {
    if (err instanceof Unauthorized) return askToken("that token was refused");
    setStatus(`${action} ${name} failed: ${err.message}`, true);
  }
  poll();
}

// One section per model pool (a replica serving several models is in each of its
// pools: a pool is shown whole, with its queue); "all replicas" while the proxy
// does not route by model.
function poolGroups(state) {
  const replicas = state.replicas || {};
  const pools = Object.entries(state.pools || {});
  if (!pools.length) return [["all replicas", "all replicas", Object.entries(replicas)]];
  const groups = pools.map(([model, pool]) => {
    const members = (pool.replicas || []).filter((name) => name in replicas);
    return [model, `${model} · ${pool.queued || 0} queued`, members.map((name) => [name, replicas[name]])];
  });
  const listed = new Set(pools.flatMap(([, pool]) => pool.replicas || []));
  const rest = Object.entries(replicas).filter(([name]) => !listed.has(name));
  if (rest.length) groups.push(["", "no models listed", rest]);
  return groups;
}

function renderReplicas(state) {
  const focused = document.activeElement && document.activeElement.id;
  const seen = new Set();
  const sections = poolGroups(state).map(([pool, title, members]) => h("div", { class: "pool", "data-pool": pool },
    h("h3", {}, title),
    h("table", {},
      h("thead", {}, h("tr", {}, ["Replica", "State", "In flight / limit", "Last minutes", "Engine", "GPU memory", "Probe", "Action"]
        .map((title) => h("th", { scope: "col" }, title)))),
      h("tbody", {}, members.map(([name, r]) => {
        const action = r.draining ? "undrain" : "drain";
        // A replica shown in several pools: its first button keeps the plain id.
        const id = seen.has(name) ? `act-${name}-in-${pool}` : `act-${name}`;
        seen.add(name);
        return h("tr", { "data-replica": name },
          h("th", { scope: "row" }, name),
          h("td", { class: "state" }, badge(r.state, "state-" + r.state),
            r.saturated ? badge("saturated", "warn") : null,
            r.gpu_guarded ? badge("GPU guarded", "warn") : null),
          h("td", { class: "inflight" }, bar(r.inflight, r.limit, r.headroom)),
          h("td", {}, sparkline(name, r.limit)),
          h("td", { class: "engine" }, engineText(r.engine)),
          h("td", { class: "gpu" }, gpuText(r.gpu)),
          h("td", { class: "probe" }, r.probe_error ? `${r.consecutive_failures} failed: ${r.probe_error}` : "ok"),
          h("td", {}, h("button", { type: "button", id, class: action, "aria-label": `${action} ${name}`,
            onclick: () => act(name, action) }, action === "drain" ? "Drain" : "Undrain")));
      })))));
  document.getElementById("pools").replaceChildren(...sections);
  if (focused && document.getElementById(focused)) document.getElementById(focused).focus();
}

function render(state) {
  renderTenants(state.tenants);
  renderReplicas(state);
}

document.getElementById("login").addEventListener("submit", onLogin);
if (needsToken && !token) askToken();
else poll();

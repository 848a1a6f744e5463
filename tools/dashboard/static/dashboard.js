// The mlx-kvstore dashboard: read-only views over GET v1/stats, v1/checkpoints and
// v1/formats/{id}. Every request carries the bearer token when one is known: from a
// "#token=..." fragment (never sent to the server, removed from the address bar at
// once) or typed into the form a 401 brings up; it is kept in sessionStorage only.
// Usage over time: one sample of v1/stats per refresh (every ?interval= seconds,
// default 10), kept in localStorage (the last MAX_SAMPLES), so the chart covers the
// time this browser has watched this store.
"use strict";

const MAX_SAMPLES = 720;
const TOKEN_KEY = "kvstore-token";
const SAMPLES_KEY = "kvstore-samples:" + location.host;
const params = new URLSearchParams(location.search);
const intervalS = Math.max(2, Number(params.get("interval")) || 10);
const $ = (sel) => document.querySelector(sel);

const state = { token: null, rows: [], formats: new Map(), samples: loadSamples() };

class AuthError extends Error {}

function readToken() {
  const match = location.hash.match(/token=([^&]+)/);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

async function api(path) {
  const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401 || response.status === 403) throw new AuthError(path);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// -- formatting -------------------------------------------------------------------
function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}
const pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(0)}%`);
const when = (ns) => (ns ? new Date(ns / 1e6).toISOString().replace("T", " ").slice(0, 19) : "–");
function text(el, value) { el.textContent = value; return el; }

// -- cards --------------------------------------------------------------------------
function renderStats(s) {
  const budget = s.budget_nbytes;
  if (budget) {
    const used = s.stored_nbytes / budget;
    text($("#usage"), pct(used));
    $("#usage-bar").style.width = `${Math.min(100, 100 * used)}%`;
    $("#usage-bar").classList.toggle("high", used > 0.9);
    text($("#usage-detail"), `${bytes(s.stored_nbytes)} of ${bytes(budget)} budget`);
  } else {
    text($("#usage"), bytes(s.stored_nbytes));
    text($("#usage-detail"), `no budget set; file ${bytes(s.file_nbytes)}`);
  }
  text($("#dedup"), `${s.dedup_ratio.toFixed(2)}×`);
  text($("#dedup-detail"), `${bytes(s.referenced_raw_nbytes)} referenced / ${bytes(s.raw_nbytes)} stored raw; ` +
       `compression ${s.compression_ratio.toFixed(2)}×`);
  text($("#hitrate"), s.lookups ? pct(s.lookup_hits / s.lookups) : "–");
  text($("#hitrate-detail"), s.lookups
    ? `${s.lookup_hits} of ${s.lookups} lookups; ${s.tokens_matched} of ${s.tokens_looked_up} tokens`
    : "no lookups since the service started");
  text($("#objects"), `${s.checkpoint_count} checkpoints`);
  text($("#objects-detail"), `${s.page_count} pages, ${s.block_count} blocks (${s.pinned_block_count} pinned), ` +
       `${s.format_count} formats, ${s.quarantined_count} quarantined, ${s.evicted_blocks} evicted`);
}

// -- usage chart -----------------------------------------------------------------------
function loadSamples() {
  try { return JSON.parse(localStorage.getItem(SAMPLES_KEY)) || []; } catch { return []; }
}

function addSample(s) {
  state.samples.push({ t: Date.now(), stored: s.stored_nbytes, budget: s.budget_nbytes || null });
  state.samples = state.samples.slice(-MAX_SAMPLES);
  try { localStorage.setItem(SAMPLES_KEY, JSON.stringify(state.samples)); } catch { /* full: keep in memory */ }
}

function renderChart() {
  const svg = $("#chart");
  const W = 720, H = 180, pad = 24;
  const pts = state.samples;
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  const add = (tag, attrs, content) => {
    const el = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (content != null) el.textContent = content;
    svg.appendChild(el);
    return el;
  };
  text($("#chart-note"), `(${pts.length} sample${pts.length === 1 ? "" : "s"}, every ${intervalS}s, kept in this browser)`);
  if (!pts.length) return;
  const t0 = pts[0].t, t1 = Math.max(pts[pts.length - 1].t, t0 + 1);
  const budget = pts[pts.length - 1].budget;
  const top = Math.max(1, budget || 0, ...pts.map((p) => p.stored)) * 1.1;
  const x = (t) => pad + ((W - 2 * pad) * (t - t0)) / (t1 - t0);
  const y = (v) => H - pad - ((H - 2 * pad) * v) / top;
  if (budget) add("line", { class: "budget", x1: pad, x2: W - pad, y1: y(budget), y2: y(budget) });
  const points = pts.length === 1 ? [[pad, y(pts[0].stored)], [W - pad, y(pts[0].stored)]]
    : pts.map((p) => [x(p.t), y(p.stored)]);
  add("polyline", { class: "line", points: points.map((p) => p.join(",")).join(" ") });
  add("text", { x: pad, y: 14 }, bytes(Math.round(top)));
  add("text", { x: pad, y: H - 6 }, new Date(t0).toLocaleTimeString());
  add("text", { x: W - pad - 60, y: H - 6 }, new Date(t1).toLocaleTimeString());
}

// -- checkpoints table ---------------------------------------------------------------------
async function formatOf(id) {
  if (!state.formats.has(id)) {
    state.formats.set(id, api(`v1/formats/${id}`).catch(() => null));
  }
  return state.formats.get(id);
}

function pageFormats(identity) {
  if (!identity) return "?";
  const names = identity.layers.filter((l) => l.kind === "full").map((l) => l.page_format);
  return [...new Set(names)].join("+") || "none";
}

async function loadCheckpoints() {
  const body = await api("v1/checkpoints");
  const rows = [];
  for (const c of body.checkpoints) {
    const identity = await formatOf(c.format_id);
    rows.push({
      name: c.name, namespace: c.namespace, model: identity ? identity.model_id : "?",
      format: pageFormats(identity), tokens: c.num_tokens ?? c.tokens.length,
      blocks: c.chain_keys.length, attachments: Object.keys(c.attachments || {}).length,
      created: c.created_ns,
    });
  }
  rows.sort((a, b) => (a.namespace + "/" + a.name).localeCompare(b.namespace + "/" + b.name));
  state.rows = rows;
}

function matches(row, query) {
  if (!query) return true;
  const hay = `${row.namespace}/${row.name} ${row.model} ${row.format}`.toLowerCase();
  return query.toLowerCase().split(/\s+/).every((word) => hay.includes(word));
}

function renderTable() {
  const query = $("#search").value.trim();
  const tbody = $("#checkpoints tbody");
  tbody.replaceChildren();
  let shown = 0;
  for (const row of state.rows) {
    if (!matches(row, query)) continue;
    shown++;
    const tr = document.createElement("tr");
    tr.dataset.name = `${row.namespace}/${row.name}`;
    for (const [value, cls] of [[row.name], [row.namespace], [row.model], [row.format],
      [row.tokens.toLocaleString("en"), "num"], [row.blocks, "num"], [row.attachments], [when(row.created)]]) {
      const td = document.createElement("td");
      td.textContent = value;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
  text($("#shown"), `${shown} of ${state.rows.length} shown`);
}

// -- refresh loop ------------------------------------------------------------------------------
async function refresh() {
  try {
    const stats = await api("v1/stats");
    await loadCheckpoints();
    $("#token-form").hidden = true;
    $("#main").hidden = false;
    renderStats(stats);
    addSample(stats);
    renderChart();
    renderTable();
    text($("#status"), `updated ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    if (err instanceof AuthError) {
      $("#token-form").hidden = false;
      $("#main").hidden = true;
      text($("#status"), state.token ? "the token was refused" : "a token is required");
    } else {
      text($("#status"), `error: ${err.message}`);
    }
  }
}

$("#token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.token = $("#token-input").value.trim();
  sessionStorage.setItem(TOKEN_KEY, state.token);
  refresh();
});
$("#search").addEventListener("input", renderTable);
$("#search").value = params.get("q") || "";
state.token = readToken();
refresh();
setInterval(refresh, intervalS * 1000);

// The learner's dashboard: plain JavaScript and SVG, no dependency, no build step. It reads the
// service's own API (status, history, memory, snapshots, predict) every few seconds, sending
// the read token when the service asks for one.
"use strict";

const REFRESH_MS = 2000;
const COLORS = ["#4a7bd0", "#e67e22", "#2e8b57", "#c0392b", "#8e44ad", "#16a085", "#d35400", "#2c3e50",
                "#7f8c8d", "#b7950b"];
const state = { token: sessionStorage.getItem("aser-token"), history: [], lastSeen: 0, memoryClass: null,
                memorySignature: null, timer: null };
const $ = (id) => document.getElementById(id);
// labels are whatever devices sent: never HTML
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

// --- talking to the API ---------------------------------------------------------------------
class Unauthorized extends Error {}

async function call(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (state.token) headers.Authorization = "Bearer " + state.token;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401 || response.status === 403) throw new Unauthorized(response.status);
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (e) { /* not JSON */ }
    throw new Error(detail);
  }
  return response;
}
const getJSON = async (path) => (await call(path)).json();

// --- the page's parts -----------------------------------------------------------------------
function counters(st) {
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %");
  const items = [
    ["samples received", st.samples_received], ["samples trained", st.samples_trained],
    ["backlog", st.backlog], ["lag", st.lag.seconds.toFixed(1) + " s"], ["skipped", st.lag.samples_skipped],
    ["thinned", st.lag.samples_thinned],
    ["training steps", st.steps], ["rehearsal steps", st.lag.rehearsal_steps], [`lean steps (${st.lag.lean_when_behind ? "on" : "off"})`, st.lag.lean_steps],
    ["classes", st.classes.length],
    ["online accuracy", pct(st.online.accuracy)],
    [`last ${st.online.window} samples`, pct(st.online.window_accuracy)],
    ["samples scored / unscored", `${st.online.samples_scored} / ${st.online.samples_unscored}`],
    ["new-class samples", st.online.new_class_samples],
    ["called none of these", `${st.online.unknown.known_class_samples} known, ` +
      `${st.online.unknown.new_class_samples} new`], ["model version", st.model_version],
    ["worker restarts", st.worker.restarts],
  ];
  $("counters").innerHTML = items.map(([name, value]) =>
    `<div class="counter" data-name="${name}"><b>${value}</b><span>${name}</span></div>`).join("");
  const loss = st.config.loss ? ` + ${st.config.loss}` : "";  // replay methods only
  const [state, look] = !st.worker.alive ? ["worker stopped", "bad"]
    : st.lag.max_lag_s && st.lag.seconds > st.lag.max_lag_s / 2 ? ["behind", "behind"]
    : st.backlog > 0 ? ["learning", "ok"] : ["idle", "idle"];
  $("state").textContent = st.worker.alive ? `${state} · ${st.method}${loss}` : state;
  $("state").className = "pill " + look;
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

function lineChart(target, series, { yMax = null, yLabel = "", xLabel = "samples trained" } = {}) {
  // drawn at the box's own pixel width (redrawn every refresh), so text and strokes keep their shape
  const W = Math.max(320, Math.round(target.clientWidth || 600)), H = 220, L = 44, R = 10, T = 22, B = 30;
  const points = series.flatMap((s) => s.points);
  const svg = [`<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}">`];
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
    const y1 = yMax ?? Math.max(...ys, 1e-9) * 1.1;
    const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), Y = (y) => H - B - (y / y1) * (H - T - B);
    for (let i = 0; i <= 4; i++) {
      const y = y1 * i / 4;
      svg.push(`<line class="grid" x1="${L}" x2="${W - R}" y1="${Y(y)}" y2="${Y(y)}"/>`,
               `<text x="${L - 4}" y="${Y(y) + 3}" text-anchor="end">${+y.toPrecision(3)}</text>`);
    }
    svg.push(`<line class="axis" x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/>`,
             `<text x="${L}" y="${H - 8}">${x0}</text>`,
             `<text x="${W - R}" y="${H - 8}" text-anchor="end">${x1}</text>`,
             `<text x="${(L + W) / 2}" y="${H - 8}" text-anchor="middle">${xLabel}</text>`,
             `<text x="${L - 4}" y="${T - 10}" text-anchor="end">${yLabel}</text>`);
    for (const s of series) {
      // a point with y null breaks the line (an idle gap); a lone point shows as a dot
      let d = "", pen = "M", alone = [];
      s.points.forEach((p, i) => {
        if (p[1] === null) { pen = "M"; return; }
        const next = s.points[i + 1];
        if (pen === "M" && (!next || next[1] === null)) alone.push(p);
        d += pen + X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1);
        pen = "L";
      });
      svg.push(`<path d="${d}" fill="none" stroke="${s.color}" stroke-width="${s.width || 1.5}"` +
               `${s.dash ? ' stroke-dasharray="4 3"' : ""}><title>${esc(s.name)}</title></path>`,
               ...alone.map((p) => `<circle cx="${X(p[0]).toFixed(1)}" cy="${Y(p[1]).toFixed(1)}" r="2.5" ` +
                                   `fill="${s.color}"><title>${esc(s.name)}</title></circle>`));
    }
  }
  svg.push("</svg>");
  target.innerHTML = svg.join("") + `<div class="legend">${series.map(swatch).join("")}</div>`;
  target.dataset.points = points.filter((p) => p[1] !== null).length;
}

function swatch(s) {
  // the legend draws each series as the chart does: its colour, width and dashes
  return `<span data-series="${esc(s.name)}"><svg width="22" height="8"><line x1="0" y1="4" x2="22" y2="4" ` +
         `stroke="${s.color}" stroke-width="${s.width || 1.5}"${s.dash ? ' stroke-dasharray="4 3"' : ""}/></svg>` +
         `${esc(s.name)}</span>`;
}

// longer than this between two points, the stream was idle: no rate is drawn across the gap
const IDLE_GAP_S = 30;

function rates(points, key) {
  // samples per second between consecutive points; null across an idle gap
  return points.slice(1).map((p, i) => {
    const q = points[i], dt = p.at - q.at;
    return [p.samples_trained, dt > 0 && dt <= IDLE_GAP_S ? Math.max(0, (p[key] - q[key]) / dt) : null];
  });
}

function charts(history) {
  const labels = [...new Set(history.flatMap((p) => Object.keys(p.per_class)))];
  lineChart($("chart-accuracy"), [
    { name: "recent window", color: "#1d2330", width: 2.5,
      points: history.filter((p) => p.window_accuracy !== null).map((p) => [p.samples_trained, 100 * p.window_accuracy]) },
    { name: "cumulative", color: "#7a8599", dash: true,
      points: history.filter((p) => p.accuracy !== null).map((p) => [p.samples_trained, 100 * p.accuracy]) },
    ...labels.map((label, i) => ({ name: label, color: COLORS[i % COLORS.length], width: 1,
      points: history.filter((p) => label in p.per_class).map((p) => [p.samples_trained, 100 * p.per_class[label]]) })),
  ], { yMax: 100, yLabel: "%" });

  // the first moment this page saw and this moment join the stored points, so a burst shows at
  // once, before a point is stored for it
  const points = [...history, state.origin, state.now].filter(Boolean).sort((a, b) => a.at - b.at);
  lineChart($("chart-rates"), [
    { name: "ingested / s", color: "#e67e22", points: rates(points, "received") },
    { name: "trained / s", color: "#4a7bd0", points: rates(points, "samples_trained") },
  ], { yLabel: "/ s" });
  lineChart($("chart-backlog"), [{ name: "backlog (samples)", color: "#999",
    points: points.map((p) => [p.samples_trained, p.backlog]) }], { yLabel: "samples" });
  lineChart($("chart-lag"), [{ name: "lag (s)", color: "#c0392b",
    points: history.filter((p) => p.lag_s !== null).map((p) => [p.samples_trained, p.lag_s]) }], { yLabel: "s" });
  lineChart($("chart-step"), [{ name: "step ms", color: "#8e44ad", points: history.map((p) => [p.samples_trained, p.step_ms]) }],
            { yLabel: "ms" });
  // under ASER_LOSS=ace new classes meet old ones only in the replayed batch: a share near 0 means they never do
  lineChart($("chart-replay"), [{ name: "replayed of incoming classes", color: "#16a085",
    points: history.filter((p) => p.replayed_incoming_share !== null).map((p) => [p.samples_trained, p.replayed_incoming_share]) }],
            { yMax: 100, yLabel: "%" });
}

function memoryBars(st) {
  const total = Math.max(1, ...Object.values(st.buffer));
  $("memory-size").textContent = `${st.buffer_size} samples`;
  $("memory-bars").innerHTML = Object.entries(st.buffer).map(([label, n]) =>
    `<div class="bar" data-label="${esc(label)}"><span>${esc(label)}</span><div style="width:${100 * n / total}%"></div>` +
    `<span>${n}</span></div>`).join("");
  const select = $("memory-class"), current = select.value || state.memoryClass;
  const labels = Object.keys(st.buffer);
  if (labels.join() !== [...select.options].map((o) => o.value).join()) {
    select.innerHTML = labels.map((l) => `<option value="${esc(l)}">${esc(l)}</option>`).join("");
  }
  if (labels.includes(current)) select.value = current;
}

function servingHead(st) {
  // ASER_HEAD=chosen: each head's share of right answers over the classes' recent samples, scored before
  // each step, and the head answering each class (streaming LDA until another is measured better on it);
  // under ASER_HEAD_MEASURE=held-back also each head's share on the samples held back from training, and the
  // prior (ASER_HEAD_PRIOR) that takes a measured class unless its held samples show it worse
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %");
  const choice = st.head_choice;
  const shares = (acc) => ["served", "slda", "top", "mix", "pool"].map((h) => `${h} ${pct(acc[h])}`).join(", ");
  const overall = choice ? " · " + shares(choice.window_accuracy) : "";
  const held = choice && choice.held_back ? ` · held back (${choice.held_back.samples}): ` +
    shares(choice.held_back.accuracy) : "";
  const prior = choice && choice.prior ? ` (prior ${choice.prior})` : "";
  $("head-name").textContent = st.serving_head + prior + overall + held;
  $("head-choice").hidden = !choice;
  $("head-choice").querySelector("tbody").innerHTML = !choice ? "" : Object.entries(choice.classes).map(([label, c]) =>
    `<tr data-label="${esc(label)}"><td>${esc(label)}</td><td>${c.head}</td><td>${pct(c.slda)}</td>` +
    `<td>${pct(c.top)}</td><td>${pct(c.mix)}</td><td>${pct(c.pool)}</td></tr>`).join("");
}

function sleepCard(st) {
  // ASER_SLEEP: awake or asleep, the sleep in progress, the last one's held-back accuracy before and after
  const sleep = st.sleep, pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %");
  $("sleep-card").hidden = !sleep;
  if (!sleep) return;
  const last = sleep.last, when = sleep.schedule;
  const rows = [
    ["state", sleep.state === "sleeping" ? `${sleep.progress.fresh ? "a fresh sleep" : "sleeping"}: ` +
      `${sleep.progress.updates} of ${sleep.progress.budget} sample-updates` : "awake"],
    ["new since the last sleep", `${sleep.new_samples} samples` + (sleep.owed ? ` (${sleep.owed} updates owed)` : "") +
      `; the next after ${when.idle_s} s idle once ${when.min_new} are new`],
    // a night's sleep: the top trained again from ImageNet's weights over everything held, brought by idle time
    ["night's sleep", (when.night_idle_s === null ? "fresh only on request"
      : `after ${when.night_idle_s} s idle once ${when.night_min_new} have arrived since the last: ` +
        `${sleep.new_since_fresh} so far`) + (sleep.fresh_asked ? "; a fresh sleep is asked for" : "")],
    ["sleeps", `${sleep.sleeps}: ${sleep.sample_updates} sample-updates, ${sleep.cpu_seconds.toFixed(0)} CPU s`],
    ["last sleep", !last ? "none yet" : (last.fresh ? "fresh, " : "") +
      `held-back ${pct(last.held_before)} → ${pct(last.held_after)}, ` +
      (last.yielded ? "yielded, " : "") + (last.kept ? "kept" : "rolled back") +
      `, ${last.updates} updates in ${last.cpu_seconds.toFixed(1)} CPU s`],
    ["taught the top", sleep.top_classes.length ? sleep.top_classes.map(esc).join(", ") : "no class yet"],
    ["latent store", `${sleep.store.samples} of ${sleep.store.capacity} samples, ` +
      `${(sleep.store.disk_bytes / 2 ** 20).toFixed(1)} MB`],
  ];
  $("sleep").innerHTML = `<table data-state="${sleep.state}">` +
    rows.map(([k, v]) => `<tr><th>${k}</th><td>${v}</td></tr>`).join("") + "</table>";
}

async function imageURL(path) {
  return URL.createObjectURL(await (await call(path)).blob());
}

async function memoryBrowser(force = false) {
  const label = $("memory-class").value;
  if (!label) return;
  const memory = await getJSON("memory");
  const slots = memory.slots.filter((s) => s.label === label);
  const signature = label + "|" + slots.map((s) => `${s.slot}:${s.entered}`).join();
  if (!force && signature === state.memorySignature) return;  // the class's slots were not rewritten
  state.memoryClass = label;
  state.memorySignature = signature;
  const figures = await Promise.all(slots.map(async (s) =>
    `<figure><img alt="${esc(label)}" src="${await imageURL(`memory/${s.slot}`)}">#${s.slot}</figure>`));
  const box = $("memory-images");
  box.querySelectorAll("img").forEach((img) => URL.revokeObjectURL(img.src));
  box.innerHTML = figures.join("");
  box.dataset.label = label;
  box.dataset.count = slots.length;
}

// --- reviewing suspects: on request (valuing the memory costs the learner a pause), never on the timer
async function suspects() {
  const box = $("suspects");
  box.textContent = "valuing the memory…";
  try {
    const answer = await getJSON("suspects?limit=12");
    const figures = await Promise.all(answer.suspects.map(async (s) =>
      `<figure data-seq="${s.seq ?? ""}" data-label="${esc(s.label)}" data-answer="${esc(s.answer)}">` +
      `<img alt="${esc(s.label)}" src="${await imageURL(`memory/${s.slot}`)}"><figcaption>` +
      `sent as <b>${esc(s.label)}</b><br>the model says ${esc(s.answer)} (${(100 * s.probability).toFixed(0)} %)` +
      `<br>value ${s.value.toFixed(4)}</figcaption>` + (s.seq === null ? "" :
        (s.answer !== s.label ? `<button data-act="relabel">relabel as ${esc(s.answer)}</button>` : "") +
        `<button data-act="confirm">label is right</button><button data-act="forget">forget</button>`) +
      "</figure>"));
    box.innerHTML = figures.join("") || "<p>No suspects: the memory is empty.</p>";
    box.dataset.count = answer.suspects.length;
  } catch (error) {
    box.innerHTML = `<p class="error">${esc(error instanceof Unauthorized ? "the read token is needed" : error.message)}</p>`;
  }
}

async function review(event) {
  const button = event.target.closest("button[data-act]");
  if (!button) return;
  const figure = button.closest("figure"), act = button.dataset.act;
  const label = act === "relabel" ? figure.dataset.answer : figure.dataset.label;
  const options = act === "forget" ? { method: "DELETE" } : { method: "PATCH",
    headers: { "Content-Type": "application/json" }, body: JSON.stringify({ label }) };
  const note = document.createElement("p");
  try {
    const answer = await (await call(`samples/${figure.dataset.seq}`, options)).json();
    note.textContent = act === "forget" ? "forgotten" : act === "confirm" ? "confirmed" : `now ${answer.label}`;
    figure.dataset.done = act;
    figure.querySelectorAll("button").forEach((b) => { b.disabled = true; });
  } catch (error) {
    note.className = "error";
    note.textContent = error instanceof Unauthorized ? "an admin token is needed" : error.message;
  }
  figure.append(note);
}

async function snapshots() {
  const { snapshots } = await getJSON("snapshots");
  $("snapshots").querySelector("tbody").innerHTML = snapshots.slice(0, 10).map((s) =>
    `<tr><td>${s.id}</td><td title="${esc(s.classes.join(", "))}">${s.classes.length}</td><td>${s.samples_trained}</td><td>${s.reason}</td>` +
    `<td><a href="snapshots/${s.id}" data-file="${s.file}" class="download">download</a></td></tr>`).join("");
}

async function download(event) {
  const link = event.target.closest("a.download");
  if (!link) return;
  event.preventDefault();
  const a = document.createElement("a");
  a.href = URL.createObjectURL(await (await call(link.getAttribute("href"))).blob());
  a.download = link.dataset.file;
  a.click();
}

async function predictFile(file) {
  const data = await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result.split(",")[1]);
    reader.onerror = reject;
    reader.readAsDataURL(file);
  });
  const out = $("predict-result");
  try {
    const answer = await (await call("predict", { method: "POST", headers: { "Content-Type": "application/json" },
                                                  body: JSON.stringify({ images: [data], k: 5 }) })).json();
    const top = answer.results[0];
    const unknown = answer.unknown && answer.unknown[0]
      ? `<p class="unknown">None of these? This photo is far from every class learned.</p>` : "";
    out.innerHTML = `<img alt="query" src="data:${file.type};base64,${data}">${unknown}<ol>` +
      top.map((r) => `<li><b>${esc(r.label)}</b> ${(100 * r.probability).toFixed(1)} %</li>`).join("") + "</ol>";
  } catch (error) {
    if (error instanceof Unauthorized) return askForToken();
    out.innerHTML = `<p class="error">${esc(error.message)}</p>`;
  }
}

// --- refresh loop and login -----------------------------------------------------------------
async function refresh() {
  try {
    const st = await getJSON("status");
    $("login").hidden = true;
    $("board").hidden = false;
    counters(st);
    memoryBars(st);
    servingHead(st);
    sleepCard(st);
    state.now = { at: Date.now() / 1000, received: st.samples_received, samples_trained: st.samples_trained,
                  backlog: st.backlog };
    state.origin ??= state.now;  // the first moment this page saw
    for (;;) {  // the history since the last point seen, page by page
      const page = await getJSON(`history?since=${state.lastSeen}&limit=5000`);
      state.history.push(...page);
      if (page.length) state.lastSeen = page[page.length - 1].samples_trained;
      if (page.length < 5000) break;
    }
    charts(state.history);
    await Promise.all([snapshots(), memoryBrowser()]);
  } catch (error) {
    if (error instanceof Unauthorized) return askForToken();
    $("state").textContent = "unreachable: " + error.message;
    $("state").className = "pill bad";
  }
  state.timer = setTimeout(refresh, REFRESH_MS);
}

function askForToken() {
  clearTimeout(state.timer);
  $("board").hidden = true;
  $("login").hidden = false;
  $("state").textContent = "token needed";
  $("state").className = "pill bad";
  $("login-error").textContent = state.token ? "That token was refused." : "";
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem("aser-token", state.token);
  refresh();
});
$("memory-class").addEventListener("change", () => memoryBrowser(true));
$("find-suspects").addEventListener("click", suspects);
$("suspects").addEventListener("click", review);
$("snapshots").addEventListener("click", download);
$("predict-file").addEventListener("change", (e) => e.target.files[0] && predictFile(e.target.files[0]));
const drop = $("drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  if (e.dataTransfer.files[0]) predictFile(e.dataTransfer.files[0]);
});
refresh();

// attnlab viewer: look at every head's attention and switch heads off live.
// "Visualising learned attentions: different heads show different patterns" (Li's slides).
//
// The drawing itself is in draw.js (shared with attnlab.viewer.notebook's views).
// Token and user text only ever enters the document through textContent, setAttribute on
// non-executable attributes, or SVG text nodes: never innerHTML. The JSON API is in API.md.
"use strict";

const draw = window.attnlabDraw;  // static/draw.js: the drawing shared with the notebook views
const el = draw.el;

const state = {
  model: null,        // GET /api/model
  off: new Set(),     // "kind/layer/head" of every head the user switched off
  held: new Set(),    // "kind/layer/head" of the run's held heads (train.mask_heads): always off
  importance: null,   // kind -> [layer][head] -> number | null
  payload: null,      // the last successful POST /api/run answer
  page: 0,            // the page of layers shown (models of many heads: limits.layers_per_page a page)
  focus: null,        // "kind/layer/head" of the head last opened from the overview, highlighted
  scrollToFocus: false,  // scroll the model view to the focused head once it is drawn
  sequence: 0,        // numbers requests; only the newest answer is drawn
  timer: null,
};

const $ = (id) => document.getElementById(id);

function headKey(kind, layer, head) { return `${kind}/${layer}/${head}`; }

function isOff(kind, layer, head) {
  const key = headKey(kind, layer, head);
  return state.off.has(key) || state.held.has(key);
}

function offList() {
  return [...state.off].map((key) => {
    const [kind, layer, head] = key.split("/");
    return { kind, layer: Number(layer), head: Number(head) };
  });
}

function setBusy(busy) { document.body.dataset.state = busy ? "busy" : "ready"; }

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
  if (message) document.body.dataset.state = "error";
}

function showFailure(message) {
  $("output-main").textContent = "";
  $("output-table").hidden = true;
  $("input-tokens").replaceChildren();
  document.body.classList.add("stale");  // the maps below belong to an earlier input
  showError(message);
}

async function api(path, options) {
  const response = await fetch(path, options);
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok) {
    const message = body && typeof body.error === "string" ? body.error : `the server answered ${response.status}`;
    throw new Error(message);
  }
  return body;
}

// ---- pages of layers ----------------------------------------------------------------------

function deepest() { return Math.max(...state.model.heads.map((info) => info.layers)); }

function isPaged() { return state.model.limits.layers_per_page < deepest(); }

function pageCount() { return draw.pageCount(deepest(), state.model.limits.layers_per_page); }

function pageLayers() { return draw.pageLayers(deepest(), state.model.limits.layers_per_page, state.page); }

function pageName(page) { return draw.pageName(deepest(), state.model.limits.layers_per_page, page); }

function fillPager() {
  const pager = $("layer-pager");
  pager.hidden = !isPaged();
  if (pager.hidden) return;
  const select = $("page-select");
  select.replaceChildren(...Array.from({ length: pageCount() }, (_, page) => {
    const option = el("option", pageName(page));
    option.value = String(page);
    return option;
  }));
  select.value = String(state.page);
  $("page-prev").disabled = state.page === 0;
  $("page-next").disabled = state.page === pageCount() - 1;
  $("page-note").textContent = `This model has ${state.model.heads.reduce((sum, info) => sum + info.heads_per_layer.reduce((a, b) => a + b, 0), 0)} heads: ` +
    `${state.model.limits.layers_per_page === 1 ? "one layer" : `${state.model.limits.layers_per_page} layers`} at a time. ` +
    "The head view shows the layers of this page; heads switched off stay off on every page.";
}

function showPage(page) {
  if (page < 0 || page >= pageCount() || page === state.page) return;
  state.page = page;
  fillPager();
  fillLayers();
  scheduleRun(0);
}

function pageOf(layer) { return isPaged() ? Math.floor(layer / state.model.limits.layers_per_page) : 0; }

// An overview cell was clicked: show the head's layer (its page, in the model view and the head
// view) with the head highlighted, and scroll to it.
function openHead(kind, layer, head) {
  state.focus = headKey(kind, layer, head);
  state.scrollToFocus = true;
  $("head-view-kind").value = kind;
  const page = pageOf(layer);
  if (page !== state.page) {
    state.page = page;
    fillPager();
    fillLayers();
    $("head-view-layer").value = String(layer);
    scheduleRun(0);  // the answer holds the new page's maps; drawn with the head highlighted
    return;
  }
  fillLayers();
  $("head-view-layer").value = String(layer);
  drawOverview();
  drawModelView();
  drawHeadView();
}

// ---- running the model -------------------------------------------------------------------

function scheduleRun(delay) {
  clearTimeout(state.timer);
  state.timer = setTimeout(runModel, delay);
}

async function runModel() {
  const text = $("input").value;
  const limits = state.model.limits;
  if (text.length > limits.max_input_chars) {
    state.sequence++;  // an answer still on its way is for an earlier input: drop it
    showFailure(`The input is ${text.length} characters long; the viewer takes at most ${limits.max_input_chars}.`);
    document.body.dataset.runs = String(state.sequence);
    return;
  }
  const sequence = ++state.sequence;
  setBusy(true);
  try {
    const payload = await api("/api/run", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(isPaged() ? { text, off: offList(), layers: pageLayers() } : { text, off: offList() }),
    });
    if (sequence !== state.sequence) return;
    state.payload = payload;
    document.body.classList.remove("stale");
    showError("");
    drawAll();
    setBusy(false);
  } catch (error) {
    if (sequence !== state.sequence) return;
    showFailure(error.message);
  } finally {
    if (sequence === state.sequence) document.body.dataset.runs = String(sequence);
  }
}

function toggleHead(kind, layer, head) {
  const key = headKey(kind, layer, head);
  if (state.off.has(key)) state.off.delete(key); else state.off.add(key);
  $("off-count").textContent = String(state.off.size);
  scheduleRun(0);
}

// ---- drawing ------------------------------------------------------------------------------

function drawAll() {
  drawOutput(state.payload.output);
  drawTokens(state.payload.tokens);
  drawOverview();
  drawModelView();
  drawHeadView();
}

function drawTokens(tokens) {
  const box = $("input-tokens");
  box.replaceChildren(...tokens.map((token) => el("span", token, "token-chip")));
}

function drawOutput(output) {
  const table = $("output-table");
  const rows = [];
  if (output.type === "class") {
    $("output-label").textContent = "class";
    $("output-main").textContent = `${output.label} (p = ${output.probability.toFixed(4)})`;
    $("output-table-head").textContent = "class";
    for (const item of output.classes) rows.push([item.label, item.probability]);
  } else if (output.type === "continuation") {
    $("output-label").textContent = "greedy continuation";
    $("output-main").textContent = output.text;
    $("output-table-head").textContent = "next token";
    for (const item of output.next_tokens) rows.push([item.token, item.probability]);
  } else {
    $("output-label").textContent = "decoded sequence";
    $("output-main").textContent = output.text;
  }
  table.hidden = rows.length === 0;
  table.tBodies[0].replaceChildren(...rows.map(([label, probability]) => {
    const row = el("tr");
    const bar = el("div", null, "bar");
    bar.style.width = `${Math.round(probability * 120)}px`;
    const barCell = el("td");
    barCell.append(bar);
    row.append(el("td", label, "token"), el("td", probability.toFixed(4)), barCell);
    return row;
  }));
}

function importanceOf(kind, layer, head) {
  const table = state.importance && state.importance[kind];
  const value = table && table[layer] ? table[layer][head] : null;
  if (value === null || value === undefined) return null;
  const all = table.flat().filter((v) => v !== null);
  const low = Math.min(...all), high = Math.max(...all);
  return { value, scaled: high > low ? (value - low) / (high - low) : 1 };
}

function importanceShade(importance) { return `hsl(25, 90%, ${Math.round(92 - 50 * importance.scaled)}%)`; }

function drawOverview() {
  draw.drawOverview($("overview"), state.model.heads, state.payload.overview, overviewCell);
}

function overviewCell(kind, layer, head, canvas, offInRun) {
  const key = headKey(kind, layer, head);
  const held = state.held.has(key);
  const status = held ? "held" : offInRun ? "off" : "";
  const cell = draw.overviewCell("button", kind, layer, head, canvas, status);
  cell.type = "button";
  if (key === state.focus) cell.classList.add("focused");
  let title = `${kind}, layer ${layer}, head ${head}${status ? ` (${held ? "held at zero in training" : "switched off"})` : ""}` +
    ": click to open its layer";
  const importance = importanceOf(kind, layer, head);
  if (importance) {
    cell.style.borderColor = importanceShade(importance);
    title += ` (importance ${importance.value.toPrecision(4)})`;
    cell.dataset.importance = String(importance.value);
  }
  cell.title = title;
  cell.addEventListener("click", () => openHead(kind, layer, head));
  return cell;
}

function drawModelView() {
  draw.drawModelView($("model-view"), state.model.heads, state.payload.attention, headCell);
  const focused = document.querySelector("#model-view .head-cell.focused");
  if (focused && state.scrollToFocus) focused.scrollIntoView({ block: "center" });
  state.scrollToFocus = false;
}

function headCell(kind, layer, head, weights) {
  const held = state.held.has(headKey(kind, layer, head));
  const off = held || state.off.has(headKey(kind, layer, head));
  const { cell, label } = draw.headCell("button", kind, layer, head, weights, held ? "held" : off ? "off" : "");
  cell.type = "button";
  if (headKey(kind, layer, head) === state.focus) cell.classList.add("focused");
  cell.setAttribute("aria-pressed", off ? "true" : "false");
  if (held) cell.setAttribute("aria-disabled", "true");
  let title = held
    ? `${kind}, layer ${layer}, head ${head}: held at zero in training (train.mask_heads), always off`
    : `${kind}, layer ${layer}, head ${head}: click to switch ${off ? "on" : "off"}`;
  const importance = importanceOf(kind, layer, head);
  if (importance) {
    const shade = importanceShade(importance);
    cell.style.borderColor = shade;
    label.style.background = shade;
    title += ` (importance ${importance.value.toPrecision(4)})`;
    cell.dataset.importance = String(importance.value);
  }
  cell.title = title;
  if (!held) cell.addEventListener("click", () => toggleHead(kind, layer, head));
  return cell;
}

function fillHeadViewSelectors() {
  const kinds = $("head-view-kind");
  kinds.replaceChildren(...state.model.heads.map((info) => {
    const option = el("option", info.title);
    option.value = info.kind;
    return option;
  }));
  fillLayers();
}

function fillLayers() {
  const info = state.model.heads.find((item) => item.kind === $("head-view-kind").value);
  const layers = $("head-view-layer");
  const keep = layers.value;
  const shown = isPaged() ? pageLayers().filter((layer) => layer < info.layers)
    : Array.from({ length: info.layers }, (_, layer) => layer);
  layers.replaceChildren(...shown.map((layer) => {
    const option = el("option", String(layer));
    option.value = String(layer);
    return option;
  }));
  if (keep && shown.includes(Number(keep))) layers.value = keep;
}

function drawHeadView() {
  const root = $("head-view"), legend = $("head-view-legend");
  if (!state.payload) {
    root.replaceChildren();
    legend.replaceChildren();
    return;
  }
  const kind = $("head-view-kind").value;
  const layer = Number($("head-view-layer").value);
  const map = state.payload.attention.find((item) => item.kind === kind && item.layer === layer);
  draw.drawHeadView(root, legend, map, (head) =>
    state.held.has(headKey(kind, layer, head)) ? "held" : isOff(kind, layer, head) ? "off" : "");
}

// ---- importance ---------------------------------------------------------------------------

function showImportance(table, source) {
  state.importance = table;
  $("importance-status").textContent = table ? `head colours: importance from ${source}` : "";
  if (state.payload) {
    drawOverview();
    drawModelView();
  }
}

async function loadImportanceFile(file) {
  try {
    const body = await api("/api/importance", { method: "POST", headers: { "Content-Type": "text/csv" }, body: await file.text() });
    showImportance(body.importance, file.name);
    showError("");
  } catch (error) {
    showError(`${file.name}: ${error.message}`);
  }
}

// ---- start --------------------------------------------------------------------------------

async function start() {
  try {
    state.model = await api("/api/model");
  } catch (error) {
    showError(`cannot reach the viewer's API: ${error.message}`);
    return;
  }
  const model = state.model;
  $("run-info").textContent = `run ${model.run}: ${model.model_kind.replace("_", " ")} on task ${model.task}, ${model.attention} attention`;
  $("limits").textContent = `Inputs up to ${model.limits.max_input_tokens} tokens (${model.limits.max_input_chars} characters); ` +
    `outputs up to ${model.limits.max_output_tokens} tokens.`;
  if (model.importance) showImportance(model.importance, "--importance");
  for (const head of model.held || []) state.held.add(headKey(head.kind, head.layer, head.head));
  if (state.held.size) {
    $("held-note").textContent = `Held at zero in training (train.mask_heads), always off: ` +
      (model.held || []).map((head) => `${head.kind}:${head.layer}:${head.head}`).join(", ");
    $("held-note").hidden = false;
  }
  fillPager();
  fillHeadViewSelectors();
  $("page-select").addEventListener("change", () => showPage(Number($("page-select").value)));
  $("page-prev").addEventListener("click", () => showPage(state.page - 1));
  $("page-next").addEventListener("click", () => showPage(state.page + 1));
  $("input").value = model.example || "";
  $("input-form").addEventListener("submit", (event) => { event.preventDefault(); scheduleRun(0); });
  $("input").addEventListener("input", () => scheduleRun(250));
  $("head-view-kind").addEventListener("change", () => { fillLayers(); drawHeadView(); });
  $("head-view-layer").addEventListener("change", drawHeadView);
  $("reset-heads").addEventListener("click", () => { state.off.clear(); $("off-count").textContent = "0"; scheduleRun(0); });
  $("importance-file").addEventListener("change", (event) => {
    const file = event.target.files[0];
    if (file) loadImportanceFile(file);
  });
  $("importance-clear").addEventListener("click", () => { $("importance-file").value = ""; showImportance(null, ""); });
  scheduleRun(0);
}

document.addEventListener("DOMContentLoaded", start);

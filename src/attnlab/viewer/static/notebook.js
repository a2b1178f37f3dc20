// attnlab notebook views (attnlab.viewer.notebook): draw one view from the JSON embedded in its
// container, with draw.js (the viewer page's own drawing code). Nothing is fetched: the data is
// in the container's script element of type application/json, read with JSON.parse.
//
// Token text only ever enters the document through textContent or SVG text nodes, never innerHTML.
// Everything lives inside one function, so that this file can be included once per view.
(function (global) {
  "use strict";

  const draw = global.attnlabDraw;
  const el = draw.el;

  function headKey(kind, layer, head) { return `${kind}/${layer}/${head}`; }

  function labelled(text, control) {
    const label = el("label", text);
    label.append(" ", control);
    return label;
  }

  function select(options, value) {
    const node = el("select");
    node.replaceChildren(...options.map(([optionValue, text]) => {
      const option = el("option", text);
      option.value = String(optionValue);
      return option;
    }));
    node.value = String(value);
    return node;
  }

  function outputLine(output) {
    const line = el("p", null, "attnlab-nb-output");
    if (output.type === "class") {
      line.append(el("span", "class "), el("strong", `${output.label} (p = ${output.probability.toFixed(4)})`));
    } else if (output.type === "continuation") {
      line.append(el("span", "greedy continuation "), el("strong", output.text));
      const next = output.next_tokens.map((item) => `${item.token} ${item.probability.toFixed(3)}`).join(" · ");
      line.append(el("span", ` (next token: ${next})`, "muted"));
    } else if (output.type === "sequence") {
      line.append(el("span", "decoded sequence "), el("strong", output.text));
    }
    return line;
  }

  function tokenLine(tokens) {
    const line = el("p", "Input tokens: ", "muted");
    line.append(...tokens.map((token) => el("span", token, "token-chip")));
    return line;
  }

  function offLine(data) {
    const heads = [...data.held.map((h) => `${h.kind}:${h.layer}:${h.head} (held)`),
      ...data.off.map((h) => `${h.kind}:${h.layer}:${h.head}`)];
    return el("p", heads.length ? `Heads switched off: ${heads.join(", ")}` : "All heads on.", "muted");
  }

  function headView(body, data, status) {
    const kinds = data.heads.filter((info) => data.attention.some((map) => map.kind === info.kind));
    const kindSelect = select(kinds.map((info) => [info.kind, info.title]), data.kind);
    const layerSelect = el("select");
    const legend = el("div", null, "attnlab-nb-legend");
    const root = draw.svg("svg", { role: "img", "aria-label": "attention lines between tokens", class: "attnlab-nb-head-view" });
    function fillLayers(keep) {
      const layers = data.attention.filter((map) => map.kind === kindSelect.value).map((map) => map.layer);
      layerSelect.replaceChildren(...layers.map((layer) => {
        const option = el("option", String(layer));
        option.value = String(layer);
        return option;
      }));
      if (layers.includes(keep)) layerSelect.value = String(keep);
    }
    function redraw() {
      const kind = kindSelect.value, layer = Number(layerSelect.value);
      const map = data.attention.find((item) => item.kind === kind && item.layer === layer);
      draw.drawHeadView(root, legend, map, (head) => status(kind, layer, head));
    }
    kindSelect.addEventListener("change", () => { fillLayers(Number(layerSelect.value)); redraw(); });
    layerSelect.addEventListener("change", redraw);
    fillLayers(data.layer);
    const controls = el("p", null, "attnlab-nb-controls");
    controls.append(labelled("Attention", kindSelect), " ", labelled("Layer", layerSelect));
    body.append(el("p", "Lines join each query token (left) to the keys it attends to (right); darker is more " +
      "attention. Point at a token to see only its lines. Switched-off heads are dashed.", "muted"), controls, legend, root);
    redraw();
  }

  function modelView(body, data, status) {
    const pages = data.pages;
    let page = Math.max(0, pages.findIndex((layers) => layers.includes(data.layer)));
    const grid = el("div", null, "attnlab-nb-model-view");
    const pager = el("p", null, "attnlab-nb-pager");
    const previous = el("button", "‹ previous"), next = el("button", "next ›");
    previous.type = next.type = "button";
    const pageName = (layers) => layers.length === 1 ? `layer ${layers[0]}` : `layers ${layers[0]}–${layers[layers.length - 1]}`;
    const pageSelect = select(pages.map((layers, index) => [index, pageName(layers)]), page);
    pager.append(previous, " ", labelled("Showing", pageSelect), " ", next);
    const overview = el("div", null, "attnlab-nb-overview");
    let focus = null;  // "kind/layer/head" of the head last opened from the overview
    function cell(kind, layer, head, weights) {
      const shown = status(kind, layer, head);
      const { cell } = draw.headCell("div", kind, layer, head, weights, shown);
      cell.title = `${kind}, layer ${layer}, head ${head}${shown ? `: ${shown}` : ""}`;
      if (headKey(kind, layer, head) === focus) cell.classList.add("focused");
      return cell;
    }
    function thumbnailCell(kind, layer, head, canvas) {
      const shown = status(kind, layer, head);
      const cell = draw.overviewCell("button", kind, layer, head, canvas, shown);
      cell.type = "button";
      const target = pages.findIndex((layers) => layers.includes(layer));
      if (headKey(kind, layer, head) === focus) cell.classList.add("focused");
      cell.title = `${kind}, layer ${layer}, head ${head}${shown ? `: ${shown}` : ""}` +
        (target < 0 ? " (its layer is not embedded: pass layers=[...])" : ": click to show its layer");
      if (target < 0) cell.disabled = true;
      else cell.addEventListener("click", () => { focus = headKey(kind, layer, head); showPage(target); });
      return cell;
    }
    function showPage(index) {
      page = index;
      pageSelect.value = String(page);
      previous.disabled = page === 0;
      next.disabled = page === pages.length - 1;
      body.parentElement.dataset.page = String(page);
      const layers = new Set(pages[page]);
      draw.drawOverview(overview, data.heads, data.overview, thumbnailCell);
      draw.drawModelView(grid, data.heads, data.attention.filter((map) => layers.has(map.layer)), cell);
    }
    previous.addEventListener("click", () => showPage(page - 1));
    next.addEventListener("click", () => showPage(page + 1));
    pageSelect.addEventListener("change", () => showPage(Number(pageSelect.value)));
    pager.hidden = pages.length < 2;
    body.append(el("p", "Overview: every head, one row a layer, its map pooled to at most 16 × 16 blocks; " +
      "click one to show its layer.", "muted"), overview,
    el("p", "Every head of the layers shown (rows: query tokens, columns: key tokens). " +
      "To switch heads off, ask again with off=[...].", "muted"), pager, grid);
    showPage(page);
  }

  // Draw the view whose container is `root` (a div holding the JSON), once.
  function render(root) {
    if (!root || root.dataset.rendered) return;
    const source = root.querySelector("script.attnlab-nb-data");
    const data = JSON.parse(source.textContent);
    root.dataset.rendered = "true";
    for (const fallback of root.querySelectorAll(".attnlab-nb-fallback")) fallback.remove();
    const off = new Set(data.off.map((h) => headKey(h.kind, h.layer, h.head)));
    const held = new Set(data.held.map((h) => headKey(h.kind, h.layer, h.head)));
    const status = (kind, layer, head) => held.has(headKey(kind, layer, head)) ? "held"
      : off.has(headKey(kind, layer, head)) ? "off" : "";
    const body = el("div", null, "attnlab-nb-body");
    root.append(body);
    body.append(el("p", data.title, "attnlab-nb-title"));
    if (data.output) body.append(outputLine(data.output));
    body.append(tokenLine(data.tokens), offLine(data));
    if (data.view === "head") headView(body, data, status); else modelView(body, data, status);
  }

  global.attnlabNotebook = Object.freeze({ render });
})(window);

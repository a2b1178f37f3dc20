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

  // The attention-kind and layer selects of a view that draws one map at a time (the head view and
  // the patterns view); onChange() runs when either changes, current() is the map they name.
  function mapPicker(data, onChange) {
    const kinds = data.heads.filter((info) => data.attention.some((map) => map.kind === info.kind));
    const kindSelect = select(kinds.map((info) => [info.kind, info.title]), data.kind);
    const layerSelect = el("select");
    function fillLayers(keep) {
      const layers = data.attention.filter((map) => map.kind === kindSelect.value).map((map) => map.layer);
      layerSelect.replaceChildren(...layers.map((layer) => {
        const option = el("option", String(layer));
        option.value = String(layer);
        return option;
      }));
      if (layers.includes(keep)) layerSelect.value = String(keep);
    }
    kindSelect.addEventListener("change", () => { fillLayers(Number(layerSelect.value)); onChange(); });
    layerSelect.addEventListener("change", onChange);
    fillLayers(data.layer);
    const controls = el("p", null, "attnlab-nb-controls");
    controls.append(labelled("Attention", kindSelect), " ", labelled("Layer", layerSelect));
    const current = () => data.attention.find((item) => item.kind === kindSelect.value &&
      item.layer === Number(layerSelect.value));
    return { controls, current };
  }

  function headView(body, data, status) {
    const legend = el("div", null, "attnlab-nb-legend");
    const root = draw.svg("svg", { role: "img", "aria-label": "attention lines between tokens", class: "attnlab-nb-head-view" });
    const picker = mapPicker(data, redraw);
    function redraw() {
      const map = picker.current();
      draw.drawHeadView(root, legend, map, (head) => status(map.kind, map.layer, head));
    }
    body.append(el("p", "Lines join each query token (left) to the keys it attends to (right); darker is more " +
      "attention. Point at a token to see only its lines. Switched-off heads are dashed.", "muted"), picker.controls, legend, root);
    redraw();
  }

  // The patterns view (attnlab.show_patterns): a layer's heads as buttons with their heatmaps, the
  // chosen head's map drawn large, and the tokens, coloured by the attention the query token (the one
  // pointed at, else the one clicked; at first the last) pays to each of them, its weight under each.
  function patternsView(body, data, status) {
    const root = body.parentElement;
    const heads = el("div", null, "attnlab-nb-pattern-heads");
    const large = el("canvas", null, "attnlab-nb-pattern-map");
    const marker = el("div", null, "attnlab-nb-pattern-row");  // the query's row, over the large map
    const frame = el("div", null, "attnlab-nb-pattern-frame");
    frame.append(large, marker);
    const caption = el("p", null, "attnlab-nb-pattern-caption");
    const queryRow = el("div", null, "attnlab-nb-pattern-tokens");
    const keyRow = el("div", null, "attnlab-nb-pattern-tokens");
    let map = null, index = 0, kept = null, pointed = null;
    let queryChips = [], keyChips = [];
    const picker = mapPicker(data, () => { index = 0; kept = null; drawMap(); });

    function chip(token, position, pickable) {
      const node = el("span", null, "attnlab-nb-token");
      node.dataset.index = String(position);
      node.append(el("span", token, "attnlab-nb-token-text"), el("span", "", "attnlab-nb-weight"));
      if (pickable) {
        node.classList.add("pickable");
        node.addEventListener("mouseenter", () => { pointed = position; paint(); });
        node.addEventListener("mouseleave", () => { pointed = null; paint(); });
        node.addEventListener("click", () => { kept = position; paint(); });
      }
      return node;
    }
    function drawMap() {
      map = picker.current();
      if (!map.weights.length) {  // a pruned layer that has none of the heads asked for
        heads.replaceChildren();
        keyRow.replaceChildren();
        queryRow.replaceChildren();
        large.hidden = marker.hidden = true;
        caption.textContent = `Layer ${map.layer} has none of the heads shown.`;
        return;
      }
      large.hidden = marker.hidden = false;
      index = Math.min(index, map.weights.length - 1);
      kept = kept === null ? map.queries.length - 1 : Math.min(kept, map.queries.length - 1);
      // Self-attention (keys: the queries, and a sink's column) has one row; cross-attention two.
      const shared = map.kind !== "cross" && map.queries.every((token, position) => map.keys[position] === token);
      keyChips = map.keys.map((token, position) => chip(token, position, shared && position < map.queries.length));
      queryChips = shared ? keyChips : map.queries.map((token, position) => chip(token, position, true));
      keyRow.replaceChildren(...keyChips);
      queryRow.replaceChildren(...(shared ? [] : queryChips));
      queryRow.hidden = shared;
      heads.replaceChildren(...map.weights.map((weights, position) => {
        const head = draw.headNumber(map, position);
        const shown = status(map.kind, map.layer, head);
        const { cell } = draw.headCell("button", map.kind, map.layer, head, weights, shown);
        cell.type = "button";
        cell.title = `${map.kind}, layer ${map.layer}, head ${head}${shown ? `: ${shown}` : ""}: click to show it`;
        cell.addEventListener("click", () => { index = position; drawHead(); });
        return cell;
      }));
      drawHead();
    }
    function drawHead() {
      [...heads.children].forEach((cell, position) => {
        cell.classList.toggle("selected", position === index);
        cell.setAttribute("aria-pressed", String(position === index));
      });
      draw.heatmap(large, map.weights[index]);
      const side = (count) => `${Math.min(360, Math.max(96, 16 * count))}px`;
      large.style.width = side(map.keys.length);
      large.style.height = side(map.queries.length);
      root.dataset.layer = String(map.layer);
      root.dataset.head = String(draw.headNumber(map, index));
      paint();
    }
    function paint() {
      const query = pointed !== null ? pointed : kept;
      const row = map.weights[index][query];
      root.dataset.query = String(query);
      marker.style.top = `${100 * query / map.queries.length}%`;
      marker.style.height = `${100 / map.queries.length}%`;
      queryChips.forEach((node, position) => node.classList.toggle("query", position === query));
      keyChips.forEach((node, position) => {
        const [red, green, blue] = draw.shade(row[position]);
        node.style.background = `rgb(${red}, ${green}, ${blue})`;
        node.style.color = row[position] > 0.6 ? "#fff" : "";
        node.lastChild.textContent = row[position].toFixed(3);
      });
      const best = row.indexOf(Math.max(...row));
      const head = draw.headNumber(map, index), shown = status(map.kind, map.layer, head);
      caption.textContent = `Layer ${map.layer}, head ${head}${shown ? ` (${shown})` : ""}: query ` +
        `${JSON.stringify(map.queries[query])} (position ${query}) pays most attention, ${row[best].toFixed(3)}, ` +
        `to ${JSON.stringify(map.keys[best])} (position ${best}).`;
    }
    function rowAt(event) {
      const box = large.getBoundingClientRect();
      const row = Math.floor((event.clientY - box.top) / box.height * map.queries.length);
      return Math.max(0, Math.min(map.queries.length - 1, row));
    }
    large.addEventListener("mousemove", (event) => { pointed = rowAt(event); paint(); });
    large.addEventListener("mouseleave", () => { pointed = null; paint(); });
    large.addEventListener("click", (event) => { kept = rowAt(event); paint(); });

    const figure = el("div", null, "attnlab-nb-pattern-figure");
    const tokens = el("div", null, "attnlab-nb-pattern-words");
    tokens.append(queryRow, keyRow);
    figure.append(frame, tokens);
    body.append(el("p", "Each head of the layer (click one to show it). Point at a token, or a row of the map " +
      "(rows: queries, columns: keys), to colour the tokens by the attention it pays them; click to keep it.", "muted"),
    picker.controls, heads, caption, figure);
    drawMap();
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
    if (data.view === "head") headView(body, data, status);
    else if (data.view === "patterns") patternsView(body, data, status);
    else modelView(body, data, status);
  }

  global.attnlabNotebook = Object.freeze({ render });
})(window);

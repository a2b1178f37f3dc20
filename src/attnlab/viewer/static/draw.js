// attnlab attention drawing: the head view (lines between tokens), the model view (a heatmap per
// head) and its overview (a thumbnail per head of every layer), shared by the viewer page (viewer.js, data from the server) and the notebook views
// (notebook.js, data embedded in the notebook's output, which also draws its patterns view with these pieces). Nothing here fetches anything.
//
// Token text only ever enters the document through textContent, setAttribute on non-executable
// attributes, or SVG text nodes: never innerHTML. Everything lives inside one function, so that
// this file can be included many times in one document (one notebook output per view).
(function (global) {
  "use strict";

  const SVG_NS = "http://www.w3.org/2000/svg";
  const HEAD_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf"];

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function svg(tag, attributes) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, String(value));
    return node;
  }

  // ---- pages of layers (models of many heads show limits.layers_per_page layers at a time) ----

  function pageCount(layers, perPage) { return Math.ceil(layers / perPage); }

  function pageLayers(layers, perPage, page) {
    const first = page * perPage;
    return Array.from({ length: Math.max(0, Math.min(perPage, layers - first)) }, (_, index) => first + index);
  }

  function pageName(layers, perPage, page) {
    const first = page * perPage, last = Math.min(layers, first + perPage) - 1;
    return first === last ? `layer ${first}` : `layers ${first}–${last}`;
  }

  // ---- model view ------------------------------------------------------------------------------

  // The colour of a weight w in [0, 1] (white to blue), as [red, green, blue] bytes.
  function shade(w) {
    const clipped = Math.max(0, Math.min(1, w));
    return [Math.round(255 - 220 * clipped), Math.round(255 - 170 * clipped), Math.round(255 - 40 * clipped)];
  }

  // Paint a rows x columns map into a canvas, one pixel a weight: at(r, c) is the weight in [0, 1].
  function paint(canvas, rows, columns, at) {
    canvas.width = Math.max(columns, 1);
    canvas.height = Math.max(rows, 1);
    const context = canvas.getContext("2d");
    const image = context.createImageData(canvas.width, canvas.height);
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < columns; c++) {
        const index = 4 * (r * canvas.width + c);
        image.data.set(shade(at(r, c)), index);
        image.data[index + 3] = 255;
      }
    }
    context.putImageData(image, 0, 0);
  }

  // The head number of the index-th map of `map.weights`: `map.heads` lists them where a view
  // embeds only some heads (attnlab.show(heads=...)); otherwise the index is the head.
  function headNumber(map, index) { return map.heads ? map.heads[index] : index; }

  // One heatmap of a head's weights (rows: queries, columns: keys) into a canvas.
  function heatmap(canvas, weights) {
    paint(canvas, weights.length, weights.length ? weights[0].length : 0, (r, c) => weights[r][c]);
  }

  // One thumbnail of the overview (attnlab.viewer.overview): base64 of rows x columns bytes,
  // row-major, byte b standing for the pooled weight b / 255.
  function thumbnail(canvas, data, rows, columns) {
    const bytes = atob(data);
    paint(canvas, rows, columns, (r, c) => bytes.charCodeAt(r * columns + c) / 255);
  }

  // The model view: for each kind of `heads` (GET /api/model's list), a grid of one row per map of
  // `maps` (POST /api/run's `attention`), one cell per head made by makeCell(kind, layer, head, weights).
  function drawModelView(root, heads, maps, makeCell) {
    root.replaceChildren();
    for (const info of heads) {
      const block = el("div", null, "kind-block");
      block.append(el("h3", `${info.title} (${info.kind})`));
      const grid = el("div", null, "head-grid");
      grid.style.gridTemplateColumns = `4rem repeat(${info.heads}, max-content)`;
      for (const map of maps.filter((item) => item.kind === info.kind)) {
        grid.append(el("span", `layer ${map.layer}`, "layer-label"));
        map.weights.forEach((weights, index) => grid.append(makeCell(info.kind, map.layer, headNumber(map, index), weights)));
        pad(grid, info.heads - map.weights.length);  // a pruned layer: fewer heads than the widest
      }
      block.append(grid);
      root.append(block);
    }
  }

  // Empty cells that end a grid row short of the widest layer's heads.
  function pad(grid, count) {
    for (let index = 0; index < count; index++) grid.append(el("span", null, "empty-cell"));
  }

  // A head's cell without behaviour: its heatmap and its label; `status` is "", "off" or "held".
  function headCell(tag, kind, layer, head, weights, status) {
    const cell = el(tag, null, "head-cell" + (status ? " off" : "") + (status === "held" ? " held" : ""));
    cell.dataset.kind = kind;
    cell.dataset.layer = String(layer);
    cell.dataset.head = String(head);
    const canvas = document.createElement("canvas");
    heatmap(canvas, weights);
    const label = el("span", `L${layer} H${head}${status ? " " + status : ""}`);
    cell.append(canvas, label);
    return { cell, label };
  }

  // ---- overview ----------------------------------------------------------------------------------

  // The overview of the whole model: for each kind of `heads` (GET /api/model's list), a grid of
  // rows = layers and columns = heads, one thumbnail a head from `overview` (POST /api/run's
  // `overview`). makeCell(kind, layer, head, canvas, off) makes a cell around the thumbnail's
  // canvas; `off` says whether the head was switched off in that run.
  function drawOverview(root, heads, overview, makeCell) {
    root.replaceChildren();
    for (const info of heads) {
      const block = el("div", null, "overview-block");
      block.dataset.kind = info.kind;
      const count = info.heads_per_layer.reduce((a, b) => a + b, 0);
      block.append(el("h3", `${info.title} (${info.kind}): ${info.layers} layers × ${info.heads} heads, ${count} in all`));
      const grid = el("div", null, "overview-grid");
      grid.style.gridTemplateColumns = `3rem repeat(${info.heads}, max-content)`;
      grid.append(el("span"), ...Array.from({ length: info.heads }, (_, head) => el("span", `H${head}`, "overview-head")));
      for (const map of overview.maps.filter((item) => item.kind === info.kind)) {
        grid.append(el("span", `L${map.layer}`, "overview-layer"));
        const off = new Set(map.off);
        map.heads.forEach((data, head) => {
          const canvas = document.createElement("canvas");
          thumbnail(canvas, data, map.rows, map.columns);
          grid.append(makeCell(info.kind, map.layer, head, canvas, off.has(head)));
        });
        pad(grid, info.heads - map.heads.length);
      }
      block.append(grid);
      root.append(block);
    }
  }

  // An overview cell without behaviour: the thumbnail; `status` is "", "off" or "held".
  function overviewCell(tag, kind, layer, head, canvas, status) {
    const cell = el(tag, null, "overview-cell" + (status ? " off" : "") + (status === "held" ? " held" : ""));
    cell.dataset.kind = kind;
    cell.dataset.layer = String(layer);
    cell.dataset.head = String(head);
    cell.setAttribute("aria-label", `${kind}, layer ${layer}, head ${head}${status ? ` (${status})` : ""}`);
    cell.append(canvas);
    return cell;
  }

  // ---- head view -------------------------------------------------------------------------------

  // The head view of one map ({kind, layer, queries, keys, weights}) into the SVG `root`, with a
  // legend of its heads; status(head) is "", "off" or "held".
  function drawHeadView(root, legend, map, status) {
    root.replaceChildren();
    legend.replaceChildren();
    if (!map) return;
    map.weights.forEach((_, index) => {
      const head = headNumber(map, index);
      const swatch = el("span");
      const box = el("i");
      box.style.background = HEAD_COLOURS[head % HEAD_COLOURS.length];
      const shown = status(head);
      swatch.append(box, document.createTextNode(`head ${head}${shown ? ` (${shown})` : ""}`));
      legend.append(swatch);
    });
    const rowHeight = 20, left = 150, right = 350, width = 500;
    const height = rowHeight * (Math.max(map.queries.length, map.keys.length) + 1);
    root.setAttribute("viewBox", `0 0 ${width} ${height}`);
    root.setAttribute("width", String(width));
    root.setAttribute("height", String(height));
    const lines = svg("g");
    map.weights.forEach((weights, index) => {
      const head = headNumber(map, index);
      const off = status(head) !== "";
      weights.forEach((row, q) => row.forEach((w, k) => {
        if (w < 0.01) return;
        lines.append(svg("line", {
          x1: left + 6, y1: rowHeight * (q + 1) - 4, x2: right - 6, y2: rowHeight * (k + 1) - 4,
          stroke: HEAD_COLOURS[head % HEAD_COLOURS.length], "stroke-width": 2,
          "stroke-opacity": (off ? 0.3 : 0.85) * w, "stroke-dasharray": off ? "4 3" : "none",
          "data-query": q, "data-head": head,
        }));
      }));
    });
    root.append(lines);
    const tokens = svg("g");
    map.queries.forEach((token, q) => {
      const text = svg("text", { x: left, y: rowHeight * (q + 1), "text-anchor": "end", "data-side": "query", "data-index": q });
      text.textContent = token;
      text.addEventListener("mouseenter", () => focusQuery(lines, text, q));
      text.addEventListener("mouseleave", () => focusQuery(lines, text, null));
      tokens.append(text);
    });
    map.keys.forEach((token, k) => {
      const text = svg("text", { x: right, y: rowHeight * (k + 1), "text-anchor": "start", "data-side": "key", "data-index": k });
      text.textContent = token;
      tokens.append(text);
    });
    root.append(tokens);
  }

  function focusQuery(lines, text, query) {
    text.classList.toggle("active", query !== null);
    for (const line of lines.children) {
      line.style.display = query === null || Number(line.getAttribute("data-query")) === query ? "" : "none";
    }
  }

  global.attnlabDraw = Object.freeze({
    HEAD_COLOURS, el, svg, shade, heatmap, thumbnail, headCell, headNumber, drawModelView, drawOverview, overviewCell,
    drawHeadView, pageCount, pageLayers, pageName,
  });
})(window);

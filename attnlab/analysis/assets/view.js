(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("attn-data").textContent);
  var SCALE = DATA.scale;
  var HEAD_COLOURS = ["#2f6fde", "#e4572e", "#17a398", "#f2a541", "#8e5bd6", "#d64b8a",
    "#5d9b2f", "#3c4e66", "#c7852b", "#1f9bd1", "#a23b52", "#6c8a1f"];
  var ROW = 20;            // line view: pixels per token
  var GAP = 150;           // line view: pixels between the two token columns
  var state = { layer: 0, head: -1, rowMax: false, sortKey: null, sortDesc: false };
  // cur: the selection's weights; disp: what is drawn (cur, or each row over its maximum).
  var lineEls = [], byQ = [], byK = [], tokEls = { q: [], k: [] }, cur = null, disp = null;

  function el(tag, attrs, parent, ns) {
    var e = ns ? document.createElementNS("http://www.w3.org/2000/svg", tag)
               : document.createElement(tag);
    for (var a in attrs) { if (attrs.hasOwnProperty(a)) e.setAttribute(a, attrs[a]); }
    if (parent) parent.appendChild(e);
    return e;
  }
  function headColour(h) { return h < 0 ? "#3c4e66" : HEAD_COLOURS[h % HEAD_COLOURS.length]; }
  function shown(tok) {   // whitespace made visible
    return tok.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u2205";
  }
  function fmt(w) { return w.toFixed(4); }

  // The weights [q_len * k_len] of the selection: one head, or the mean of all heads.
  function currentWeights() {
    var L = DATA.layers[state.layer], n = L.q_len * L.k_len, out = new Float64Array(n), h, i;
    if (state.head >= 0) {
      var w = L.w[state.head];
      for (i = 0; i < n; i++) out[i] = w[i] / SCALE;
    } else {
      for (h = 0; h < L.heads; h++) { for (i = 0; i < n; i++) out[i] += L.w[h][i]; }
      for (i = 0; i < n; i++) out[i] /= SCALE * L.heads;
    }
    return out;
  }

  function displayWeights(W) {
    if (!state.rowMax) return W;
    var L = DATA.layers[state.layer], out = new Float64Array(W.length);
    for (var q = 0; q < L.q_len; q++) {
      var m = 0, k;
      for (k = 0; k < L.k_len; k++) m = Math.max(m, W[q * L.k_len + k]);
      for (k = 0; k < L.k_len; k++) out[q * L.k_len + k] = m > 0 ? W[q * L.k_len + k] / m : 0;
    }
    return out;
  }

  // Colour ramp of the heatmap: white -> pale blue -> deep blue -> near black.
  var STOPS = [[0, [255, 255, 255]], [0.25, [198, 219, 239]], [0.6, [66, 146, 198]],
               [1, [8, 38, 96]]];
  function colour(w) {
    w = Math.max(0, Math.min(1, w));
    for (var i = 1; i < STOPS.length; i++) {
      if (w <= STOPS[i][0]) {
        var a = STOPS[i - 1], b = STOPS[i], t = (w - a[0]) / (b[0] - a[0]);
        return [0, 1, 2].map(function (c) { return Math.round(a[1][c] + t * (b[1][c] - a[1][c])); });
      }
    }
    return STOPS[STOPS.length - 1][1];
  }
  function rgb(c) { return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; }

  var measureCtx = document.createElement("canvas").getContext("2d");
  function textWidth(s, font) { measureCtx.font = font; return measureCtx.measureText(s).width; }
  var FONT = "13px system-ui, -apple-system, 'Segoe UI', Roboto, 'Noto Sans', sans-serif";
  var SMALL = "11px system-ui, -apple-system, 'Segoe UI', Roboto, 'Noto Sans', sans-serif";

  // ---- pickers ------------------------------------------------------------------------------
  function buildLayerPicker() {
    var sel = document.getElementById("layer-select"), groups = {};
    DATA.layers.forEach(function (L, i) {
      var g = groups[L.group];
      if (!g) { g = groups[L.group] = el("optgroup", { label: L.group }, sel); }
      var o = el("option", { value: String(i) }, g);
      o.textContent = L.path + "  (" + L.heads + (L.heads === 1 ? " head)" : " heads)");
    });
    sel.addEventListener("change", function () { select(+sel.value, state.head); });
  }
  function buildHeadPicker() {
    var box = document.getElementById("head-picker"), L = DATA.layers[state.layer];
    box.textContent = "";
    var all = el("button", { type: "button", "data-head": "-1", title: "mean of all heads" }, box);
    all.textContent = "all";
    for (var h = 0; h < L.heads; h++) {
      var b = el("button", { type: "button", "data-head": String(h), title: "head " + h }, box);
      el("span", { "class": "sw", style: "background:" + headColour(h) }, b);
      b.appendChild(document.createTextNode(String(h)));
    }
    Array.prototype.forEach.call(box.children, function (b) {
      b.addEventListener("click", function () { select(state.layer, +b.getAttribute("data-head")); });
      if (+b.getAttribute("data-head") === state.head) b.className = "on";
    });
  }

  // ---- line view ----------------------------------------------------------------------------
  function drawLines(W, D) {
    var L = DATA.layers[state.layer], svg = document.getElementById("lines");
    var qt = DATA.tokens[L.q_side], kt = DATA.tokens[L.k_side];
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("class", "");
    var qw = 0, kw = 0, i;
    for (i = 0; i < qt.length; i++) qw = Math.max(qw, textWidth(shown(qt[i]), "bold " + FONT));
    for (i = 0; i < kt.length; i++) kw = Math.max(kw, textWidth(shown(kt[i]), "bold " + FONT));
    qw = Math.max(qw, textWidth(L.q_side + " (query)", SMALL) - 36);
    var pad = 8, xq = pad + 36 + qw + 6, xk = xq + GAP, wlab = 40;
    var width = xk + 6 + kw + wlab + pad, top = 26;
    var height = top + Math.max(qt.length, kt.length) * ROW + 8;
    svg.setAttribute("width", width); svg.setAttribute("height", height);
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    var hq = el("text", { x: xq, y: 10, "text-anchor": "end", "class": "weight" }, svg, true);
    hq.textContent = L.q_side + " (query)";
    var hk = el("text", { x: xk, y: 10, "class": "weight" }, svg, true);
    hk.textContent = L.k_side + " (key)";
    var colour = headColour(state.head), lines = el("g", {}, svg, true);
    lineEls = []; byQ = []; byK = [];
    for (i = 0; i < qt.length; i++) byQ.push([]);
    for (i = 0; i < kt.length; i++) byK.push([]);
    for (var q = 0; q < L.q_len; q++) {
      for (var k = 0; k < L.k_len; k++) {
        var w = W[q * L.k_len + k];
        if (w <= 0) continue;
        var ln = el("line", { x1: xq + 4, y1: top + q * ROW + ROW / 2, x2: xk - 4,
          y2: top + k * ROW + ROW / 2, stroke: colour, "stroke-width": 2,
          "stroke-opacity": D[q * L.k_len + k].toFixed(4), "data-q": q, "data-k": k,
          "data-w": w.toFixed(4) }, lines, true);
        lineEls.push(ln); byQ[q].push(ln); byK[k].push(ln);
      }
    }
    tokEls = { q: [], k: [] };
    function column(toks, side, x, anchor) {
      toks.forEach(function (t, j) {
        var g = el("g", { "class": "tok " + side, "data-side": side, "data-index": j }, svg, true);
        var tw = textWidth(shown(t), "bold " + FONT) + 8;
        el("rect", { x: anchor === "end" ? x - tw + 2 : x - 4, y: top + j * ROW + 1, width: tw,
          height: ROW - 2, rx: 3, fill: colour }, g, true);
        var tx = el("text", { x: x, y: top + j * ROW + ROW / 2, "text-anchor": anchor }, g, true);
        tx.textContent = shown(t);
        var title = el("title", {}, g, true);
        title.textContent = side === "q" ? L.q_side + "[" + j + "] " + JSON.stringify(t)
                                         : L.k_side + "[" + j + "] " + JSON.stringify(t);
        var lab = null;
        if (side === "k") {
          lab = el("text", { x: x + tw, y: top + j * ROW + ROW / 2, "class": "weight" }, g, true);
        } else {
          lab = el("text", { x: x - tw - 2, y: top + j * ROW + ROW / 2, "class": "weight",
            "text-anchor": "end" }, g, true);
        }
        tokEls[side].push({ g: g, rect: g.firstChild, label: lab });
        g.addEventListener("mouseenter", function () { focus(side, j); });
        g.addEventListener("mouseleave", function () { focus(null); });
      });
    }
    column(qt, "q", xq, "end");
    column(kt, "k", xk, "start");
  }

  // Highlight the lines of query (side "q") or key (side "k") token j; focus(null) clears.
  function focus(side, j) {
    var svg = document.getElementById("lines"), L = DATA.layers[state.layer], i;
    lineEls.forEach(function (ln) { ln.classList.remove("on"); });
    ["q", "k"].forEach(function (s) {
      tokEls[s].forEach(function (t) {
        t.g.classList.remove("on"); t.rect.style.fillOpacity = ""; t.label.textContent = "";
      });
    });
    if (side === null || side === undefined) { svg.setAttribute("class", ""); return; }
    svg.setAttribute("class", "focusing");
    (side === "q" ? byQ[j] : byK[j]).forEach(function (ln) { ln.classList.add("on"); });
    tokEls[side][j].g.classList.add("on");
    tokEls[side][j].rect.style.fillOpacity = "0.25";
    var other = side === "q" ? "k" : "q", n = side === "q" ? L.k_len : L.q_len;
    for (i = 0; i < n; i++) {
      var w = side === "q" ? cur[j * L.k_len + i] : cur[i * L.k_len + j];
      var t = tokEls[other][i];
      t.rect.style.fillOpacity = (0.85 * (side === "q" ? disp[j * L.k_len + i]
                                                       : disp[i * L.k_len + j])).toFixed(3);
      if (w >= 0.005) t.label.textContent = w.toFixed(2);
    }
  }

  // ---- heatmap ------------------------------------------------------------------------------
  var heat = null;   // geometry of the drawn heatmap
  function drawHeatmap(W) {
    var L = DATA.layers[state.layer], qt = DATA.tokens[L.q_side], kt = DATA.tokens[L.k_side];
    var n = Math.max(L.q_len, L.k_len);
    var cell = Math.max(3, Math.min(30, Math.floor(560 / n)));
    var every = Math.max(1, Math.ceil(12 / cell)), font = cell >= 14 ? FONT : SMALL, i;
    var lw = 0, tw = 0;
    for (i = 0; i < qt.length; i += every) lw = Math.max(lw, textWidth(shown(qt[i]), font));
    for (i = 0; i < kt.length; i += every) tw = Math.max(tw, textWidth(shown(kt[i]), font));
    var left = Math.ceil(lw) + 12, top = Math.ceil(tw) + 12;
    var width = left + L.k_len * cell + 4, height = top + L.q_len * cell + 4;
    var canvas = document.getElementById("heatmap"), dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    canvas.setAttribute("data-layer", L.path); canvas.setAttribute("data-head", state.head);
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    for (var q = 0; q < L.q_len; q++) {
      for (var k = 0; k < L.k_len; k++) {
        ctx.fillStyle = rgb(colour(W[q * L.k_len + k]));
        ctx.fillRect(left + k * cell, top + q * cell, cell, cell);
      }
    }
    ctx.strokeStyle = "#c9ced6"; ctx.lineWidth = 1;
    ctx.strokeRect(left - 0.5, top - 0.5, L.k_len * cell + 1, L.q_len * cell + 1);
    ctx.fillStyle = "#1d232b"; ctx.font = font; ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (i = 0; i < qt.length; i += every) ctx.fillText(shown(qt[i]), left - 6, top + (i + 0.5) * cell);
    ctx.save(); ctx.textAlign = "left";
    for (i = 0; i < kt.length; i += every) {
      ctx.save(); ctx.translate(left + (i + 0.5) * cell, top - 6); ctx.rotate(-Math.PI / 2);
      ctx.fillText(shown(kt[i]), 0, 0); ctx.restore();
    }
    ctx.restore();
    heat = { left: left, top: top, cell: cell, L: L, qt: qt, kt: kt };
    var title = L.kind === "cross"
      ? "Alignment: " + L.q_side + " (rows) \u00d7 " + L.k_side + " (columns)"
      : L.q_side === L.k_side && L.q_side === "tokens"
      ? "Heatmap: queries (rows) \u00d7 keys (columns)"
      : "Heatmap: " + L.q_side + " queries (rows) \u00d7 " + L.k_side + " keys (columns)";
    document.getElementById("heatmap-title").textContent = title;
  }
  function heatHover(ev) {
    var tip = document.getElementById("tooltip"), mark = document.getElementById("cellmark");
    if (!heat) return;
    var r = ev.target.getBoundingClientRect();
    var k = Math.floor((ev.clientX - r.left - heat.left) / heat.cell);
    var q = Math.floor((ev.clientY - r.top - heat.top) / heat.cell);
    if (q < 0 || k < 0 || q >= heat.L.q_len || k >= heat.L.k_len) { heatLeave(); return; }
    var w = cur[q * heat.L.k_len + k];
    tip.innerHTML = "";
    tip.appendChild(document.createTextNode(shown(heat.qt[q]) + " [" + q + "] \u2192 " +
                                            shown(heat.kt[k]) + " [" + k + "]  "));
    var b = document.createElement("b"); b.textContent = fmt(w); tip.appendChild(b);
    tip.setAttribute("data-q", q); tip.setAttribute("data-k", k); tip.setAttribute("data-w", fmt(w));
    tip.style.display = "block";
    tip.style.left = (ev.clientX + 14) + "px"; tip.style.top = (ev.clientY + 14) + "px";
    mark.style.display = "block";
    mark.style.left = (heat.left + k * heat.cell - 2) + "px";
    mark.style.top = (heat.top + q * heat.cell - 2) + "px";
    mark.style.width = mark.style.height = (heat.cell + 4) + "px";
    focus("q", q);
  }
  function heatLeave() {
    document.getElementById("tooltip").style.display = "none";
    document.getElementById("cellmark").style.display = "none";
    focus(null);
  }

  // ---- metrics table ------------------------------------------------------------------------
  var rows = DATA.metrics, cols = rows.length ? Object.keys(rows[0]) : [];
  var layerKey = ["layer", "path", "module", "layer_path"].filter(function (c) {
    return cols.indexOf(c) >= 0; })[0];
  // Columns whose numbers are all whole (head, counts) print as integers, the others with 3 decimals.
  var wholeCols = {};
  cols.forEach(function (c) {
    wholeCols[c] = rows.every(function (r) { return typeof r[c] !== "number" || Number.isInteger(r[c]); });
  });
  function cellText(v, c) {
    if (v === null || v === undefined) return "\u2013";
    if (typeof v === "number") return wholeCols[c] ? String(v) : v.toFixed(3);
    return String(v);
  }
  function buildTable() {
    var table = document.getElementById("metrics");
    if (!rows.length) { document.getElementById("metrics-card").style.display = "none"; return; }
    var ranges = {};
    cols.forEach(function (c) {
      var vals = rows.map(function (r) { return r[c]; })
                     .filter(function (v) { return typeof v === "number" && c !== "head"; });
      if (vals.length === rows.length) {
        // Bars from 0 (or the most negative value): their lengths compare the values themselves.
        ranges[c] = [Math.min(0, Math.min.apply(null, vals)), Math.max(0, Math.max.apply(null, vals))];
      }
    });
    var thead = el("thead", {}, table), tr = el("tr", {}, thead);
    cols.forEach(function (c) {
      var th = el("th", { "data-key": c }, tr);
      if (rows.every(function (r) { return typeof r[c] === "string"; })) th.style.textAlign = "left";
      th.textContent = c.replace(/_/g, " ");
      th.addEventListener("click", function () {
        state.sortDesc = state.sortKey === c ? !state.sortDesc : false;
        state.sortKey = c; fillBody(ranges);
      });
    });
    el("tbody", {}, table);
    fillBody(ranges);
  }
  function fillBody(ranges) {
    var table = document.getElementById("metrics"), tbody = table.tBodies[0];
    var order = rows.map(function (r, i) { return i; });
    if (state.sortKey !== null) {
      var c = state.sortKey, s = state.sortDesc ? -1 : 1;
      order.sort(function (a, b) {
        var x = rows[a][c], y = rows[b][c];
        if (x === y) return a - b;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * s;
      });
    }
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      var on = th.getAttribute("data-key") === state.sortKey;
      th.className = on ? (state.sortDesc ? "sorted desc" : "sorted") : "";
    });
    tbody.textContent = "";
    order.forEach(function (i) {
      var r = rows[i], tr = el("tr", { "data-row": i }, tbody);
      if (layerKey) tr.setAttribute("data-layer", r[layerKey]);
      if ("head" in r) tr.setAttribute("data-head", r.head);
      cols.forEach(function (c) {
        var td = el("td", {}, tr), v = r[c];
        td.textContent = cellText(v, c);
        if (typeof v === "string") td.style.textAlign = "left";
        if (ranges[c] && ranges[c][1] > ranges[c][0]) {
          var f = (v - ranges[c][0]) / (ranges[c][1] - ranges[c][0]);
          td.className = "bar";
          td.style.backgroundImage = "linear-gradient(90deg, rgba(47,111,222,.16), " +
            "rgba(47,111,222,.16))";
          td.style.backgroundSize = Math.round(100 * f) + "% 70%";
        }
      });
      tr.addEventListener("click", function () {
        var li = -1;
        DATA.layers.forEach(function (L, j) { if (L.path === r[layerKey]) li = j; });
        if (li < 0) return;
        var h = typeof r.head === "number" ? r.head : -1;
        select(li, h);
      });
    });
    markRows();
  }
  function markRows() {
    var L = DATA.layers[state.layer];
    Array.prototype.forEach.call(document.querySelectorAll("#metrics tbody tr"), function (tr) {
      var onLayer = layerKey && tr.getAttribute("data-layer") === L.path;
      var h = tr.getAttribute("data-head");
      var onHead = onLayer && (String(state.head) === h ||
                               (state.head < 0 && h !== null && isNaN(+h)));
      tr.classList.toggle("layer-on", !!onLayer);
      tr.classList.toggle("head-on", !!onHead);
    });
  }

  // ---- selection ----------------------------------------------------------------------------
  function select(layer, head) {
    var L = DATA.layers[layer];
    if (!L) return;
    var layerChanged = layer !== state.layer;
    state.layer = layer;
    state.head = head >= 0 && head < L.heads ? head : -1;
    if (L.heads === 1) state.head = 0;
    document.getElementById("layer-select").value = String(layer);
    buildHeadPicker();
    cur = currentWeights();
    disp = displayWeights(cur);
    drawLines(cur, disp);
    drawHeatmap(disp);
    heatLeave();
    markRows();
    document.getElementById("layer-info").textContent =
      L.kind + " \u00b7 " + L.q_len + " " + L.q_side + " \u00d7 " + L.k_len + " " + L.k_side +
      " \u00b7 " + (state.head < 0 ? "mean of " + L.heads + " heads" : "head " + state.head);
    document.body.setAttribute("data-layer", L.path);
    document.body.setAttribute("data-head", String(state.head));
    return layerChanged;
  }

  function init() {
    var sides = Object.keys(DATA.tokens).map(function (s) {
      return s + ": " + DATA.tokens[s].length + " tokens"; });
    document.getElementById("summary").textContent =
      sides.join(" \u00b7 ") + " \u00b7 " + DATA.layers.length + " attention layers";
    var ramp = [];
    for (var i = 0; i <= 10; i++) ramp.push(rgb(colour(i / 10)) + " " + (i * 10) + "%");
    document.querySelector(".legend .ramp").style.background =
      "linear-gradient(90deg, " + ramp.join(", ") + ")";
    buildLayerPicker();
    buildTable();
    document.getElementById("rowmax").addEventListener("change", function (ev) {
      state.rowMax = ev.target.checked;
      document.getElementById("legend-max").textContent = state.rowMax ? "row max" : "1";
      select(state.layer, state.head);
    });
    var canvas = document.getElementById("heatmap");
    canvas.addEventListener("mousemove", heatHover);
    canvas.addEventListener("mouseleave", heatLeave);
    document.addEventListener("keydown", function (ev) {
      if (ev.target && /^(SELECT|INPUT|TEXTAREA)$/.test(ev.target.tagName)) return;
      var L = DATA.layers[state.layer];
      if (ev.key === "ArrowRight") select(state.layer, state.head + 1 >= L.heads ? -1 : state.head + 1);
      else if (ev.key === "ArrowLeft") select(state.layer, state.head < 0 ? L.heads - 1 : state.head - 1);
      else return;
      ev.preventDefault();
    });
    select(DATA.initial_layer, -1);
  }

  window.attnView = {
    data: DATA, state: state, select: select, colour: colour, focus: focus,
    weight: function (q, k) { return cur[q * DATA.layers[state.layer].k_len + k]; },
    // Where the heatmap's cells lie in the canvas (CSS pixels): cell (q, k) starts at
    // (left + k * cell, top + q * cell).
    _geometry: function () { return heat && { left: heat.left, top: heat.top, cell: heat.cell }; }
  };
  init();
})();

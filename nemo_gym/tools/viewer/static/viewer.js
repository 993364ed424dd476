/* ng_viewer — the page. Plain JavaScript, no dependencies, no build step.
 *
 * Views (hash routes):  #/list?…  #/rollout/<row>?…  #/summary?…  #/compare?a=&b=
 * Data always arrives from the JSON API of the local server; text from rollouts is only ever put
 * into the page with textContent / text nodes (never parsed as HTML).
 */
(function () {
  "use strict";

  // ---------------------------------------------------------------------------------------------
  // Small helpers.

  const app = document.getElementById("app");
  const state = {
    navBusy: false,     // a prev/next navigation is loading
    navQueue: [],       // prev/next presses made while it loads, replayed in order
    files: [],          // statuses from /api/files
    main: null,         // id of the file given on the command line
    compare: null,      // id of the comparison file (if any)
    token: 0,           // bumped on every render; stale async work checks it
    listRows: [],       // rows on the current list page
    sel: -1,            // selected index on the list page
    lastRow: null,      // the rollout last opened (to reselect it in the list)
    keyPrefix: null,    // for two-key shortcuts (g l, g s, g c)
    rollout: null,      // the rollout on screen: {row, data, nav}
  };

  /** Create an element: h("div", {class: "x", onclick: fn}, child, "text", [more]). */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v === undefined || v === null || v === false) continue;
        if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
        else if (k === "class") el.className = v;
        else if (k === "dataset") Object.assign(el.dataset, v);
        else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
        else if (k === "value") el.value = v;
        else if (k === "checked") el.checked = !!v;
        else el.setAttribute(k, v === true ? "" : String(v));
      }
    }
    append(el, children);
    return el;
  }

  function append(el, children) {
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      if (Array.isArray(c)) append(el, c);
      else if (c instanceof Node) el.appendChild(c);
      else el.appendChild(document.createTextNode(String(c)));
    }
  }

  function clear(el) { while (el.firstChild) el.removeChild(el.firstChild); }

  const nf = new Intl.NumberFormat("en-US");
  function fmtInt(x) { return x === null || x === undefined ? "—" : nf.format(x); }
  function fmtNum(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "—";
    const d = digits === undefined ? 4 : digits;
    if (Number.isInteger(x)) return nf.format(x);
    return Number(x.toFixed(d)).toString();
  }
  function fmtPct(x) { return x === null || x === undefined ? "—" : (100 * x).toFixed(1) + "%"; }
  function fmtBytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + units[i];
  }
  function fmtSigned(x, digits) {
    if (x === null || x === undefined) return "—";
    const s = fmtNum(Math.abs(x), digits);
    return (x > 1e-9 ? "+" : x < -1e-9 ? "−" : "±") + s;
  }

  function fileById(id) { return state.files.find((f) => f.id === id) || null; }
  function threshold(fileId) { const f = fileById(fileId); return f && f.pass_threshold !== undefined ? f.pass_threshold : 1; }

  function rewardBadge(reward, th, big) {
    let cls = "none", text = "no reward";
    if (reward !== null && reward !== undefined) {
      text = fmtNum(reward);
      cls = reward >= th ? "pass" : reward <= 0 ? "fail" : "part";
    }
    return h("span", { class: "badge " + cls + (big ? " reward-big" : ""), title: "reward (pass threshold " + th + ")" }, text);
  }

  /** GET/POST the JSON API; resolves to {ok, status, data}. */
  async function api(path, params, body) {
    let url = path;
    if (params) {
      const qs = new URLSearchParams();
      for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") qs.set(k, v);
      const s = qs.toString();
      if (s) url += "?" + s;
    }
    const init = body === undefined ? {} : { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) };
    let resp;
    try {
      resp = await fetch(url, init);
    } catch (e) {
      return { ok: false, status: 0, data: { error: "The viewer server cannot be reached (" + e.message + "). Is ng_viewer still running?" } };
    }
    let data = null;
    try { data = await resp.json(); } catch (e) { data = { error: "bad response from the server (" + resp.status + ")" }; }
    return { ok: resp.ok, status: resp.status, data };
  }

  function errorBox(message) { return h("div", { class: "banner error" }, message); }

  // ---------------------------------------------------------------------------------------------
  // JSON display with light syntax colouring (built from text nodes).

  const TOKEN_RE = /("(?:\\.|[^"\\])*")(\s*:)?|\b(true|false|null)\b|(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)/g;
  const MAX_COLOURED = 200000;

  function jsonPre(value, extraClass) {
    const text = typeof value === "string" ? value : JSON.stringify(value, null, 2);
    const pre = h("pre", { class: "json" + (extraClass ? " " + extraClass : "") });
    if (text === undefined) { pre.textContent = String(value); return pre; }
    if (text.length > MAX_COLOURED) { pre.textContent = text; return pre; }
    let last = 0;
    TOKEN_RE.lastIndex = 0;
    let m;
    while ((m = TOKEN_RE.exec(text)) !== null) {
      if (m.index > last) pre.appendChild(document.createTextNode(text.slice(last, m.index)));
      let cls = "n";
      if (m[1] !== undefined) cls = m[2] ? "k" : "s";
      else if (m[3] !== undefined) cls = "l";
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = m[1] !== undefined ? m[1] : m[0];
      pre.appendChild(span);
      if (m[2]) pre.appendChild(document.createTextNode(m[2]));
      last = TOKEN_RE.lastIndex;
    }
    if (last < text.length) pre.appendChild(document.createTextNode(text.slice(last)));
    return pre;
  }

  /** Parse text as JSON if it is an object or array; else undefined. */
  function tryJson(text) {
    if (typeof text !== "string") return undefined;
    const t = text.trim();
    if (!(t.startsWith("{") || t.startsWith("["))) return undefined;
    try { return JSON.parse(t); } catch (e) { return undefined; }
  }

  // ---------------------------------------------------------------------------------------------
  // Routing.

  function parseHash() {
    const raw = location.hash.replace(/^#/, "") || "/list";
    const q = raw.indexOf("?");
    const path = q >= 0 ? raw.slice(0, q) : raw;
    const params = new URLSearchParams(q >= 0 ? raw.slice(q + 1) : "");
    return { parts: path.split("/").filter(Boolean), params };
  }

  function hashFor(parts, params) {
    const p = new URLSearchParams();
    for (const [k, v] of (params instanceof URLSearchParams ? params.entries() : Object.entries(params || {}))) {
      if (v !== undefined && v !== null && v !== "" && v !== false) p.set(k, v);
    }
    const s = p.toString();
    return "#/" + parts.join("/") + (s ? "?" + s : "");
  }

  function navigate(parts, params, replace) {
    const target = hashFor(parts, params);
    if (replace) {
      history.replaceState(null, "", target);
      route();
    } else if (location.hash === target) {
      route();
    } else {
      location.hash = target;
    }
  }

  const LIST_KEYS = ["file", "q", "reward_min", "reward_max", "tasks", "agent", "errors", "sort", "desc", "page", "size"];

  function listParams(params) {
    const out = {};
    for (const k of LIST_KEYS) if (params.has(k)) out[k] = params.get(k);
    return out;
  }

  function currentFileId(params, key) {
    const id = params.get(key || "file");
    if (id && fileById(id)) return id;
    return state.main;
  }

  function setActiveTab(name) {
    for (const a of document.querySelectorAll(".tabs a")) a.classList.toggle("active", a.dataset.tab === name);
  }

  function renderFileInfo(fileId) {
    const box = document.getElementById("fileinfo");
    clear(box);
    const f = fileById(fileId);
    if (!f) return;
    if (state.files.length > 1) {
      const sel = h("select", {
        title: "Opened files",
        onchange: (e) => {
          const { parts, params } = parseHash();
          const view = parts[0] === "rollout" ? "list" : parts[0] || "list";
          if (view === "compare") return;
          const p = new URLSearchParams(params);
          p.set("file", e.target.value);
          p.delete("page");
          navigate([view], p);
        },
      }, state.files.map((x) => h("option", { value: x.id, selected: x.id === fileId }, x.name + "  (" + x.id + ")")));
      box.appendChild(sel);
    }
    box.appendChild(h("span", { class: "path", title: f.path }, f.path));
    if (f.state === "ready") {
      box.appendChild(h("span", { class: "small nowrap" }, fmtInt(f.rows) + " rollouts · " + fmtBytes(f.size)));
      if (f.current === false) box.appendChild(h("span", { class: "badge err", title: "The file changed on disk" }, "changed on disk"));
      const reload = h("button", {
        type: "button", class: "btn", id: "reload", title: "Pick up rollouts appended to the file since it was indexed",
        onclick: async () => {
          reload.disabled = true;
          const r = await api("/api/files/" + fileId + "/refresh", null, {});
          reload.disabled = false;
          if (!r.ok) { reload.title = r.data.error; reload.classList.add("on"); return; }
          await refreshFiles();
          const shell = document.getElementById("list-shell");
          if (shell) shell.remove();  // rebuild the filter bar (agents may have changed)
          route();
        },
      }, "Reload");
      box.appendChild(reload);
    }
  }

  async function refreshFiles() {
    const r = await api("/api/files");
    if (r.ok) {
      state.files = r.data.files;
      state.main = r.data.main || (state.files[0] && state.files[0].id);
      state.compare = r.data.compare;
    }
    return r;
  }

  /** Wait (showing progress) until file ``id`` is indexed; resolves to its status or null on error. */
  async function whenReady(id, token) {
    const known = fileById(id);
    if (known && known.state === "ready") return known;
    for (;;) {
      const r = await api("/api/files/" + encodeURIComponent(id));
      if (token !== state.token) return null;
      if (!r.ok) { clear(app); app.appendChild(errorBox(r.data.error)); return null; }
      const f = r.data;
      const i = state.files.findIndex((x) => x.id === id);
      if (i >= 0) state.files[i] = f; else state.files.push(f);
      if (f.state === "ready") return f;
      if (f.state === "error") {
        clear(app);
        app.appendChild(h("div", { class: "center-box" }, errorBox("Cannot open " + f.path + ": " + f.error)));
        return null;
      }
      const pct = f.progress.total ? (100 * f.progress.done) / f.progress.total : 0;
      clear(app);
      app.appendChild(h("div", { class: "center-box card pad", id: "indexing" },
        h("h2", null, "Indexing " + f.name + "…"),
        h("div", { class: "progress" }, h("div", { style: { width: pct.toFixed(1) + "%" } })),
        h("div", { class: "muted small" }, fmtBytes(f.progress.done) + " of " + fmtBytes(f.progress.total) +
          " — line offsets and a compact summary of each rollout are indexed once and cached next to the file.")));
      await new Promise((res) => setTimeout(res, 300));
      if (token !== state.token) return null;
    }
  }

  async function route() {
    const token = ++state.token;
    const { parts, params } = parseHash();
    const view = parts[0] || "list";
    if (!state.files.length) {
      const r = await refreshFiles();
      if (token !== state.token) return;
      if (!r.ok) { clear(app); app.appendChild(errorBox(r.data.error)); return; }
    }
    setActiveTab(view === "rollout" ? "list" : view);
    if (view === "compare") {
      renderFileInfo(currentFileId(params, "a"));
      return renderCompare(params, token);
    }
    const fileId = currentFileId(params);
    if (!fileId) { clear(app); app.appendChild(errorBox("No file is open.")); return; }
    const f = await whenReady(fileId, token);
    if (!f || token !== state.token) return;
    renderFileInfo(fileId);
    if (view === "summary") return renderSummary(fileId, params, token);
    if (view === "rollout") return renderRollout(fileId, Number(parts[1]), params, token);
    return renderList(fileId, params, token);
  }

  // ---------------------------------------------------------------------------------------------
  // Sortable table helper.

  /**
   * A table whose header cells sort (server side, through ``onSort``).
   * columns: [{key, label, num, sortable, render(row) -> node|text, title}]
   */
  function sortTable(columns, rows, sort, desc, onSort, onRowClick, rowAttrs) {
    const head = h("tr", null, columns.map((c) => {
      const sorted = c.key === sort;
      const th = h("th", {
        class: [c.num ? "num" : "", c.sortable === false ? "" : "sortable", sorted ? "sorted" : ""].join(" ").trim(),
        title: c.title || (c.sortable === false ? null : "Sort by " + c.label),
        dataset: { key: c.key },
      }, c.label, h("span", { class: "arrow" }, sorted ? (desc ? "▼" : "▲") : ""));
      if (c.sortable !== false) th.addEventListener("click", () => onSort(c.key, sorted ? !desc : c.defaultDesc === true));
      return th;
    }));
    const body = h("tbody", null, rows.map((r, i) => {
      const tr = h("tr", Object.assign({ class: onRowClick ? "click" : "" }, rowAttrs ? rowAttrs(r, i) : {}),
        columns.map((c) => h("td", { class: (c.num ? "num " : "") + (c.cls || "") }, c.render ? c.render(r) : r[c.key])));
      if (onRowClick) tr.addEventListener("click", (e) => onRowClick(r, i, e));
      return tr;
    }));
    return h("table", { class: "grid" }, h("thead", null, head), body);
  }

  function pager(offset, limit, total, onPage) {
    const page = Math.floor(offset / limit);
    const pages = Math.max(1, Math.ceil(total / limit));
    return h("div", { class: "pager" },
      h("button", { class: "btn", disabled: page <= 0, title: "First page", onclick: () => onPage(0) }, "«"),
      h("button", { class: "btn", disabled: page <= 0, title: "Previous page (←)", onclick: () => onPage(page - 1), "data-act": "prev-page" }, "‹"),
      h("span", { class: "nowrap" }, "page " + fmtInt(page + 1) + " of " + fmtInt(pages)),
      h("button", { class: "btn", disabled: page >= pages - 1, title: "Next page (→)", onclick: () => onPage(page + 1), "data-act": "next-page" }, "›"),
      h("button", { class: "btn", disabled: page >= pages - 1, title: "Last page", onclick: () => onPage(pages - 1) }, "»"));
  }

  // ---------------------------------------------------------------------------------------------
  // Run list.

  const ROW_COLUMNS = [
    { key: "line_no", label: "Line", num: true, render: (r) => fmtInt(r.line_no), title: "Line in the file (sort: file order)" },
    { key: "task", label: "Task", num: true, render: (r) => (r.task === null ? "—" : fmtInt(r.task)) },
    { key: "rollout", label: "Rollout", num: true, render: (r) => (r.rollout === null ? "—" : fmtInt(r.rollout)) },
    { key: "reward", label: "Reward", num: true, defaultDesc: true, render: null },
    { key: "turns", label: "Turns", num: true, defaultDesc: true, render: (r) => fmtInt(r.turns), title: "Model turns" },
    {
      key: "tool_calls", label: "Tool calls", num: true, defaultDesc: true, cls: "tools-cell",
      render: (r) => [fmtInt(r.tool_calls), r.tool_errors ? [" ", h("span", { class: "badge err", title: r.tool_errors + " tool output(s) look like errors" }, r.tool_errors + " err")] : null],
    },
    { key: "input_tokens", label: "In tok", num: true, defaultDesc: true, render: (r) => fmtInt(r.input_tokens) },
    { key: "output_tokens", label: "Out tok", num: true, defaultDesc: true, render: (r) => fmtInt(r.output_tokens) },
    { key: "total_tokens", label: "Total tok", num: true, defaultDesc: true, render: (r) => fmtInt(r.total_tokens) },
    { key: "agent", label: "Agent", render: (r) => r.agent || "—" },
    { key: "preview", label: "Prompt", sortable: false, cls: "preview", render: (r) => h("span", { title: r.preview }, r.preview) },
  ];

  function listQuery(fileId, params, size) {
    const page = Math.max(0, Number(params.get("page") || 0));
    return {
      q: params.get("q") || "",
      reward_min: params.get("reward_min") || "",
      reward_max: params.get("reward_max") || "",
      tasks: params.get("tasks") || "",
      agent: params.has("agent") ? params.get("agent") : undefined,
      errors: params.get("errors") || "",
      sort: params.get("sort") || "row",
      desc: params.get("desc") || "",
      offset: page * size,
      limit: size,
    };
  }

  function pageSize(params) {
    const s = Number(params.get("size") || 50);
    return [25, 50, 100, 200, 500].includes(s) ? s : 50;
  }

  async function renderList(fileId, params, token) {
    const f = fileById(fileId);
    const size = pageSize(params);
    const query = listQuery(fileId, params, size);
    const th = threshold(fileId);

    // Changes always start from the current hash (the filter bar outlives single renders).
    const setParam = (changes, keepPage) => {
      const p = new URLSearchParams(parseHash().params);
      for (const [k, v] of Object.entries(changes)) {
        if (v === null || v === undefined || v === "" || v === false) p.delete(k);
        else p.set(k, v);
      }
      if (!keepPage) p.delete("page");
      if (fileId !== state.main) p.set("file", fileId);
      navigate(["list"], p, true);
    };

    let shell = document.getElementById("list-shell");
    if (!shell || shell.dataset.file !== fileId) {
      shell = buildListShell(fileId, f, setParam);
      clear(app);
      app.appendChild(shell);
    }
    syncFilterInputs(query);
    const info = document.getElementById("listbar");
    const tableBox = document.getElementById("rows-box");
    const bottom = document.getElementById("listbar-bottom");

    const r = await api("/api/files/" + fileId + "/rows", query);
    if (token !== state.token) return;
    if (!r.ok) {
      clear(info);
      info.appendChild(errorBox(r.data.error));
      clear(tableBox);
      return;
    }
    const data = r.data;
    state.listRows = data.rows;
    const rewardCol = Object.assign({}, ROW_COLUMNS[3], { render: (row) => rewardBadge(row.reward, th) });
    const cols = ROW_COLUMNS.map((c) => (c.key === "reward" ? rewardCol : c));
    const openRow = (row) => {
      state.lastRow = row.row;
      const p = listParams(parseHash().params);
      if (fileId !== state.main) p.file = fileId;
      navigate(["rollout", String(row.row)], p);
    };
    const table = sortTable(cols, data.rows, query.sort === "row" ? "line_no" : query.sort, query.desc === "1",
      (key, desc) => setParam({ sort: key === "line_no" ? null : key, desc: desc ? "1" : null }),
      (row) => openRow(row),
      (row) => ({ dataset: { row: row.row }, title: "Open rollout (line " + row.line_no + ")" }));
    clear(tableBox);
    if (data.rows.length) tableBox.appendChild(table);
    else tableBox.appendChild(h("div", { class: "pad muted", id: "no-rows" }, data.all ? "No rollout matches these filters." : "This file has no rollouts."));

    state.sel = data.rows.findIndex((x) => x.row === state.lastRow);
    if (state.sel < 0 && data.rows.length) state.sel = 0;
    highlightSel(false);

    const onPage = (pg) => setParam({ page: pg ? String(pg) : null }, true);
    const sizeSel = h("select", { title: "Rows per page", onchange: (e) => setParam({ size: e.target.value === "50" ? null : e.target.value }) },
      [25, 50, 100, 200, 500].map((s) => h("option", { value: s, selected: s === size }, s + " / page")));
    const from = data.total ? data.offset + 1 : 0;
    const to = data.offset + data.rows.length;
    clear(info);
    append(info, [
      h("span", { id: "count" }, data.total === data.all
        ? fmtInt(from) + "–" + fmtInt(to) + " of " + fmtInt(data.total) + " rollouts"
        : fmtInt(from) + "–" + fmtInt(to) + " of " + fmtInt(data.total) + " matching (" + fmtInt(data.all) + " in the file)"),
      searchStatus(data.search),
      h("span", { class: "spacer" }),
      sizeSel,
      pager(data.offset, size, data.total, onPage),
    ]);
    clear(bottom);
    append(bottom, [h("span", { class: "spacer" }), pager(data.offset, size, data.total, onPage)]);

    if (data.search && !data.search.done && !data.search.error) {
      setTimeout(() => { if (token === state.token) route(); }, 250);
    }
  }

  /** The filter bar, counts line, table box and bottom pager of the run list (kept across renders). */
  function buildListShell(fileId, f, setParam) {
    // One timer for all typed filters; when it fires, every typed field is applied together.
    let debounce = null;
    const TEXT_FIELDS = { "f-q": "q", "f-rmin": "reward_min", "f-rmax": "reward_max", "f-tasks": "tasks" };
    const applyTyped = () => {
      const changes = {};
      for (const [id, key] of Object.entries(TEXT_FIELDS)) {
        const el = document.getElementById(id);
        if (el) changes[key] = el.value.trim();
      }
      setParam(changes);
    };
    const onText = (key) => () => {
      clearTimeout(debounce);
      debounce = setTimeout(applyTyped, key === "q" ? 350 : 500);
    };
    const agents = f.agents || [];
    const filters = h("form", { class: "card filters", id: "filters", onsubmit: (e) => e.preventDefault() },
      h("label", { class: "field search" }, "Search trajectories",
        h("input", { type: "search", id: "f-q", placeholder: "text anywhere in the rollout (press /)", oninput: onText("q"), autocomplete: "off" })),
      h("label", { class: "field" }, "Reward ≥",
        h("input", { type: "number", step: "any", id: "f-rmin", class: "narrow", oninput: onText("reward_min") })),
      h("label", { class: "field" }, "Reward ≤",
        h("input", { type: "number", step: "any", id: "f-rmax", class: "narrow", oninput: onText("reward_max") })),
      h("label", { class: "field" }, "Tasks",
        h("input", { type: "text", id: "f-tasks", class: "tasks", placeholder: "e.g. 3, 10-20", oninput: onText("tasks") })),
      h("label", { class: "field" }, "Agent",
        h("select", { id: "f-agent", onchange: (e) => setParam({ agent: e.target.value === "\u0000all" ? null : e.target.value }) },
          h("option", { value: "\u0000all" }, "all agents"),
          agents.map((a) => h("option", { value: a }, a || "(no agent)")))),
      h("label", { class: "check" },
        h("input", { type: "checkbox", id: "f-errors", onchange: (e) => setParam({ errors: e.target.checked ? "1" : null }) }),
        "only with errors"),
      h("button", {
        type: "button", class: "btn", id: "f-clear",
        onclick: () => navigate(["list"], fileId !== state.main ? { file: fileId } : {}, true),
      }, "Clear filters"));
    return h("div", { id: "list-shell", dataset: { file: fileId } },
      f.malformed ? malformedBanner(fileId, f.malformed) : null,
      filters,
      h("div", { class: "listbar", id: "listbar" }, h("span", null, "Loading…")),
      h("div", { class: "card table-wrap", id: "rows-box" }),
      h("div", { class: "listbar", id: "listbar-bottom", style: { marginTop: "8px" } }));
  }

  /** Put the query's values into the filter inputs (leaving alone the one being typed in). */
  function syncFilterInputs(query) {
    const set = (id, v) => { const el = document.getElementById(id); if (el && el !== document.activeElement && el.value !== v) el.value = v; };
    set("f-q", query.q);
    set("f-rmin", query.reward_min);
    set("f-rmax", query.reward_max);
    set("f-tasks", query.tasks);
    const agent = document.getElementById("f-agent");
    if (agent) agent.value = query.agent === undefined ? "\u0000all" : query.agent;
    const errs = document.getElementById("f-errors");
    if (errs) errs.checked = query.errors === "1";
  }

  function searchStatus(s) {
    if (!s) return null;
    if (s.error) return h("span", { class: "badge err" }, s.error);
    if (s.done) return h("span", { class: "badge info", id: "search-done" }, "full-text: " + fmtInt(s.matches) + " match" + (s.matches === 1 ? "" : "es"));
    const pct = s.total ? (100 * s.scanned) / s.total : 0;
    return h("span", { class: "searching", id: "searching" },
      "searching " + pct.toFixed(0) + "%",
      h("span", { class: "progress" }, h("div", { style: { width: pct.toFixed(1) + "%" } })));
  }

  function malformedBanner(fileId, count) {
    const box = h("details", { class: "banner warn", id: "malformed-banner" },
      h("summary", null, count + " malformed line" + (count === 1 ? " was" : "s were") + " skipped — the rest of the file is shown. Show them"));
    let loaded = false;
    box.addEventListener("toggle", async () => {
      if (!box.open || loaded) return;
      loaded = true;
      const r = await api("/api/files/" + fileId + "/malformed", { limit: 100 });
      if (!r.ok) { box.appendChild(errorBox(r.data.error)); return; }
      box.appendChild(malformedTable(r.data.rows));
      if (r.data.total > r.data.rows.length) box.appendChild(h("div", { class: "small muted" }, "… " + fmtInt(r.data.total - r.data.rows.length) + " more (see Summary)."));
    });
    return box;
  }

  function malformedTable(rows) {
    return h("table", { class: "grid", id: "malformed-table" },
      h("thead", null, h("tr", null, h("th", { class: "num" }, "Line"), h("th", null, "Problem"), h("th", null, "Start of the line"))),
      h("tbody", null, rows.map((m) => h("tr", null,
        h("td", { class: "num" }, fmtInt(m.line_no)),
        h("td", null, m.error),
        h("td", { class: "mono small" }, m.snippet)))));
  }

  function highlightSel(scroll) {
    const trs = document.querySelectorAll("#rows-box tbody tr");
    trs.forEach((tr, i) => tr.classList.toggle("sel", i === state.sel));
    if (scroll && trs[state.sel]) trs[state.sel].scrollIntoView({ block: "nearest" });
  }

  // ---------------------------------------------------------------------------------------------
  // Trajectory view.

  const CLAMP_CHARS = 6000;

  function longText(text, cls) {
    const div = h("div", { class: "text" + (cls ? " " + cls : "") }, text);
    if (text.length <= CLAMP_CHARS) return div;
    div.classList.add("clamp");
    const btn = h("button", { class: "btn more", type: "button" }, "Show all (" + fmtInt(text.length) + " characters)");
    btn.addEventListener("click", () => { div.classList.toggle("clamp"); btn.textContent = div.classList.contains("clamp") ? "Show all (" + fmtInt(text.length) + " characters)" : "Show less"; });
    return [div, btn];
  }

  function contentParts(content) {
    // -> [{kind: "text"|"refusal"|"other", text|value}]
    if (typeof content === "string") return [{ kind: "text", text: content }];
    if (!Array.isArray(content)) return content === undefined || content === null ? [] : [{ kind: "other", value: content }];
    return content.map((p) => {
      if (typeof p === "string") return { kind: "text", text: p };
      if (p && typeof p.text === "string") return { kind: "text", text: p.text };
      if (p && typeof p.refusal === "string") return { kind: "refusal", text: p.refusal };
      return { kind: "other", value: p };
    });
  }

  function textOf(value) {
    if (typeof value === "string") return value;
    return contentParts(value).map((p) => (p.text !== undefined ? p.text : JSON.stringify(p.value))).join("");
  }

  const ERROR_RE = /^\s*(error\b|traceback \(most recent call last\))/i;
  /** Same rule as the server's index (nemo_gym/tools/viewer/index.py: looks_like_error). */
  function looksLikeError(output) {
    const text = textOf(output);
    if (ERROR_RE.test(text) || text.includes("Traceback (most recent call last)")) return true;
    const parsed = tryJson(text);
    return !!(parsed && !Array.isArray(parsed) && typeof parsed === "object" && parsed.error);
  }

  function messageBlock(item, extraLabel) {
    const role = item.role || "user";
    const parts = contentParts(item.content);
    const hasRefusal = parts.some((p) => p.kind === "refusal");
    const body = parts.map((p) => {
      if (p.kind === "other") return jsonPre(p.value);
      return longText(p.text, p.kind === "refusal" ? "refusal" : "");
    });
    if (!parts.length) body.push(h("div", { class: "muted small" }, "(empty)"));
    return h("div", { class: "msg " + role + (hasRefusal ? " refusal" : ""), dataset: { role } },
      h("div", { class: "who" }, role, extraLabel ? h("span", { class: "badge none" }, extraLabel) : null,
        hasRefusal ? h("span", { class: "badge err" }, "refusal") : null,
        item.status && item.status !== "completed" ? h("span", { class: "badge part" }, item.status) : null),
      body);
  }

  function reasoningBlock(item) {
    const texts = [];
    for (const s of item.summary || []) if (s && typeof s.text === "string") texts.push(s.text);
    for (const c of item.content || []) if (c && typeof c.text === "string") texts.push(c.text);
    const text = texts.join("\n\n");
    const d = h("details", { class: "reasoning" },
      h("summary", null, "Reasoning" + (text ? " (" + fmtInt(text.length) + " characters)" : "") + (item.encrypted_content ? " · encrypted content present" : "")),
      text ? h("div", { class: "text" }, text) : h("div", { class: "muted small" }, "No readable reasoning text."));
    return d;
  }

  function callBlock(call, output, inInput) {
    let args = call.arguments;
    let argsNode;
    let argsWarn = null;
    if (typeof args === "string") {
      const parsed = tryJson(args);
      if (parsed !== undefined) argsNode = jsonPre(parsed);
      else {
        argsNode = h("pre", null, args);
        if (args.trim()) argsWarn = h("div", { class: "warnline" }, "arguments are not valid JSON");
      }
    } else {
      argsNode = jsonPre(args);
    }
    let outPane;
    let isErr = false;
    if (output === undefined) {
      isErr = !inInput;
      outPane = h("div", { class: "pane" + (isErr ? " err" : "") }, h("h4", null, "Output"),
        h("div", { class: "warnline" }, "no output recorded for this call"));
    } else {
      const out = output.output;
      isErr = looksLikeError(out);
      const text = textOf(out);
      const parsed = tryJson(text);
      outPane = h("div", { class: "pane" + (isErr ? " err" : "") }, h("h4", null, "Output"),
        isErr ? h("div", { class: "warnline" }, "error") : null,
        parsed !== undefined ? jsonPre(parsed) : h("pre", null, text));
    }
    return h("div", { class: "call" + (isErr || argsWarn ? " error" : ""), dataset: { callId: call.call_id || "" } },
      h("div", { class: "head" },
        h("span", { class: "fn", title: "function call" }, "call"),
        h("span", { class: "fname" }, call.name || "(no name)"),
        h("span", { class: "cid" }, call.call_id || ""),
        isErr ? h("span", { class: "badge err" }, output === undefined ? "missing output" : "tool error") : null,
        inInput ? h("span", { class: "badge none" }, "from input") : null),
      h("div", { class: "body" },
        h("div", { class: "pane" }, h("h4", null, "Arguments"), argsWarn, argsNode),
        outPane));
  }

  /** Render a list of items (input or output), pairing function calls with their outputs. */
  function renderItems(items, outputsById, shown, opts) {
    const nodes = [];
    let turn = 0;
    let inTurn = false;
    const stepAfter = opts.stepAfter || new Map();
    for (let idx = 0; idx < items.length; idx++) {
      const item = items[idx];
      if (stepAfter.has(idx - 1)) nodes.push(stepRewardLine(stepAfter.get(idx - 1), opts.th));
      if (!item || typeof item !== "object") { nodes.push(jsonPre(item)); continue; }
      const type = item.type || "message";
      if (opts.turns && type !== "function_call_output" && !inTurn) {
        turn++;
        inTurn = true;
        nodes.push(h("div", { class: "section-label" }, "Turn " + turn));
      }
      if (type === "function_call_output") {
        inTurn = false;
        if (shown.has(item)) continue;
        nodes.push(h("div", { class: "call error" },
          h("div", { class: "head" }, h("span", { class: "cid" }, item.call_id || ""), h("span", { class: "badge err" }, "output without a matching call")),
          h("div", { class: "pane" }, jsonPre(item.output))));
      } else if (type === "function_call") {
        const out = outputsById.get(item.call_id);
        if (out) shown.add(out);
        nodes.push(callBlock(item, out, opts.input));
      } else if (type === "message") {
        nodes.push(messageBlock(item, opts.input && item.role === "assistant" ? "from input" : null));
      } else if (type === "reasoning") {
        nodes.push(reasoningBlock(item));
      } else {
        nodes.push(h("div", { class: "msg" }, h("div", { class: "who" }, type), jsonPre(item)));
      }
    }
    if (stepAfter.has(items.length - 1)) nodes.push(stepRewardLine(stepAfter.get(items.length - 1), opts.th));
    return nodes;
  }

  /** Per-step records (multi-step environments such as Aviary's): one line after each step's items. */
  function stepRewardLine(step, th) {
    const reward = typeof step.reward === "number" ? step.reward : null;
    return h("div", { class: "step-reward row", dataset: { step: String(step.step) } },
      h("span", { class: "muted" }, "step " + step.step + " reward"), rewardBadge(reward, th, false),
      step.done ? h("span", { class: "badge none" }, "done") : null,
      step.stepped_env === false ? h("span", { class: "muted small" }, "no tool call") : null);
  }

  function stepsMap(resp) {
    const m = new Map();
    if (!Array.isArray(resp.steps)) return m;
    for (const st of resp.steps) {
      if (st && typeof st === "object" && Number.isInteger(st.output_end) && st.output_end > 0) m.set(st.output_end - 1, st);
    }
    return m;
  }

  function stepsCard(resp, th) {
    if (!Array.isArray(resp.steps) || !resp.steps.length) return null;
    const rows = resp.steps.map((st) => h("tr", { dataset: { step: String(st.step) } },
      h("td", null, String(st.step)),
      h("td", null, rewardBadge(typeof st.reward === "number" ? st.reward : null, th, false)),
      h("td", null, st.done ? "yes" : "no"),
      h("td", null, st.stepped_env === false ? "no tool call" : "")));
    const total = resp.steps.reduce((a, st) => a + (typeof st.reward === "number" ? st.reward : 0), 0);
    return h("div", { class: "card", id: "steps-panel" },
      h("h3", null, "Per-step rewards (" + resp.steps.length + " steps, sum " + fmtNum(total) + ")"),
      h("table", null, h("thead", null, h("tr", null, h("th", null, "step"), h("th", null, "reward"), h("th", null, "done"), h("th", null, ""))),
        h("tbody", null, rows)));
  }

  const HIDDEN_VERIFY_FIELDS = new Set(["responses_create_params", "response", "reward"]);

  function verifyBlock(data, th) {
    const rows = [];
    for (const [k, v] of Object.entries(data)) {
      if (HIDDEN_VERIFY_FIELDS.has(k)) continue;
      const val = typeof v === "string" ? h("div", { class: "text", style: { whiteSpace: "pre-wrap" } }, v) : jsonPre(v);
      rows.push(h("tr", null, h("td", null, k), h("td", null, val)));
    }
    return h("div", { class: "card verify", id: "verify" },
      h("h3", null, "Verify result"),
      h("div", { class: "row" }, h("span", { class: "muted" }, "reward"), rewardBadge(typeof data.reward === "number" ? data.reward : null, th, true),
        typeof data.reward !== "number" ? h("span", { class: "warnline" }, "this rollout has no numeric reward") : null),
      rows.length ? h("table", null, h("tbody", null, rows)) : h("div", { class: "muted small" }, "No other fields."));
  }

  function sidePanel(data) {
    const params = data.responses_create_params && typeof data.responses_create_params === "object" ? data.responses_create_params : {};
    const resp = data.response && typeof data.response === "object" ? data.response : {};
    const tools = Array.isArray(params.tools) ? params.tools : Array.isArray(resp.tools) ? resp.tools : [];
    const toolNodes = tools.map((t) => h("details", { class: "tool-def" },
      h("summary", null, t.name || t.type || "(tool)"),
      t.description ? h("div", { class: "desc" }, t.description) : null,
      t.parameters ? jsonPre(t.parameters) : jsonPre(t)));
    const sampling = [];
    for (const [k, v] of Object.entries(params)) {
      if (k === "input" || k === "tools" || k === "instructions") continue;
      sampling.push(h("dt", null, k), h("dd", null, typeof v === "string" ? v : JSON.stringify(v)));
    }
    const respFacts = [];
    const add = (k, v) => { if (v !== undefined && v !== null && v !== "") respFacts.push(h("dt", null, k), h("dd", null, typeof v === "object" ? JSON.stringify(v) : String(v))); };
    add("model", resp.model);
    add("status", resp.status);
    const u = resp.usage || {};
    add("input tokens", u.input_tokens);
    add("output tokens", u.output_tokens);
    add("total tokens", u.total_tokens);
    if (u.output_tokens_details && u.output_tokens_details.reasoning_tokens) add("reasoning tokens", u.output_tokens_details.reasoning_tokens);
    if (u.input_tokens_details && u.input_tokens_details.cached_tokens) add("cached tokens", u.input_tokens_details.cached_tokens);
    add("temperature", resp.temperature);
    add("top_p", resp.top_p);
    add("incomplete", resp.incomplete_details);
    add("error", resp.error);
    add("id", resp.id);
    if (resp.created_at) add("created", new Date(resp.created_at * 1000).toISOString().replace(".000Z", "Z"));
    return h("aside", { class: "side", id: "side" },
      h("div", { class: "card", id: "tools-panel" }, h("h3", null, "Tools offered (" + tools.length + ")"),
        toolNodes.length ? toolNodes : h("div", { class: "muted small" }, "No tools.")),
      h("div", { class: "card", id: "params-panel" }, h("h3", null, "Sampling parameters"),
        sampling.length ? h("dl", null, sampling) : h("div", { class: "muted small" }, "None set (server defaults).")),
      h("div", { class: "card", id: "response-panel" }, h("h3", null, "Response"),
        respFacts.length ? h("dl", null, respFacts) : h("div", { class: "muted small" }, "No response object.")));
  }

  async function renderRollout(fileId, row, params, token) {
    const th = threshold(fileId);
    const lp = listParams(params);
    const [r, pos] = await Promise.all([
      api("/api/files/" + fileId + "/rollouts/" + row),
      api("/api/files/" + fileId + "/position", Object.assign({}, listQuery(fileId, params, pageSize(params)), { row, offset: undefined, limit: undefined })),
    ]);
    if (token !== state.token) return;
    clear(app);
    const back = () => { state.navQueue = []; state.navBusy = false; state.lastRow = row; navigate(["list"], lp); };
    const nav = pos.ok ? pos.data : { position: null, total: 0, prev: null, next: null };
    const goTo = (target, p) => {
      if (target === null || target === undefined) return;
      const q = Object.assign({}, lp);
      const size = pageSize(params);
      if (p !== null && p !== undefined) { const pg = Math.floor(p / size); if (pg) q.page = String(pg); else delete q.page; }
      state.lastRow = target;
      state.navBusy = true;
      navigate(["rollout", String(target)], q, true);
    };
    state.rollout = {
      row,
      prev: () => goTo(nav.prev, nav.position !== null ? nav.position - 1 : null),
      next: () => goTo(nav.next, nav.position !== null ? nav.position + 1 : null),
      back,
    };
    // A press made while this rollout was loading moves on from here, so fast presses are not lost.
    state.navBusy = false;
    const queued = state.navQueue.shift();
    if (queued) setTimeout(() => state.rollout && state.rollout.row === row && state.rollout[queued](), 0);
    const bar = h("div", { class: "trajbar" },
      h("button", { class: "btn", id: "back", onclick: back, title: "Back to the list (Esc)" }, "← List"),
      h("button", { class: "btn", id: "prev", disabled: nav.prev === null, onclick: state.rollout.prev, title: "Previous rollout (k / ←)" }, "‹ Prev"),
      h("span", { class: "muted", id: "position" }, nav.position !== null ? fmtInt(nav.position + 1) + " of " + fmtInt(nav.total) : "not in the filtered list"),
      h("button", { class: "btn", id: "next", disabled: nav.next === null, onclick: state.rollout.next, title: "Next rollout (j / →)" }, "Next ›"),
      h("span", { class: "spacer" }),
      h("button", { class: "btn", id: "raw-toggle", title: "Raw JSON (r)", onclick: () => toggleRaw() }, "Raw JSON"));
    app.appendChild(bar);
    if (!r.ok) { app.appendChild(errorBox(r.data.error)); return; }
    const meta = r.data.meta;
    const data = r.data.data;
    state.rollout.data = data;

    const params2 = data.responses_create_params && typeof data.responses_create_params === "object" ? data.responses_create_params : {};
    const resp = data.response && typeof data.response === "object" ? data.response : {};
    const head = h("div", { class: "card trajhead", id: "trajhead" },
      h("span", { class: "title" }, "Task " + (meta.task === null ? "—" : meta.task) + " · rollout " + (meta.rollout === null ? "—" : meta.rollout)),
      rewardBadge(meta.reward, th, true),
      h("div", { class: "facts" },
        h("span", null, "line ", h("b", null, fmtInt(meta.line_no))),
        h("span", null, "agent ", h("b", null, meta.agent || "—")),
        h("span", null, "turns ", h("b", null, fmtInt(meta.turns))),
        h("span", null, "tool calls ", h("b", null, fmtInt(meta.tool_calls))),
        meta.tool_errors ? h("span", { class: "badge err" }, meta.tool_errors + " tool error" + (meta.tool_errors === 1 ? "" : "s")) : null,
        h("span", null, "tokens ", h("b", null, fmtInt(meta.input_tokens) + " in / " + fmtInt(meta.output_tokens) + " out"))));

    // Pair calls and outputs across the whole trajectory (input history and response output).
    const input = typeof params2.input === "string" ? [{ type: "message", role: "user", content: params2.input }] : Array.isArray(params2.input) ? params2.input : [];
    const output = Array.isArray(resp.output) ? resp.output : [];
    const outputsById = new Map();
    for (const it of input.concat(output)) if (it && it.type === "function_call_output" && !outputsById.has(it.call_id)) outputsById.set(it.call_id, it);
    const shown = new Set();
    const convo = h("div", { class: "convo", id: "conversation" });
    if (typeof params2.instructions === "string" && params2.instructions) {
      convo.appendChild(h("div", { class: "msg instructions", dataset: { role: "instructions" } }, h("div", { class: "who" }, "instructions"), longText(params2.instructions)));
    }
    append(convo, [h("div", { class: "section-label" }, "Input")]);
    append(convo, renderItems(input, outputsById, shown, { input: true }));
    append(convo, [h("div", { class: "section-label" }, "Model response" + (resp.model ? " — " + resp.model : "") + (resp.status && resp.status !== "completed" ? " (" + resp.status + ")" : ""))]);
    if (resp.error) convo.appendChild(errorBox("Response error: " + JSON.stringify(resp.error)));
    if (resp.incomplete_details) convo.appendChild(h("div", { class: "banner warn" }, "Incomplete: " + JSON.stringify(resp.incomplete_details)));
    const outNodes = renderItems(output, outputsById, shown, { input: false, turns: true, stepAfter: stepsMap(resp), th });
    append(convo, outNodes.length ? outNodes : [h("div", { class: "muted" }, "The response has no output items.")]);
    const steps = stepsCard(resp, th);
    if (steps) convo.appendChild(steps);
    convo.appendChild(verifyBlock(data, th));
    const calls = h("div", { class: "card section", id: "model-calls" }, h("div", { class: "head" }, h("h2", null, "Model calls")));
    convo.appendChild(calls);
    loadModelCalls(fileId, row, calls, token);

    const raw = h("div", { class: "card raw", id: "raw", hidden: true });
    app.appendChild(head);
    app.appendChild(h("div", { class: "traj-grid" }, h("div", null, convo, raw), sidePanel(data)));
    window.scrollTo(0, 0);
  }

  // The rollout's captured model calls (the _model_calls.jsonl sidecar of +observability_enabled=true).
  function lazyJson(label, value, cls) {
    const d = h("details", { class: "mc-json " + cls }, h("summary", null, label));
    d.addEventListener("toggle", () => { if (d.open && d.children.length === 1) d.appendChild(jsonPre(value)); });
    return d;
  }

  async function loadModelCalls(fileId, row, box, token) {
    const r = await api("/api/files/" + fileId + "/rollouts/" + row + "/model_calls");
    if (token !== state.token) return;
    const m = r.data || {};
    if (!r.ok) { box.appendChild(errorBox(m.error || "cannot read the model calls")); return; }
    if (m.error) { box.appendChild(h("div", { class: "pad warnline" }, m.error)); return; }
    if (!m.present) {
      box.appendChild(h("div", { class: "pad muted" }, "No _model_calls.jsonl sidecar next to this file (collect with +observability_enabled=true to record model calls)."));
      return;
    }
    const list = m.calls || [];
    const sum = (k) => list.reduce((a, c) => a + (typeof c[k] === "number" ? c[k] : 0), 0);
    const head = box.querySelector(".head");
    head.appendChild(h("span", { class: "badge none", id: "model-calls-count" }, fmtInt(list.length) + " call" + (list.length === 1 ? "" : "s")));
    head.appendChild(h("span", { class: "muted small" }, fmtNum(sum("latency_ms"), 1) + " ms · " + fmtInt(sum("tokens_in")) + " in / " + fmtInt(sum("tokens_out")) + " out tokens"));
    if (m.dropped) head.appendChild(h("span", { class: "badge part", id: "model-calls-dropped" }, fmtInt(m.dropped) + " dropped (capture bound)"));
    if (!list.length) { box.appendChild(h("div", { class: "pad muted" }, "No model call was recorded for this rollout.")); return; }
    list.forEach((c, i) => {
      const failed = c.status_code === null || c.status_code === undefined || c.status_code >= 400;
      const model = c.model_ref && c.model_ref.name ? c.model_ref.name : "—";
      box.appendChild(h("div", { class: "pad mcall" + (failed ? " error" : ""), dataset: { call: String(i) } },
        h("div", { class: "row" },
          h("b", null, "#" + (i + 1)),
          h("span", { class: "badge " + (failed ? "err" : "pass"), title: "HTTP status" }, String(c.status_code ?? "no answer")),
          h("span", { class: "mc-latency" }, fmtNum(c.latency_ms, 1) + " ms"),
          h("span", { class: "mc-tokens" }, fmtInt(c.tokens_in) + " in / " + fmtInt(c.tokens_out) + " out"),
          h("span", { class: "muted small" }, model + " · " + (c.dialect || "") + (c.rollout_status === "failed" ? " · failed attempt" : ""))),
        c.error ? h("pre", { class: "pane err" }, (c.error_category ? c.error_category + ": " : "") + c.error) : null,
        c.payload_omitted ? h("div", { class: "small muted" }, c.payload_omitted) : null,
        lazyJson("Request", c.request, "mc-request"),
        lazyJson("Response", c.response, "mc-response")));
    });
  }

  function toggleRaw() {
    const raw = document.getElementById("raw");
    if (!raw || !state.rollout || !state.rollout.data) return;
    if (!raw.firstChild) raw.appendChild(jsonPre(state.rollout.data));
    raw.hidden = !raw.hidden;
    const btn = document.getElementById("raw-toggle");
    if (btn) btn.classList.toggle("on", !raw.hidden);
    if (!raw.hidden) raw.scrollIntoView({ block: "start" });
  }

  function toggleReasoning() {
    const all = document.querySelectorAll("details.reasoning");
    const open = Array.from(all).some((d) => !d.open);
    all.forEach((d) => { d.open = open; });
  }

  // ---------------------------------------------------------------------------------------------
  // Summary.

  function statCard(label, value, sub, id) {
    return h("div", { class: "card stat", id }, h("div", { class: "label" }, label), h("div", { class: "value" }, value), sub ? h("div", { class: "sub" }, sub) : null);
  }

  function histogramSvg(hist) {
    const NS = "http://www.w3.org/2000/svg";
    const mk = (tag, attrs, text) => {
      const el = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
      if (text !== undefined) el.textContent = text;
      return el;
    };
    const bins = hist.bins || [];
    const W = 640, H = 220, L = 44, B = 30, T = 12, R = 8;
    const svg = mk("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "Histogram of rewards" });
    if (!bins.length) { svg.appendChild(mk("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no rewards")); return svg; }
    const max = Math.max(...bins.map((b) => b.count), 1);
    const plotW = W - L - R, plotH = H - T - B;
    const bw = plotW / bins.length;
    for (let i = 0; i <= 4; i++) {
      const y = T + plotH - (plotH * i) / 4;
      svg.appendChild(mk("line", { x1: L, x2: W - R, y1: y, y2: y, "stroke-dasharray": i ? "2,3" : "" }));
      svg.appendChild(mk("text", { x: L - 6, y: y + 4, "text-anchor": "end" }, fmtInt(Math.round((max * i) / 4))));
    }
    const every = Math.ceil(bins.length / 10);
    bins.forEach((b, i) => {
      const hgt = (plotH * b.count) / max;
      const x = L + i * bw + Math.min(4, bw * 0.1);
      const rect = mk("rect", { class: "barrect", x, y: T + plotH - hgt, width: Math.max(1, bw - 2 * Math.min(4, bw * 0.1)), height: hgt, rx: 2 });
      rect.appendChild(mk("title", {}, (hist.kind === "values" ? "reward " + b.label : "reward " + b.label) + ": " + fmtInt(b.count) + " rollouts"));
      svg.appendChild(rect);
      if (hist.kind === "values" && b.count) svg.appendChild(mk("text", { x: L + i * bw + bw / 2, y: T + plotH - hgt - 4, "text-anchor": "middle" }, fmtInt(b.count)));
      if (i % every === 0) svg.appendChild(mk("text", { x: L + i * bw + bw / 2, y: H - B + 16, "text-anchor": "middle" }, hist.kind === "values" ? b.label : fmtNum(b.lo, 2)));
    });
    return svg;
  }

  const TASK_COLUMNS = [
    { key: "task", label: "Task", num: true, render: (r) => (r.task === null ? "—" : fmtInt(r.task)) },
    { key: "rollouts", label: "Rollouts", num: true, defaultDesc: true, render: (r) => fmtInt(r.rollouts) },
    { key: "passed", label: "Passed", num: true, defaultDesc: true, render: (r) => fmtInt(r.passed) },
    {
      key: "pass_rate", label: "Pass rate", num: true, defaultDesc: true,
      render: (r) => [fmtPct(r.pass_rate), h("div", { class: "bar rate" }, h("div", { style: { width: ((r.pass_rate || 0) * 100).toFixed(1) + "%" } }))],
    },
    { key: "mean_reward", label: "Mean reward", num: true, defaultDesc: true, render: (r) => fmtNum(r.mean_reward) },
    { key: "std_reward", label: "Std", num: true, defaultDesc: true, render: (r) => fmtNum(r.std_reward) },
    { key: "mean_turns", label: "Turns", num: true, defaultDesc: true, render: (r) => fmtNum(r.mean_turns, 1) },
    { key: "mean_tool_calls", label: "Tool calls", num: true, defaultDesc: true, render: (r) => fmtNum(r.mean_tool_calls, 1) },
    { key: "mean_tokens", label: "Tokens", num: true, defaultDesc: true, render: (r) => fmtInt(Math.round(r.mean_tokens)) },
    { key: "error_rollouts", label: "With errors", num: true, defaultDesc: true, render: (r) => (r.error_rollouts ? h("span", { class: "badge err" }, fmtInt(r.error_rollouts)) : "0") },
    { key: "preview", label: "Prompt", sortable: false, cls: "preview", render: (r) => h("span", { title: r.preview }, r.preview) },
  ];

  async function renderSummary(fileId, params, token) {
    clear(app);
    app.appendChild(h("div", { class: "muted" }, "Loading summary…"));
    const r = await api("/api/files/" + fileId + "/summary");
    if (token !== state.token) return;
    clear(app);
    if (!r.ok) { app.appendChild(errorBox(r.data.error)); return; }
    const s = r.data;
    const passK = Object.entries(s.pass_at_k || {}).map(([k, v]) => k + " " + fmtPct(v)).join(" · ");
    app.appendChild(h("div", { class: "stats", id: "stats" },
      statCard("Rollouts", fmtInt(s.rows), s.unscored ? fmtInt(s.unscored) + " without a reward" : fmtInt(s.num_tasks) + " tasks", "stat-rollouts"),
      statCard("Mean reward", fmtNum(s.mean_reward), "std " + fmtNum(s.std_reward) + " · min " + fmtNum(s.min_reward) + " · max " + fmtNum(s.max_reward), "stat-mean"),
      statCard("Pass rate", fmtPct(s.pass_rate), (passK || "—") + " (reward ≥ " + s.pass_threshold + ")", "stat-pass"),
      statCard("Tasks", fmtInt(s.num_tasks), "grouped by _ng_task_index", "stat-tasks"),
      statCard("Tokens", fmtInt(s.tokens.total_tokens), fmtInt(s.tokens.input_tokens) + " in · " + fmtInt(s.tokens.output_tokens) + " out", "stat-tokens"),
      statCard("Turns / tool calls", fmtNum(s.mean_turns, 2) + " / " + fmtNum(s.mean_tool_calls, 2), "mean per rollout", "stat-turns"),
      statCard("With errors", fmtInt(s.error_rollouts), "tool errors, missing outputs, failed responses", "stat-errors"),
      statCard("Malformed lines", fmtInt(s.malformed_total), s.malformed_total ? "listed below" : "none", "stat-malformed"),
      statCard("Failures", s.failures.present ? fmtInt(s.failures.total) : "—", s.failures.present ? "from the _failures.jsonl sidecar" : "no _failures.jsonl sidecar", "stat-failures")));

    const agents = Object.entries(s.agents || {});
    app.appendChild(h("div", { class: "two" },
      h("div", { class: "card pad hist", id: "histogram" }, h("h3", null, "Reward histogram"), histogramSvg(s.histogram)),
      h("div", { class: "card pad" }, h("h3", null, "Agents"),
        h("table", { class: "grid" }, h("thead", null, h("tr", null, h("th", null, "Agent"), h("th", { class: "num" }, "Rollouts"))),
          h("tbody", null, agents.map(([a, n]) => h("tr", null, h("td", null, a || "(none)"), h("td", { class: "num" }, fmtInt(n)))))),
        h("div", { class: "small muted", style: { marginTop: "10px" } }, "File: " + s.file.path + " · " + fmtBytes(s.file.size) +
          (s.file.index_seconds !== null ? " · indexed in " + s.file.index_seconds.toFixed(2) + " s" : "")))));

    // Per-task table (server-side sort and paging).
    const taskBox = h("div", { class: "card section", id: "tasks" });
    app.appendChild(taskBox);
    const tsort = params.get("tsort") || "task";
    const tdesc = params.get("tdesc") === "1";
    const tpage = Math.max(0, Number(params.get("tpage") || 0));
    const tsize = 50;
    const setP = (changes) => {
      const p = new URLSearchParams(params);
      for (const [k, v] of Object.entries(changes)) { if (v === null || v === "" || v === undefined) p.delete(k); else p.set(k, v); }
      navigate(["summary"], p, true);
    };
    const tr = await api("/api/files/" + fileId + "/tasks", { sort: tsort, desc: tdesc ? "1" : "", offset: tpage * tsize, limit: tsize });
    if (token !== state.token) return;
    if (!tr.ok) taskBox.appendChild(errorBox(tr.data.error));
    else {
      taskBox.appendChild(h("div", { class: "head" }, h("h2", null, "Per-task pass rate"),
        h("span", { class: "muted small" }, fmtInt(tr.data.total) + " tasks · click a task to see its rollouts"),
        h("span", { class: "spacer" }), pager(tr.data.offset, tsize, tr.data.total, (pg) => setP({ tpage: pg ? String(pg) : null }))));
      taskBox.appendChild(h("div", { class: "table-wrap" }, sortTable(TASK_COLUMNS, tr.data.rows, tsort, tdesc,
        (key, desc) => setP({ tsort: key === "task" ? null : key, tdesc: desc ? "1" : null, tpage: null }),
        (row) => navigate(["list"], Object.assign(fileId !== state.main ? { file: fileId } : {}, row.task === null ? {} : { tasks: String(row.task), sort: "task" })),
        (row) => ({ dataset: { task: row.task === null ? "" : row.task } }))));
    }

    // Failures sidecar.
    const fl = s.failures;
    const fbox = h("div", { class: "card section", id: "failures" }, h("div", { class: "head" }, h("h2", null, "Infrastructure failures"),
      h("span", { class: "muted small mono" }, fl.path)));
    if (fl.error) fbox.appendChild(h("div", { class: "pad warnline" }, fl.error));
    else if (!fl.present) fbox.appendChild(h("div", { class: "pad muted" }, "No failures sidecar next to this file."));
    else if (!fl.total) fbox.appendChild(h("div", { class: "pad muted" }, "The sidecar is empty: no rollout failed for infrastructure reasons."));
    else {
      fbox.appendChild(h("div", { class: "pad row" },
        Object.entries(fl.by_kind).map(([k, n]) => h("span", { class: "badge err" }, k + ": " + fmtInt(n))),
        Object.entries(fl.by_server).map(([k, n]) => h("span", { class: "badge none" }, "server " + k + ": " + fmtInt(n))),
        fl.malformed ? h("span", { class: "badge part" }, fl.malformed + " malformed line(s)") : null));
      fbox.appendChild(h("div", { class: "table-wrap" }, h("table", { class: "grid" },
        h("thead", null, h("tr", null, ["Line", "Task", "Rollout", "Attempt", "Kind", "Server", "Path", "Status", "Error"].map((x) => h("th", null, x)))),
        h("tbody", null, fl.rows.map((f) => h("tr", null,
          h("td", { class: "num" }, fmtInt(f.line_no)), h("td", { class: "num" }, f.task ?? "—"), h("td", { class: "num" }, f.rollout ?? "—"),
          h("td", { class: "num" }, f.attempt ?? "—"), h("td", null, h("span", { class: "badge err" }, f.kind ?? "—")), h("td", null, f.server ?? "—"),
          h("td", { class: "mono small" }, f.path ?? "—"), h("td", null, f.status ?? "—"), h("td", null, h("pre", null, f.error))))))));
      if (fl.total > fl.rows.length) fbox.appendChild(h("div", { class: "pad small muted" }, "First " + fl.rows.length + " of " + fmtInt(fl.total) + " shown."));
    }
    app.appendChild(fbox);

    const mbox = h("div", { class: "card section", id: "malformed" }, h("div", { class: "head" }, h("h2", null, "Malformed lines"),
      h("span", { class: "muted small" }, s.malformed_total ? fmtInt(s.malformed_total) + " skipped; every other line is shown" : "none")));
    if (s.malformed_total) mbox.appendChild(h("div", { class: "table-wrap" }, malformedTable(s.malformed)));
    app.appendChild(mbox);
  }

  // ---------------------------------------------------------------------------------------------
  // Compare.

  const CMP_COLUMNS = [
    { key: "task", label: "Task", num: true, render: (r) => (r.task === null ? "—" : fmtInt(r.task)) },
    {
      key: "preview", label: "Prompt", sortable: false, cls: "preview",
      render: (r) => [r.prompt_differs ? h("span", { class: "badge part", title: "B's prompt: " + (r.preview_b || "") }, "prompt differs") : null, " ", h("span", { title: r.preview }, r.preview)],
    },
    { key: "n_a", label: "A n", num: true, defaultDesc: true, render: (r) => fmtInt(r.n_a) },
    { key: "mean_a", label: "A mean", num: true, defaultDesc: true, render: (r) => fmtNum(r.mean_a) },
    { key: "pass_a", label: "A pass", num: true, defaultDesc: true, render: (r) => fmtPct(r.pass_a) },
    { key: "n_b", label: "B n", num: true, defaultDesc: true, render: (r) => fmtInt(r.n_b) },
    { key: "mean_b", label: "B mean", num: true, defaultDesc: true, render: (r) => fmtNum(r.mean_b) },
    { key: "pass_b", label: "B pass", num: true, defaultDesc: true, render: (r) => fmtPct(r.pass_b) },
    {
      key: "delta", label: "Δ mean (B − A)", num: true, defaultDesc: true,
      render: (r) => {
        if (r.delta === null) return h("span", { class: "muted" }, r.n_a === null ? "only in B" : r.n_b === null ? "only in A" : "—");
        const cls = r.delta > 1e-9 ? "delta-pos" : r.delta < -1e-9 ? "delta-neg" : "muted";
        const w = Math.min(100, Math.abs(r.delta) * 100);
        return [h("span", { class: cls }, fmtSigned(r.delta)),
          h("div", { class: "bar " + (r.delta >= 0 ? "pos" : "neg") }, h("div", { style: r.delta >= 0 ? { left: "50%", width: w / 2 + "%" } : { right: "50%", width: w / 2 + "%" } }))];
      },
    },
    { key: "delta_pass", label: "Δ pass", num: true, defaultDesc: true, render: (r) => (r.delta_pass === null ? "—" : h("span", { class: r.delta_pass > 1e-9 ? "delta-pos" : r.delta_pass < -1e-9 ? "delta-neg" : "muted" }, fmtSigned(r.delta_pass * 100, 1) + " pp")) },
  ];

  async function renderCompare(params, token) {
    await refreshFiles();
    if (token !== state.token) return;
    const ids = state.files.map((f) => f.id);
    let a = params.get("a") || state.main;
    let b = params.get("b") || state.compare || ids.find((x) => x !== a) || null;
    if (!fileById(a)) a = state.main;
    if (b && !fileById(b)) b = null;
    clear(app);
    const setP = (changes, replace) => {
      const p = new URLSearchParams(params);
      p.set("a", a);
      if (b) p.set("b", b);
      for (const [k, v] of Object.entries(changes)) { if (v === null || v === "" || v === undefined) p.delete(k); else p.set(k, v); }
      navigate(["compare"], p, replace !== false);
    };
    const fileOptions = (selected) => state.files.map((f) => h("option", { value: f.id, selected: f.id === selected }, f.name + " (" + f.id + ") — " + f.path));
    const pathInput = h("input", { type: "text", class: "path", id: "cmp-path", placeholder: "/path/to/other_rollouts.jsonl" });
    const openMsg = h("span", { class: "small" });
    const openBtn = h("button", {
      type: "button", class: "btn primary", id: "cmp-open",
      onclick: async () => {
        const path = pathInput.value.trim();
        if (!path) return;
        openBtn.disabled = true;
        const r = await api("/api/files", null, { path, role: "compare" });
        openBtn.disabled = false;
        if (!r.ok) { openMsg.textContent = r.data.error; openMsg.className = "small warnline"; return; }
        state.files = [];
        await refreshFiles();
        b = r.data.id;
        setP({ b, page: null }, false);
      },
    }, "Open as B");
    pathInput.addEventListener("keydown", (e) => { if (e.key === "Enter") openBtn.click(); });
    app.appendChild(h("div", { class: "card picker", id: "cmp-picker" },
      h("label", { class: "field" }, "A (baseline)", h("select", { id: "cmp-a", onchange: (e) => { a = e.target.value; setP({ page: null }); } }, fileOptions(a))),
      h("label", { class: "field" }, "B (compared)", h("select", { id: "cmp-b", onchange: (e) => { b = e.target.value; setP({ page: null }); } },
        b ? null : h("option", { value: "", selected: true }, "— open a second file —"), fileOptions(b))),
      h("label", { class: "field" }, "Open another rollouts file", pathInput), openBtn, openMsg));
    if (!b) {
      app.appendChild(h("div", { class: "banner info" }, "Comparison shows, per task (_ng_task_index), the mean reward and pass rate of two rollout files of the same tasks and their difference. Open a second file above, or start ng_viewer with +compare_jsonl_fpath=<other.jsonl>."));
      return;
    }
    for (const id of [a, b]) {
      const f = await whenReady(id, token);
      if (!f || token !== state.token) return;
    }
    // whenReady may have drawn a progress box: redraw the picker by re-routing once both are ready.
    if (!document.getElementById("cmp-picker")) { route(); return; }
    const sort = params.get("sort") || "task";
    const desc = params.get("desc") === "1";
    const page = Math.max(0, Number(params.get("page") || 0));
    const only = params.get("only") || "all";
    const size = 50;
    const r = await api("/api/compare", { a, b, sort, desc: desc ? "1" : "", offset: page * size, limit: size, only });
    if (token !== state.token) return;
    if (!r.ok) { app.appendChild(errorBox(r.data.error)); return; }
    const c = r.data;
    app.appendChild(h("div", { class: "stats", id: "cmp-stats" },
      statCard("Tasks in both", fmtInt(c.tasks_both), fmtInt(c.tasks_only_a) + " only in A · " + fmtInt(c.tasks_only_b) + " only in B", "cmp-both"),
      statCard("Mean reward A", fmtNum(c.mean_a), "mean of per-task means, tasks in both", "cmp-mean-a"),
      statCard("Mean reward B", fmtNum(c.mean_b), "mean of per-task means, tasks in both", "cmp-mean-b"),
      statCard("Δ mean (B − A)", h("span", { class: c.mean_delta > 1e-9 ? "delta-pos" : c.mean_delta < -1e-9 ? "delta-neg" : "" }, fmtSigned(c.mean_delta)), "per-task mean, averaged", "cmp-delta"),
      statCard("Improved / regressed", fmtInt(c.improved) + " / " + fmtInt(c.regressed), fmtInt(c.unchanged) + " unchanged", "cmp-changes")));
    if (c.prompt_mismatches) {
      app.appendChild(h("div", { class: "banner warn", id: "cmp-mismatch" }, c.prompt_mismatches + " task(s) have a different prompt in A and B: these files may not be of the same tasks (marked below)."));
    }
    const chips = [["all", "All"], ["changed", "Changed"], ["improved", "Improved"], ["regressed", "Regressed"], ["only_a", "Only in A"], ["only_b", "Only in B"]]
      .map(([k, label]) => h("button", { type: "button", class: "btn" + (only === k ? " on" : ""), dataset: { only: k }, onclick: () => setP({ only: k === "all" ? null : k, page: null }) }, label));
    const box = h("div", { class: "card section", id: "cmp-table" },
      h("div", { class: "head" }, h("h2", null, "Per-task reward delta"), h("div", { class: "chips" }, chips), h("span", { class: "spacer" }),
        h("span", { class: "muted small" }, fmtInt(c.total) + " tasks"), pager(c.offset, size, c.total, (pg) => setP({ page: pg ? String(pg) : null }))),
      h("div", { class: "table-wrap" }, c.rows.length ? sortTable(CMP_COLUMNS, c.rows, sort, desc,
        (key, d) => setP({ sort: key === "task" ? null : key, desc: d ? "1" : null, page: null }),
        (row) => { if (row.task !== null) navigate(["list"], Object.assign(row.n_a !== null ? (a !== state.main ? { file: a } : {}) : { file: b }, { tasks: String(row.task), sort: "task" })); },
        (row) => ({ dataset: { task: row.task === null ? "" : row.task }, title: "Show this task's rollouts" })) : h("div", { class: "pad muted" }, "No task in this selection.")));
    app.appendChild(box);
  }

  // ---------------------------------------------------------------------------------------------
  // Keyboard.

  function openHelp(show) { document.getElementById("help").hidden = !show; }

  document.getElementById("help-button").addEventListener("click", () => openHelp(true));
  document.getElementById("help-close").addEventListener("click", () => openHelp(false));
  document.getElementById("help").addEventListener("click", (e) => { if (e.target.id === "help") openHelp(false); });

  document.addEventListener("keydown", (e) => {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    const t = e.target;
    const typing = t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT" || t.isContentEditable);
    if (e.key === "Escape" && !document.getElementById("help").hidden) { openHelp(false); return; }
    if (typing) {
      if (e.key === "Escape") t.blur();
      if (e.key === "Enter" && t.id === "f-q") t.blur();
      return;
    }
    const view = parseHash().parts[0] || "list";
    if (state.keyPrefix === "g") {
      state.keyPrefix = null;
      const dest = { l: "list", s: "summary", c: "compare" }[e.key];
      if (dest) { e.preventDefault(); navigate([dest], {}); }
      return;
    }
    if (e.key === "g") { state.keyPrefix = "g"; setTimeout(() => { state.keyPrefix = null; }, 1200); return; }
    if (e.key === "?") { openHelp(document.getElementById("help").hidden); return; }
    if (view === "list") {
      const n = state.listRows.length;
      if ((e.key === "j" || e.key === "ArrowDown") && n) { e.preventDefault(); state.sel = Math.min(n - 1, state.sel + 1); highlightSel(true); }
      else if ((e.key === "k" || e.key === "ArrowUp") && n) { e.preventDefault(); state.sel = Math.max(0, state.sel - 1); highlightSel(true); }
      else if ((e.key === "Enter" || e.key === "o") && n && state.sel >= 0) {
        e.preventDefault();
        const tr = document.querySelectorAll("#rows-box tbody tr")[state.sel];
        if (tr) tr.click();
      } else if (e.key === "ArrowRight") { const b = document.querySelector('[data-act="next-page"]'); if (b && !b.disabled) b.click(); }
      else if (e.key === "ArrowLeft") { const b = document.querySelector('[data-act="prev-page"]'); if (b && !b.disabled) b.click(); }
      else if (e.key === "/") { e.preventDefault(); const q = document.getElementById("f-q"); if (q) { q.focus(); q.select(); } }
    } else if (view === "rollout" && state.rollout) {
      const step = (e.key === "j" || e.key === "ArrowRight" || e.key === "n") ? "next"
        : (e.key === "k" || e.key === "ArrowLeft" || e.key === "p") ? "prev" : null;
      if (step) {
        e.preventDefault();
        if (state.navBusy) { if (state.navQueue.length < 50) state.navQueue.push(step); }
        else state.rollout[step]();
      }
      else if (e.key === "Escape" || e.key === "u" || e.key === "Backspace") { e.preventDefault(); state.rollout.back(); }
      else if (e.key === "r") { e.preventDefault(); toggleRaw(); }
      else if (e.key === "e") { e.preventDefault(); toggleReasoning(); }
    }
  });

  window.addEventListener("hashchange", route);
  route();
})();

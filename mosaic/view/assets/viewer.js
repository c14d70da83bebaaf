// mosaic view: the page's only script (no libraries, no network).
// Reads the JSON in #mosaic-data, draws one card per trajectory (session graph + advantage table),
// and a transcript when a session is clicked. Cards render a page at a time so a run of
// thousands of trajectories opens fast; transcripts are built only on demand.
// Safety: every value from the data enters HTML through esc() or fmt() (both return escaped text,
// whatever the value's type), and colours are set through the DOM (paint), not style attributes:
// the page's policy allows this script and its style sheet only (issue 33).
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("mosaic-data").textContent);
  const PAGE = 40;
  const KIND_COLOUR = { main: "#3b6fd8", compaction: "#e08a1e", subagent: "#2e9e5b", reset: "#8a4fc9" };
  D.samples.forEach((t, i) => { t._i = i; });
  const EST = D.estimators;
  const $ = (sel, el) => (el || document).querySelector(sel);
  const esc = (s) => String(typeof s === "object" && s !== null ? JSON.stringify(s) : s)
    .replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const isNum = (x) => typeof x === "number" && isFinite(x);
  const fmt = (x) => (x === null || x === undefined ? "–" : !isNum(x) ? esc(x)
    : Math.abs(x) >= 1e6 ? x.toExponential(2) : Math.abs(x) >= 100 ? x.toFixed(0) : x.toFixed(3));
  const has = (o, k) => o !== null && typeof o === "object" && Object.prototype.hasOwnProperty.call(o, k);
  const kindColour = (k) => (has(KIND_COLOUR, k) ? KIND_COLOUR[k] : "#777");
  const GAIN_UNIT = "nats per answer token";
  // a colour for an element, applied by paint() after the HTML is inserted (no inline style)
  const bg = (c) => (c ? ` data-bg="${esc(c)}"` : "");
  function paint(root) { for (const el of root.querySelectorAll("[data-bg]")) el.style.background = el.dataset.bg; }
  const piece = (id) => { const p = has(D.pieces, id) ? D.pieces[id] : undefined; return typeof p === "string" ? p : "\u2047"; };

  // ------------------------------------------------------------------ per-session token data
  function maskOf(s) {  // run lengths (first run False) -> Uint8Array
    const m = new Uint8Array(s.completion.length);
    let pos = 0, on = 0;
    for (const n of s.mask) { if (on) m.fill(1, pos, pos + n); pos += n; on ^= 1; }
    return m;
  }
  function turnSpans(m) {  // mosaic.trace.turn_spans: a sampled run and the inserted tokens after it
    const starts = [];
    for (let i = 0; i < m.length; i++) if (m[i] && (i === 0 || !m[i - 1])) starts.push(i);
    if (!starts.length) return [];
    starts[0] = 0;
    return starts.map((a, j) => [a, j + 1 < starts.length ? starts[j + 1] : m.length]);
  }
  function fullPrompt(t, k) {  // the session's prompt ids, its shared prefix restored
    const s = t.sessions[k];
    if (s._prompt) return s._prompt;
    let ids = s.prompt;
    if (s.prefix) {
      const [p, n] = s.prefix;
      ids = fullPrompt(t, p).concat(t.sessions[p].completion).slice(0, n).concat(s.prompt);
    }
    s._prompt = ids;
    return ids;
  }
  function tokenAdv(s, est) {  // (completion,) advantage of each token under `est`, NaN where not trained
    const m = maskOf(s);
    const a = new Float64Array(m.length).fill(NaN);
    if (s.adv && s.adv[est] !== undefined) {
      for (let i = 0; i < m.length; i++) if (m[i]) a[i] = s.adv[est];
    } else if (s.turn_adv && s.turn_adv[est]) {
      turnSpans(m).forEach(([x, y], u) => { for (let i = x; i < y; i++) if (m[i]) a[i] = s.turn_adv[est][u]; });
    }
    return a;
  }
  function sessionAdv(s, est) {  // mean over the session's trained tokens
    const a = tokenAdv(s, est);
    let sum = 0, n = 0;
    for (const x of a) if (!isNaN(x)) { sum += x; n++; }
    return n ? sum / n : null;
  }
  function trajAdv(t, est) {  // trajectory-token-mean: every trained token of the trajectory weighs the same
    let sum = 0, n = 0;
    for (const s of t.sessions) for (const x of tokenAdv(s, est)) if (!isNaN(x)) { sum += x; n++; }
    return n ? sum / n : null;
  }
  function forkTurn(t, k) {  // [parent, turn of the parent it left from (1-based)], or null when not a recorded fork
    const s = t.sessions[k];
    if (s.edge !== "forks" || s.parent === null) return null;
    const at = isNum(s.fork_at) ? s.fork_at : s.prefix ? s.prefix[1] : null;
    if (at === null) return [s.parent, null];
    const p = t.sessions[s.parent], j = at - fullPrompt(t, s.parent).length, m = maskOf(p);
    let u = 1;
    for (let i = 0; i < Math.min(j, m.length); i++) if (m[i] && (i === 0 || !m[i - 1])) u++;
    return [s.parent, u];  // the parent's turn that starts at (or holds) the fork point
  }
  const forkText = (f) => `forks from session ${esc(f[0])}` + (f[1] === null ? " (turn not recorded)" : ` at its turn ${f[1]}`);
  const hasRole = (s) => !!s.role && Number.isInteger(s.role.index);  // a reset session with harness.reset_roles
  function roleText(s) {  // its role and who played it
    if (!hasRole(s)) return "";
    const r = s.role;
    return `role ${r.index + 1}${r.text ? ` (${r.text})` : ""}` + (r.partner ? `, played by the ${r.partner} partner (not trained)` : "");
  }
  function notesText(s) {  // a reset session's workspace: what it started from and what it added
    const n = s.notes;
    if (!n || !Array.isArray(n.before) || !Array.isArray(n.after)) return "";
    const added = n.after.slice(n.before.length);
    return `<br>workspace notes: ${fmtInt(n.before.length)} at the start, ${fmtInt(n.after.length)} at the end` +
      (added.length ? `; added: ${added.map((x) => `<q>${esc(x)}</q>`).join(" ")}` : "; none added") +
      (n.before.length ? `<details><summary>notes it started from</summary>${n.before.map((x) => `<div>${esc(x)}</div>`).join("")}</details>` : "");
  }
  function available(t, est) { return !(t.unavailable && t.unavailable[est]); }

  // ------------------------------------------------------------------ filters
  const steps = [...new Set(D.samples.map((t) => t.step))].sort((a, b) => a - b);
  const kinds = [...new Set(D.samples.flatMap((t) => t.sessions.map((s) => s.kind)))];
  const trained = D.samples.find((t) => t.estimator) ? D.samples.find((t) => t.estimator).estimator : null;
  const state = { step: steps.length ? String(steps[steps.length - 1]) : "all", outcome: "all", est: "all",
                  kind: "all", colour: "mask", shown: 0, list: [] };
  function options(sel, vals, labels) {
    sel.innerHTML = vals.map((v, i) => `<option value="${esc(v)}">${esc(labels ? labels[i] : v)}</option>`).join("");
  }
  options($("#f-step"), ["all"].concat(steps.map(String)), ["all steps"].concat(steps.map((s) => `step ${s}`)));
  options($("#f-outcome"), ["all", "success", "failure"], ["success and failure", "success", "failure"]);
  options($("#f-est"), ["all"].concat(EST), ["every estimator"].concat(EST.map((e) => e + (e === trained ? " (trained)" : ""))));
  options($("#f-kind"), ["all"].concat(kinds), ["every kind"].concat(kinds));
  options($("#f-colour"), ["mask", "advantage"], ["colour: loss mask", "colour: advantage"]);
  for (const [id, key] of [["#f-step", "step"], ["#f-outcome", "outcome"], ["#f-est", "est"], ["#f-kind", "kind"], ["#f-colour", "colour"]]) {
    $(id).value = state[key];
    $(id).addEventListener("change", (e) => {
      state[key] = e.target.value;
      if (key !== "colour") render();
      if (key === "colour" || key === "est") redrawTranscript();  // the colouring estimator may have changed
    });
  }
  const colourEst = () => (state.est !== "all" ? state.est : trained || EST.find((e) => D.samples.some((t) => available(t, e))));

  function filtered() {
    return D.samples.filter((t) =>
      (state.step === "all" || String(t.step) === state.step) &&
      (state.outcome === "all" || (state.outcome === "success") === t.success) &&
      (state.kind === "all" || t.sessions.some((s) => s.kind === state.kind)));
  }

  // ------------------------------------------------------------------ session graph
  function layout(t) {  // continues edges go right along a row; a fork opens the next row below its parent
    const pos = [], rowEnd = [];
    for (const s of t.sessions) {
      let row = 0, col = 0;
      if (s.parent !== null) {
        const p = pos[s.parent];
        row = s.edge === "forks" ? p.row + 1 : p.row;
        col = s.edge === "forks" ? p.col : p.col + 1;
      }
      while (rowEnd[row] !== undefined && col <= rowEnd[row]) col++;
      rowEnd[row] = col;
      pos.push({ row, col });
    }
    return pos;
  }
  const ARROW = `<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#666"/></marker></defs>`;
  function graphSvg(t, ti) {
    const pos = layout(t), W = 118, H = 40, GX = 30, GY = 22;
    const cols = Math.max(...pos.map((p) => p.col)) + 1, rows = Math.max(...pos.map((p) => p.row)) + 1;
    const x = (p) => 6 + p.col * (W + GX), y = (p) => 6 + p.row * (H + GY);
    let edges = "", nodes = "";
    t.sessions.forEach((s, k) => {
      const p = pos[k];
      if (s.parent !== null) {
        const q = pos[s.parent], f = forkTurn(t, k);
        const [x1, y1, x2, y2] = s.edge === "forks"
          ? [x(q) + W / 2, y(q) + H, x(p) + W / 2, y(p)] : [x(q) + W, y(q) + H / 2, x(p), y(p) + H / 2];
        edges += `<path class="edge ${esc(s.edge)}" d="M${x1},${y1} C${(x1 + x2) / 2},${s.edge === "forks" ? (y1 + y2) / 2 : y1} ${(x1 + x2) / 2},${s.edge === "forks" ? (y1 + y2) / 2 : y2} ${x2},${y2}" marker-end="url(#arrow)"/>`;
        if (f && f[1] !== null) edges += `<text class="elabel" x="${x2 + 4}" y="${y(p) - 4}">from turn ${f[1]}</text>`;
      }
      const dim = state.kind !== "all" && s.kind !== state.kind ? " dim" : "";
      const g = (!isNum(s.gain) ? (s.final ? "final" : "gain –") : `gain ${s.gain >= 0 ? "+" : ""}${s.gain.toFixed(2)}`) +
        (isNum(s.downstream) ? ` · D ${s.downstream >= 0 ? "+" : ""}${s.downstream.toFixed(2)}` : "") +
        (isNum(s.gain) && !isNum(s.downstream) ? " nats/tok" : "") + (disagrees(s) ? " ≠" : "");
      const f = forkTurn(t, k);
      nodes += `<g class="node${dim}${s.final ? " final" : ""}" data-traj="${ti}" data-s="${k}" tabindex="0">` +
        `<title>session ${k}: ${esc(s.kind)}, ended by ${esc(s.end)}, ${fmtInt(s.turns)} turn(s)` +
        (f ? `, ${forkText(f)}` : "") + (roleText(s) ? `, ${esc(roleText(s))}` : "") + (isNum(s.gain) ? `; information gain ${fmt(s.gain)} ${GAIN_UNIT}` : "") +
        (isNum(s.downstream) ? `; downstream credit ${fmt(s.downstream)} ${GAIN_UNIT} (${esc(s.downstream_how || "?")})` : "") +
        (disagrees(s) ? "; the two disagree in sign" : "") + `</title>` +
        `<rect x="${x(p)}" y="${y(p)}" width="${W}" height="${H}" rx="6" fill="${esc(kindColour(s.kind))}"/>` +
        `<text x="${x(p) + 6}" y="${y(p) + 16}">${k} ${esc(s.kind)}${hasRole(s) ? ` r${s.role.index + 1}${s.role.partner ? "*" : ""}` : ""}</text>` +
        `<text x="${x(p) + 6}" y="${y(p) + 32}" class="sub">${esc(g)}</text></g>`;
    });
    const w = 12 + cols * (W + GX) - GX, h = 12 + rows * (H + GY) - GY;
    return `<svg class="graph" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}">${ARROW}${edges}${nodes}</svg>`;
  }

  // ------------------------------------------------------------------ cards
  function advTable(t) {
    const ests = state.est === "all" ? EST : [state.est];
    let h = `<table class="adv"><tr><th title="each row: the advantage this estimator gives">advantage by estimator</th>` +
      `<th title="mean over the trajectory's trained tokens">whole trajectory (token mean)</th>` +
      t.sessions.map((s, k) => `<th title="mean over the session's trained tokens">session ${k}<br>${esc(s.kind)}</th>`).join("") + "</tr>";
    for (const e of ests) {
      const cls = (e === trained ? "trained " : "") + (e === colourEst() ? "colour" : "");
      if (!available(t, e)) {
        h += `<tr class="${cls} na"><td>${esc(e)}</td><td colspan="${t.sessions.length + 1}" title="${esc(t.unavailable[e])}">n/a: ${esc(t.unavailable[e])}</td></tr>`;
        continue;
      }
      const ta = trajAdv(t, e);
      h += `<tr class="${cls}"><td>${esc(e)}</td><td class="v"${bg(advStyle(ta, e))}>${fmt(ta)}</td>` +
        t.sessions.map((s) => { const v = sessionAdv(s, e); return `<td class="v"${bg(advStyle(v, e))}>${fmt(v)}</td>`; }).join("") + "</tr>";
    }
    h += `<tr class="gain"><td title="L(after) − L(before): mean log-probability of the answer's tokens">information gain (${GAIN_UNIT})</td><td></td>` + t.sessions.map((s) => `<td class="v">${s.final ? "final" : fmt(s.gain)}</td>`).join("") + "</tr>";
    if (t.sessions.some((s) => isNum(s.downstream)))
      h += `<tr class="gain"><td title="L(final) − L(final with this session's output removed), or its share of the session it fed">downstream credit (${GAIN_UNIT})</td><td></td>` +
        t.sessions.map((s) => `<td class="v${disagrees(s) ? " disagree" : ""}" title="${esc(s.downstream_how || "")}${disagrees(s) ? ": disagrees in sign with the immediate gain" : ""}">${s.final ? "final" : fmt(s.downstream)}</td>`).join("") + "</tr>";
    return h + "</table>";
  }
  function disagrees(s) {  // the immediate gain and the downstream credit point opposite ways
    return !s.final && isNum(s.gain) && isNum(s.downstream) && s.gain * s.downstream < 0;
  }
  const SCALE = {};  // per estimator: the largest |advantage| it gives in the run (fold's -1 would wash out mosaic's 0.1)
  for (const t of D.samples) for (const s of t.sessions) {
    for (const [e, v] of Object.entries(s.adv || {})) SCALE[e] = Math.max(SCALE[e] || 1e-9, Math.abs(v));
    for (const [e, vs] of Object.entries(s.turn_adv || {})) for (const v of vs) SCALE[e] = Math.max(SCALE[e] || 1e-9, Math.abs(v));
  }
  const scaleOf = (e) => SCALE[e] || 1e-9;
  function advColour(v, est) {  // diverging: blue positive, red negative, white zero; scaled per estimator
    const a = Math.min(1, Math.abs(v) / scaleOf(est || colourEst())) * 0.75;
    return v >= 0 ? `rgba(40,110,220,${a.toFixed(3)})` : `rgba(215,50,40,${a.toFixed(3)})`;
  }
  const advStyle = (v, est) => (isNum(v) ? advColour(v, est) : "");
  const fmtInt = (x) => (isNum(x) ? String(Math.round(x)) : fmt(x));

  // the environment's outcome (the service family): why a trajectory with the right answer can still fail
  function envTxt(e) {
    if (!e || typeof e !== "object") return "";
    const parts = [];
    if ("state_match" in e) parts.push(`account state ${e.state_match ? "right" : "wrong"}`);
    if ("answer_correct" in e) parts.push(`answer ${e.answer_correct ? "right" : "wrong"}`);
    if (isNum(e.visits_correct) && isNum(e.visits)) {
      parts.push(`visits handled ${fmtInt(e.visits_correct)}/${fmtInt(e.visits)}`);
    }
    if (isNum(e.stale_actions)) {
      parts.push(`stale actions ${fmtInt(e.stale_actions)}` + (isNum(e.actions) ? ` of ${fmtInt(e.actions)}` : ""));
    }
    if (isNum(e.forbidden) && e.forbidden) parts.push(`forbidden actions ${fmtInt(e.forbidden)}`);
    if (isNum(e.tool_errors) && e.tool_errors) parts.push(`tool errors ${fmtInt(e.tool_errors)}`);
    if (typeof e.error === "string") parts.push(`error: ${e.error}`);
    return parts.length ? ` · ${esc(parts.join(", "))}` : "";
  }

  function card(t, ti) {
    const nk = {};
    for (const s of t.sessions) nk[s.kind] = (nk[s.kind] || 0) + 1;
    const kindsTxt = Object.entries(nk).map(([k, n]) => `${n} ${k}`).join(", ");  // (escaped below)
    const g = t.group || {};
    return `<article class="traj ${t.success ? "ok" : "fail"}" data-traj="${ti}">` +
      `<header><span class="badge">${t.success ? "success" : "failure"} · reward ${fmt(t.reward)}</span> ` +
      `<b>${esc(t.trajectory)}</b> <span class="muted">step ${fmtInt(t.step)} · ${esc(kindsTxt)} · ended by ${esc(t.end_reason)} · ` +
      `answer <q>${esc(t.answer === null ? "none" : t.answer)}</q> vs <q>${esc(t.ground_truth || "?")}</q>` +
      envTxt(t.env) + (g.size ? ` · group of ${fmtInt(g.size)}: ${fmtInt(g.successes)} success(es), mean reward ${fmt(g.mean_reward)}` : "") + `</span></header>` +
      `<div class="body"><div class="gwrap">${graphSvg(t, ti)}</div>${advTable(t)}</div></article>`;
  }

  function render() {
    state.list = filtered();
    state.shown = 0;
    const list = $("#list");
    list.innerHTML = "";
    delete list.dataset.lastGroup;
    $("#count").textContent = `${state.list.length} of ${D.samples.length} trajectories` +
      (state.step === "all" ? "" : ` at step ${state.step}`);
    if (!D.samples.length) list.innerHTML = `<p class="muted">no trajectories recorded (trained with train.rollout_samples=0?)</p>`;
    more();
    drawPlots();
  }
  function more() {
    const list = $("#list");
    const end = Math.min(state.list.length, state.shown + PAGE);
    let html = "", lastGroup = list.dataset.lastGroup || "";
    for (let i = state.shown; i < end; i++) {
      const t = state.list[i];
      const key = t.step + "|" + t.group_id;
      if (key !== lastGroup) {
        html += `<h3 class="group">step ${fmtInt(t.step)} · group ${esc(t.group_id)}</h3>`;
        lastGroup = key;
      }
      html += card(t, t._i);
    }
    list.dataset.lastGroup = lastGroup;
    const old = $("#more");
    if (old) old.remove();
    list.insertAdjacentHTML("beforeend", html);
    paint(list);
    state.shown = end;
    if (end < state.list.length) {
      list.insertAdjacentHTML("beforeend", `<button id="more">show ${Math.min(PAGE, state.list.length - end)} more (${state.list.length - end} left)</button>`);
      $("#more").addEventListener("click", () => more());
    }
  }

  // ------------------------------------------------------------------ transcript
  let open = null;  // [trajectory index, session index]
  $("#list").addEventListener("click", (e) => {
    const n = e.target.closest("g.node");
    if (n) openTranscript(+n.dataset.traj, +n.dataset.s);
  });
  $("#list").addEventListener("keydown", (e) => {
    const n = e.target.closest("g.node");
    if (n && (e.key === "Enter" || e.key === " ")) openTranscript(+n.dataset.traj, +n.dataset.s);
  });
  function openTranscript(ti, k) { open = [ti, k]; redrawTranscript(); }
  function redrawTranscript() {
    const pane = $("#transcript");
    if (!open) return;
    const [ti, k] = open;
    const t = D.samples[ti], s = t.sessions[k];
    const prompt = fullPrompt(t, k), comp = s.completion, m = maskOf(s);
    const shared = s.prefix ? s.prefix[1] : 0;
    const est = colourEst(), adv = tokenAdv(s, est);
    const ids = prompt.concat(comp);
    // zone: 0 shared with the parent, 1 own prompt, 2 inserted completion, 3 sampled completion
    const zone = (i) => (i < shared ? 0 : i < prompt.length ? 1 : m[i - prompt.length] ? 3 : 2);
    const msgs = [];
    let cur = null;
    ids.forEach((id, i) => {
      const p = piece(id);
      if (p === "<|im_start|>" || !cur) { cur = { start: i, toks: [], text: "", role: "" }; msgs.push(cur); }
      cur.toks.push(i);
      cur.text += p;
      if (!cur.role && cur.text.startsWith("<|im_start|>") && cur.text.includes("\n")) cur.role = cur.text.slice(12, cur.text.indexOf("\n"));
    });
    const children = t.sessions.filter((c) => c.parent === k);
    const kid = (c) => `session ${c.id} (${c.kind})`;  // (escaped where used)
    const tokSpan = (i) => {
      const z = zone(i), j = i - prompt.length;
      let style = "";
      if (state.colour === "advantage" && z === 3 && !isNaN(adv[j])) style = bg(advColour(adv[j], est));
      const p = piece(ids[i]);
      const sp = /^<\|.*\|>$/.test(p) ? " sp" : "";
      return `<span class="t z${z}${sp}" data-i="${i}"${style}>${esc(p)}</span>`;
    };
    let body = "", sharedMsgs = "";
    for (const msg of msgs) {
      const z = zone(msg.start), sampled = msg.toks.some((i) => zone(i) === 3);
      const notes = [];
      const call = msg.text.match(/<tool_call>([\s\S]*?)<\/tool_call>/);
      if (call && msg.role === "assistant") {  // the system prompt's example call is not one
        let what = call[1];
        try { const j = JSON.parse(call[1]); what = `${j.name}(${Object.values(j.arguments || {}).map((v) => JSON.stringify(v)).join(", ")})`; } catch (err) { /* shown raw */ }
        notes.push(`<span class="note call">tool call: ${esc(what)}</span>`);
      }
      const ans = msg.text.match(/<answer>([\s\S]*?)<\/answer>/);
      if (ans && sampled) notes.push(`<span class="note answer">answer: ${esc(ans[1])}</span>`);
      if (msg.role === "tool" && /Error \(/.test(msg.text)) notes.push(`<span class="note err">tool error</span>`);
      if (s.kind === "compaction" && sampled && msg.role === "assistant")
        notes.push(`<span class="note handoff">summary, handed off to ${esc(children.map(kid).join(", ") || "no session")}</span>`);
      if (s.kind === "subagent" && sampled && ans)
        notes.push(`<span class="note handoff">returned to session ${esc(s.parent)} as the delegate tool's response</span>`);
      if (z === 1 && s.parent !== null && t.sessions[s.parent].kind === "compaction" && msg.role === "user")
        notes.push(`<span class="note handoff">hand-off: the summary written by session ${esc(s.parent)}</span>`);
      const html = `<div class="msg role-${esc(msg.role || "none")} zone${z}">` +
        `<div class="mhead">${esc(msg.role || "(text)")} ${notes.join(" ")}</div>` +
        `<div class="mbody">${msg.toks.map(tokSpan).join("")}</div></div>`;
      if (z === 0) sharedMsgs += html; else body += html;
    }
    const forks = children.filter((c) => c.edge === "forks").map(kid);
    const nTrained = m.reduce((a, b) => a + b, 0);
    pane.hidden = false;
    pane.innerHTML =
      `<header><button id="close" title="close">×</button><b>${esc(t.trajectory)}</b><br>` +
      `session ${k}: <span class="kind"${bg(kindColour(s.kind))}>${esc(s.kind)}</span> ` +
      `${s.parent === null ? "root" : forkTurn(t, k) ? forkText(forkTurn(t, k)) : `${esc(s.edge)} from session ${esc(s.parent)}`} · ended by ${esc(s.end)} · ${fmtInt(s.turns)} turn(s)` +
      (forks.length ? ` · forks ${esc(forks.join(", "))}` : "") + (roleText(s) ? ` · ${esc(roleText(s))}` : "") + `<br>` +
      `information gain <b>${s.final ? "final session (none)" : fmt(s.gain)}</b>${s.final || !isNum(s.gain) ? "" : ` ${GAIN_UNIT}`} · ` +
      (isNum(s.downstream) ? `downstream credit <b>${fmt(s.downstream)}</b> ${GAIN_UNIT} (${esc(s.downstream_how || "?")})${disagrees(s) ? " <b>disagrees in sign</b>" : ""} · ` : "") +
      `advantage (${esc(est)}) <b>${fmt(sessionAdv(s, est))}</b> · ` +
      `${ids.length} tokens: ${prompt.length} prompt, ${comp.length - nTrained} inserted, ${nTrained} sampled (trained)` +
      (s.turn_gains ? `<br>turn gains (${GAIN_UNIT}): ${s.turn_gains.map(fmt).join(", ")}` : "") +
      notesText(s) +
      `<div class="legend">${state.colour === "mask"
        ? `<span class="t z1">prompt</span> <span class="t z2">inserted (mask 0)</span> <span class="t z3">sampled (mask 1, trained)</span>`
        : `advantage under ${esc(est)}: <span class="t"${bg(advColour(-scaleOf(est), est))}>−${fmt(scaleOf(est))}</span> <span class="t">0</span> <span class="t"${bg(advColour(scaleOf(est), est))}>+${fmt(scaleOf(est))}</span>`}` +
      ` <span id="tokinfo" class="muted"></span></div></header>` +
      `<div class="tbody colour-${state.colour}">` +
      (sharedMsgs ? `<details class="shared"><summary>${fmtInt(shared)} tokens shared with session ${esc(s.prefix[0])}</summary>${sharedMsgs}</details>` : "") +
      body + `</div>`;
    paint(pane);
    $("#close").addEventListener("click", () => { pane.hidden = true; open = null; });
    pane.querySelector(".tbody").addEventListener("mouseover", (e) => {
      const sp = e.target.closest(".t");
      if (!sp) return;
      const i = +sp.dataset.i, j = i - prompt.length;
      $("#tokinfo").textContent = `token ${i}: id ${ids[i]}` + (j >= 0 ? ` · mask ${m[j]}` + (m[j] ? ` · advantage ${fmt(adv[j])}` : "") : " · prompt");
    });
  }

  // ------------------------------------------------------------------ the step's plots
  const CHARTS = [["critic/score/mean", "mean reward"], ["session/per_traj", "sessions per trajectory"],
    ["session/pos_gain_share/all", "positive-gain share"], ["critic/advantages/std", "advantage std"],
    ["response_length/mean", "response length"], ["actor/pg_loss", "policy loss"]];
  function drawPlots() {
    const box = $("#charts");
    const rows = D.metrics;
    if (!rows.length) { box.innerHTML = `<p class="muted">no metrics.jsonl</p>`; return; }
    const at = state.step === "all" ? null : +state.step;
    let html = "";
    for (const [key, title] of CHARTS) {
      const pts = rows.filter((r) => key in r).map((r) => [r.step, r[key]]);
      if (!pts.length) continue;
      const W = 210, H = 80, P = 4;
      const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
      const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
      const sx = (x) => P + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - 2 * P);
      const sy = (y) => H - P - (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5) * (H - 2 * P);
      const line = pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      const here = at === null ? null : pts.find((p) => p[0] === at);
      html += `<figure class="chart"><svg width="${W}" height="${H}"><polyline points="${line}"/>` +
        (here ? `<line x1="${sx(at)}" x2="${sx(at)}" y1="0" y2="${H}"/><circle cx="${sx(at)}" cy="${sy(here[1])}" r="3"/>` : "") +
        `</svg><figcaption>${esc(title)}${here ? `: <b>${fmt(here[1])}</b> at step ${at}` : ` (steps ${x0}–${x1})`}</figcaption></figure>`;
    }
    const row = at === null ? null : rows.find((r) => r.step === at);
    if (row) {
      html += `<details class="metrics"><summary>all metrics of step ${at}</summary><table>` +
        Object.keys(row).sort().map((k) => `<tr><td>${esc(k)}</td><td>${fmt(row[k])}</td></tr>`).join("") + `</table></details>`;
    }
    box.innerHTML = html;
    paint(box);
  }
  if (D.plots.length) {
    $("#runplots").innerHTML = `<details><summary>run plots (${D.plots.length})</summary>` +
      D.plots.map((p) => `<figure><img alt="${esc(p.name)}" src="${esc(p.src)}"><figcaption>${esc(p.name)}</figcaption></figure>`).join("") + `</details>`;
  }
  if (D.config) $("#config").innerHTML = `<details><summary>config.yaml</summary><pre>${esc(D.config)}</pre></details>`;

  render();
  window.mosaicViewReadyMs = performance.now();
  document.body.dataset.ready = "1";
})();

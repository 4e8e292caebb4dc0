// The page of one job: header and cancel, live curves, logs per rank with search, the
// timeline of events and attempts, checkpoints and artifacts, and the strategy's own view.
import { api, stream, url } from "./api.js";
import { h, duration, bytes, clock, now, stateBadge, progress, num, showError } from "./util.js";
import { MetricCharts } from "./charts.js";

const TERMINAL = ["SUCCEEDED", "FAILED", "CANCELLED"];
const MAX_LINES = 20000, MAX_SHOWN = 5000;

export function renderJob(main, jobId) {
  const head = h("section", { id: "job-head" });
  const charts = h("section", { id: "charts", class: "charts" });
  const logs = new LogPanel(jobId);
  const timeline = h("section", { id: "timeline" });
  const files = h("section", { id: "files" });
  const strategy = h("section", { id: "strategy" });
  main.append(head, h("h2", {}, "Metrics"), charts, h("h2", {}, "Logs"), logs.el, h("h2", {}, "Timeline"), timeline,
    h("div", { class: "two" }, h("div", {}, h("h2", {}, "Checkpoints and artifacts"), files), h("div", {}, h("h2", {}, "Strategy"), strategy)));
  const curves = new MetricCharts(charts, jobId);
  const streams = [];
  let job = null, filesTimer = null;

  const refresh = async () => {
    job = await api(`/jobs/${jobId}`);
    drawHead(head, job);
    drawTimeline(timeline, job);
    if (!strategy.dataset.drawn || !TERMINAL.includes(job.state)) drawStrategy(strategy, job);
  };
  const refreshFiles = () => drawFiles(files, jobId).catch(showError);
  (async () => {
    try {
      await refresh();
      const reported = Object.keys(job.last_metrics || {}).filter((k) => !["step", "time", "ranks", "total_steps"].includes(k)).sort();
      const after = await curves.load(reported[0]);
      streams.push(stream(`/jobs/${jobId}/metrics/stream`, after, { onRows: (_k, points) => {
        curves.add(points);
        if (rankFigures(points, job)) drawShares(strategy.querySelector("#balanced-shares"), job);
      } }));
      streams.push(stream(`/jobs/${jobId}/events/stream`, 0, {
        onRows: () => refresh().catch(showError), onEnd: () => { refresh().catch(showError); refreshFiles(); } }));
      logs.start(job);
      refreshFiles();
      filesTimer = setInterval(() => { if (!TERMINAL.includes(job.state)) refreshFiles(); }, 10000);
    } catch (e) { showError(e); main.append(h("p", { class: "error" }, String(e.message || e))); }
  })();
  return () => { for (const es of streams) es.close(); logs.close(); curves.close(); clearInterval(filesTimer); };
}

function drawHead(el, job) {
  const p = progress(job);
  const cancel = h("button", { id: "cancel", class: "danger", disabled: TERMINAL.includes(job.state) || job.state === "CANCELLING",
    onclick: async () => {
      if (!confirm(`Cancel ${job.id} (${job.name})?`)) return;
      try { await api(`/jobs/${job.id}/cancel`, { method: "POST" }); } catch (e) { showError(e); }
    } }, "Cancel");
  const m = job.last_metrics || {};
  el.replaceChildren(
    h("h1", {}, `${job.id} `, h("span", { class: "muted" }, job.name), " ", stateBadge(job.state), " ", cancel),
    h("div", { class: "facts" },
      fact("user", job.user || ""), fact("workers", (job.placement || []).map((x) => `${x.node_name}×${x.workers}`).join(", ") || job.spec.workers || ""),
      fact("progress", p.text), fact("ETA", p.eta), fact("attempt", job.attempt), fact("restarts", job.restarts),
      fact("age", duration(now() - job.submitted_at)), fact("ran", job.started_at ? duration((job.finished_at || now()) - job.started_at) : ""),
      ...Object.entries(m).filter(([k]) => !["step", "time", "total_steps"].includes(k)).slice(0, 6).map(([k, v]) => fact(k, num(v)))),
    job.waiting_reason ? h("p", { class: "muted" }, "waiting: " + job.waiting_reason) : "",
    job.failure ? h("div", { class: "failure" }, h("b", {}, job.failure.reason), h("pre", {}, (job.failure.last_lines || []).join("\n"))) : "");
}

const fact = (k, v) => h("div", {}, h("span", { class: "muted" }, k), " ", h("b", { "data-fact": k }, v));

function drawTimeline(el, job) {
  const events = job.events || [];
  const end = job.finished_at || now();
  const span = Math.max(1e-3, end - job.submitted_at);
  const bar = h("div", { class: "timeline-bar" });
  events.forEach((e, i) => {
    const until = i + 1 < events.length ? events[i + 1].time : end;
    bar.append(h("div", { class: "seg s-" + e.state.toLowerCase(), title: `${e.state} ${duration(until - e.time)}`,
      style: `width:${Math.max(0.3, 100 * (until - e.time) / span)}%` }));
  });
  const attempts = (job.restart_reasons || []).map((r, i) => h("li", {}, `attempt ${i + 1} ended: ${r.reason}` + (r.rank !== null && r.rank !== undefined ? ` (rank ${r.rank})` : "")));
  el.replaceChildren(bar, h("ol", { class: "events", id: "job-events" }, events.map((e) =>
    h("li", {}, h("span", { class: "muted" }, `${clock(e.time)} +${duration(e.time - job.submitted_at)}`), " ", stateBadge(e.state), " ", e.message))),
    attempts.length ? h("div", {}, h("h3", {}, "Earlier attempts"), h("ol", {}, attempts)) : "");
}

async function drawFiles(el, jobId) {
  const [artifacts, checkpoints] = await Promise.all([api(`/jobs/${jobId}/artifacts`), api(`/jobs/${jobId}/checkpoints`)]);
  const link = (kind, f) => h("li", {}, h("a", { href: url(`/jobs/${jobId}/${kind}/${f.path}`), download: f.path.split("/").pop() }, f.path),
    h("span", { class: "muted" }, " " + bytes(f.size)));
  el.replaceChildren(h("h3", {}, "Artifacts"), artifacts.length ? h("ul", { id: "artifacts" }, artifacts.map((f) => link("artifacts", f))) : h("p", { class: "muted" }, "none yet"),
    h("h3", {}, "Checkpoints"), checkpoints.length ? h("ul", { id: "checkpoints" }, checkpoints.map((f) => link("checkpoints", f))) : h("p", { class: "muted" }, "none yet"));
}

async function drawStrategy(el, job) {
  const strat = job.spec.strategy || { kind: "ddp" };
  const rows = Object.entries(strat).map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, typeof v === "object" ? JSON.stringify(v) : String(v))));
  const parts = [h("table", { class: "kv" }, rows)];
  if (strat.kind === "pipeline") {
    let plan = null;
    try { plan = JSON.parse(await (await api(`/jobs/${job.id}/artifacts/pipeline-plan.json`, { raw: true })).text()); } catch (_) { /* not yet */ }
    parts.push(plan ? pipelinePlan(plan) : h("p", { class: "muted" }, "The pipeline plan appears once rank 0 has profiled the model."));
    if (plan) el.dataset.drawn = "1";
  } else if (strat.kind === "parameter_server") {
    const workers = job.spec.workers || 0, servers = strat.servers || 0;
    parts.push(h("p", {}, `ranks 0–${workers - 1}: workers; ranks ${workers}–${workers + servers - 1}: parameter-server shards 0–${servers - 1}`));
    el.dataset.drawn = "1";
  } else el.dataset.drawn = "1";
  const ranks = (job.last_metrics || {}).ranks || {};
  if (strat.balance === "throughput" || Object.values(ranks).some((r) => r.share !== undefined)) {
    const shares = h("div", { id: "balanced-shares" });
    drawShares(shares, job);
    parts.push(h("h3", {}, "Balanced shares"), shares);
  }
  el.replaceChildren(...parts);
}

// Folds streamed points' per-rank figures (the server's PER_RANK_KEYS) into
// job.last_metrics.ranks, so the shares view follows the metrics stream between refreshes.
// Returns whether any figure changed.
const PER_RANK_KEYS = ["share", "measured_samples_per_s", "idle_fraction"];
function rankFigures(points, job) {
  if (!job) return false;
  const m = job.last_metrics = job.last_metrics || {};
  const ranks = m.ranks = m.ranks || {};
  let changed = false;
  for (const p of points) {
    for (const k of PER_RANK_KEYS) {
      const v = (p.values || {})[k];
      if (v === undefined || v === null) continue;
      const r = ranks[p.rank] = ranks[p.rank] || {};
      if (r[k] !== v) { r[k] = v; changed = true; }
    }
  }
  return changed;
}

// Each rank's share of the global batch (balance: throughput), its measured speed and the part
// of its step spent waiting in the all-reduce: the bars show the shares against the speeds.
function drawShares(el, job) {
  if (!el) return;
  const ranks = (job.last_metrics || {}).ranks || {};
  const ids = Object.keys(ranks).map(Number).sort((a, b) => a - b);
  if (!ids.length) { el.replaceChildren(h("p", { class: "muted" }, "The shares appear once the ranks have measured their speeds.")); return; }
  const total = ids.reduce((a, r) => a + (ranks[r].share || 0), 0) || 1;
  const speed = ids.reduce((a, r) => a + (ranks[r].measured_samples_per_s || 0), 0) || 1;
  const pct = (v) => v === undefined ? "" : `${num(100 * v, 3)}%`;
  el.replaceChildren(h("table", {}, h("thead", {}, h("tr", {}, ["rank", "share of the batch", "samples/s", "idle in the all-reduce"].map((x) => h("th", {}, x)))),
    h("tbody", {}, ids.map((r) => {
      const f = ranks[r];
      return h("tr", { "data-rank": r }, h("td", {}, r),
        h("td", {}, h("div", { class: "bar" }, h("div", { style: `width:${100 * (f.share || 0) / total}%` })),
          h("span", { "data-share": f.share ?? "" }, `${num(f.share)} (${pct((f.share || 0) / total)})`)),
        h("td", {}, h("div", { class: "bar" }, h("div", { style: `width:${100 * (f.measured_samples_per_s || 0) / speed}%` })),
          `${num(f.measured_samples_per_s)} (${pct((f.measured_samples_per_s || 0) / speed)})`),
        h("td", { "data-idle": f.idle_fraction ?? "" }, pct(f.idle_fraction)));
    }))));
}

function pipelinePlan(plan) {
  const slowest = Math.max(...plan.stages.map((s) => s.time_s));
  return h("div", { id: "pipeline-plan" },
    h("p", {}, `${plan.stages.length} stages, ${plan.num_blocks} blocks, ${plan.microbatches} micro-batches, schedule ${plan.schedule}; ` +
      `bottleneck ${num(plan.bottleneck_s * 1000)} ms (equal split: ${num(plan.equal_split_bottleneck_s * 1000)} ms)`),
    h("table", {}, h("thead", {}, h("tr", {}, ["stage", "device", "blocks", "time", "compute", "comm", "memory"].map((x) => h("th", {}, x)))),
      h("tbody", {}, plan.stages.map((s) => h("tr", {}, h("td", {}, s.stage), h("td", {}, s.device || ""), h("td", {}, `${s.blocks[0]}–${s.blocks[1] - 1}`),
        h("td", {}, h("div", { class: "bar" }, h("div", { style: `width:${100 * s.time_s / slowest}%` })), `${num(s.time_s * 1000)} ms`),
        h("td", {}, `${num(s.compute_s * 1000)} ms`), h("td", {}, `${num(s.comm_s * 1000)} ms`), h("td", {}, bytes(s.mem_bytes || 0)))))),
    (plan.notes || []).length ? h("ul", {}, plan.notes.map((n) => h("li", { class: "muted" }, n))) : "");
}

// The logs of one rank (or all), streaming; the search box filters what is shown.
class LogPanel {
  constructor(jobId) {
    this.jobId = jobId; this.lines = []; this.es = null; this.opens = 0;
    this.rank = h("select", { id: "log-rank", onchange: () => this.restart() }, h("option", { value: "" }, "all ranks"));
    this.search = h("input", { id: "log-search", type: "search", placeholder: "search the logs", oninput: () => this.redraw() });
    this.count = h("span", { class: "muted", id: "log-count" });
    this.box = h("div", { id: "logs", class: "logs", "data-opens": 0 });
    this.el = h("section", {}, h("div", { class: "filters" }, this.rank, this.search, this.count), this.box);
  }
  start(job) {
    const world = Math.max((job.placement || []).reduce((a, p) => a + p.workers, 0), job.spec.workers || 0,
      (job.spec.nodes || 0) * (job.spec.workers_per_node || 0));
    for (let r = 0; r < world; r++) this.rank.append(h("option", { value: r }, `rank ${r}`));
    this.restart();
  }
  restart() {
    if (this.es) this.es.close();
    this.lines = []; this.box.replaceChildren();
    const path = `/jobs/${this.jobId}/logs/stream` + (this.rank.value !== "" ? `?rank=${this.rank.value}` : "");
    this.es = stream(path, 0, { onRows: (_k, lines) => this.add(lines), onEnd: () => { this.box.dataset.ended = "1"; },
      onState: (s) => { this.box.dataset.stream = s; if (s === "open") this.box.dataset.opens = ++this.opens; } });
  }
  add(lines) {
    this.lines.push(...lines);
    if (this.lines.length > MAX_LINES) this.lines.splice(0, this.lines.length - MAX_LINES);
    const q = this.search.value.toLowerCase();
    const stick = this.box.scrollTop + this.box.clientHeight >= this.box.scrollHeight - 4;
    for (const l of lines) if (!q || l.text.toLowerCase().includes(q)) this.box.append(this.lineEl(l));
    while (this.box.children.length > MAX_SHOWN) this.box.firstChild.remove();
    if (stick) this.box.scrollTop = this.box.scrollHeight;
    this.counted();
  }
  lineEl(l) {
    return h("div", { class: "line" + (l.stream === "stderr" ? " err" : ""), "data-seq": l.seq, "data-rank": l.rank },
      h("span", { class: "rank" }, `[${l.rank}]`), " ", l.text);
  }
  redraw() {
    const q = this.search.value.toLowerCase();
    const shown = this.lines.filter((l) => !q || l.text.toLowerCase().includes(q)).slice(-MAX_SHOWN);
    this.box.replaceChildren(...shown.map((l) => this.lineEl(l)));
    this.counted();
  }
  counted() {
    const q = this.search.value;
    this.count.textContent = q ? `${this.box.children.length} matching of ${this.lines.length} lines` : `${this.lines.length} lines`;
  }
  close() { if (this.es) this.es.close(); }
}

// Live metric charts of one job: one uPlot per metric key, one line per rank where ranks differ.
// Loads the server's downsampled series, then appends the points of the metrics stream; a
// drag-zoomed range is fetched again at full resolution (double-click zooms back out).
import { api } from "./api.js";
import { h } from "./util.js";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
const POINTS = 1000;
const CHARTS_PER_FRAME = 8;
const HIDDEN = new Set(["total_steps"]);  // conventional keys that are not curves (the header shows progress)

class Line {
  constructor(x = [], y = []) { this.x = x; this.y = y; }
  add(step, value) {
    const n = this.x.length;
    if (n && step <= this.x[n - 1]) {  // a resumed attempt: its history replaces the tail
      let cut = n; while (cut > 0 && this.x[cut - 1] >= step) cut--;
      this.x.length = cut; this.y.length = cut;
    }
    this.x.push(step); this.y.push(value);
  }
  valueAt(step) {
    let lo = 0, hi = this.x.length - 1;
    while (lo <= hi) { const mid = (lo + hi) >> 1; if (this.x[mid] === step) return this.y[mid]; if (this.x[mid] < step) lo = mid + 1; else hi = mid - 1; }
    return undefined;
  }
}

class Chart {
  constructor(parent, jobId, key) {
    this.jobId = jobId; this.key = key;
    this.lines = new Map();       // rank -> Line
    this.differs = new Set();     // ranks drawn beside the lowest one
    this.el = h("div", { class: "chart", "data-key": key, "data-points": 0 });
    parent.append(this.el);
    this.plot = null; this.shown = []; this.zoomed = false; this.zoomSeq = 0;
  }
  base() { return Math.min(...[...this.lines].filter(([, l]) => l.x.length).map(([r]) => r)); }
  line(rank) { if (!this.lines.has(rank)) this.lines.set(rank, new Line()); return this.lines.get(rank); }
  add(rank, step, value) {
    this.line(rank).add(step, value);
    const base = this.base();
    if (rank !== base && !this.differs.has(rank) && this.lines.get(base)) {
      const other = this.lines.get(base).valueAt(step);
      if (other !== undefined && other !== value) this.differs.add(rank);
    }
  }
  data() {
    const ranks = [this.base(), ...[...this.differs].sort((a, b) => a - b)];
    const tables = ranks.map((r) => [this.lines.get(r).x, this.lines.get(r).y]);
    return { ranks, data: tables.length === 1 ? tables[0] : uPlot.join(tables) };
  }
  draw() {
    if (!isFinite(this.base())) return;
    const { ranks, data } = this.data();
    const base = this.lines.get(ranks[0]);
    this.el.dataset.points = base.x.length;
    this.el.dataset.lastStep = base.x.length ? base.x[base.x.length - 1] : "";
    if (this.zoomed) return;
    if (!this.plot || ranks.join() !== this.shown.join()) return this.create(ranks, data);
    this.plot.setData(data);
  }
  create(ranks, data) {
    if (this.plot) this.plot.destroy();
    this.shown = ranks;
    const width = Math.max(320, (this.parentWidth || 640) / 2 - 24);
    this.plot = new uPlot({
      title: this.key, width, height: 220, scales: { x: { time: false } }, axes: [{}, { size: 64 }],
      series: [{ label: "step" }, ...ranks.map((r, i) => ({ label: ranks.length > 1 ? `rank ${r}` : this.key,
        stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { show: false } }))],
      hooks: { setSelect: [(u) => this.zoom(u)] },
      cursor: { drag: { x: true, y: false } },
    }, data, this.el);
    this.plot.over.addEventListener("dblclick", () => { this.zoomed = false; this.draw(); this.plot.setData(this.data().data); });
  }
  async zoom(u) {
    if (u.select.width < 5) return;
    const start = u.posToVal(u.select.left, "x"), end = u.posToVal(u.select.left + u.select.width, "x");
    this.zoomed = true;
    const seq = ++this.zoomSeq;
    const page = await api(`/jobs/${this.jobId}/series?keys=${encodeURIComponent(this.key)}&points=${POINTS}` +
      `&start=${Math.floor(start)}&end=${Math.ceil(end)}`);
    if (seq !== this.zoomSeq || !this.zoomed) return;
    const tables = this.shown.map((r) => { const s = page.series.find((x) => x.rank === r); return s ? [s.x, s.y] : [[], []]; });
    u.setData(tables.length === 1 ? tables[0] : uPlot.join(tables), false);
    u.setScale("x", { min: start, max: end });
    this.el.dataset.zoomPoints = tables[0][0].length;
  }
}

export class MetricCharts {
  constructor(parent, jobId) {
    this.parent = parent; this.jobId = jobId;
    this.charts = new Map();  // key -> Chart
    this.after = 0;           // last metric row the charts include
    this.dirty = new Set(); this.frame = null;
  }
  chart(key) {
    if (HIDDEN.has(key)) return null;
    if (!this.charts.has(key)) this.charts.set(key, new Chart(this.parent, this.jobId, key));
    return this.charts.get(key);
  }
  // ``first``: the key of the first chart, asked for alone before all of them: the server reads
  // just that key of a job it has not cached yet, so a big job's first chart does not wait for
  // the whole history (server/series.py).
  async load(first) {
    if (first && !HIDDEN.has(first)) {
      this.take(await api(`/jobs/${this.jobId}/series?keys=${encodeURIComponent(first)}&points=${POINTS}`));
      this.schedule();
    }
    const page = await api(`/jobs/${this.jobId}/series?points=${POINTS}`);
    this.take(page);
    this.after = page.after;
    this.schedule();
    return page.after;
  }
  take(page) {
    for (const s of page.series) {
      const c = this.chart(s.key);
      if (!c) continue;
      c.lines.set(s.rank, new Line(s.x, s.y));
      if (s.rank !== Math.min(...page.series.filter((x) => x.key === s.key).map((x) => x.rank))) c.differs.add(s.rank);
      this.dirty.add(c);
    }
  }
  add(points) {
    const trace = window.__relayTrace;
    for (const p of points) {
      if (p.seq <= this.after) continue;
      this.after = p.seq;
      for (const [key, value] of Object.entries(p.values)) {
        const c = this.chart(key);
        if (!c) continue;
        c.add(p.rank, p.step, value);
        this.dirty.add(c);
      }
      if (trace) trace.pending.push(p);
    }
    this.schedule();
  }
  schedule() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = null;
      const width = this.parent.clientWidth;  // read once: a read per chart would force a layout each
      let drawn = 0;
      for (const c of this.dirty) {  // a few charts per frame: the first ones show before all are built
        if (drawn++ >= CHARTS_PER_FRAME) break;
        c.parentWidth = width; c.draw(); this.dirty.delete(c);
      }
      if (this.dirty.size) return this.schedule();
      const trace = window.__relayTrace;
      if (trace) { const t = Date.now() / 1000; for (const p of trace.pending) trace.drawn.push([p.step, p.rank, p.time, t]); trace.pending = []; }
    });
  }
  close() { for (const c of this.charts.values()) if (c.plot) c.plot.destroy(); }
}

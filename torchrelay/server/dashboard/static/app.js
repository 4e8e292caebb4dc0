// The dashboard: a router over the URL fragment and the cluster, queue and jobs pages.
// Each page is `render(main, args) -> cleanup`; the cleanup closes its streams and timers.
import { api, stream } from "./api.js";
import { h, duration, bytes, clock, now, stateBadge, progress, showError } from "./util.js";
import { renderJob } from "./job.js";

const STATES = ["QUEUED", "SCHEDULED", "RUNNING", "RESTARTING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED"];
let cleanup = null;

function route() {
  if (cleanup) { cleanup(); cleanup = null; }
  const main = document.getElementById("main");
  main.replaceChildren();
  const parts = (location.hash.replace(/^#\/?/, "").split("?")[0] || "jobs").split("/");
  const [page, arg] = [parts[0], decodeURIComponent(parts.slice(1).join("/"))];
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === page);
  const pages = { cluster: renderCluster, queue: renderQueue, jobs: arg ? renderJob : renderJobs };
  document.body.dataset.page = arg ? "job" : page;
  cleanup = (pages[page] || renderJobs)(main, arg);
}

// Refresh `load` now, every `everyMs`, and soon after any cluster event; returns the cleanup.
function live(load, everyMs = 3000) {
  let timer = null, pending = null;
  const run = () => load().catch((e) => showError(e));
  run();
  timer = setInterval(run, everyMs);
  const es = stream("/events/stream?tail=0", 0, { onRows: () => { clearTimeout(pending); pending = setTimeout(run, 200); } });
  return () => { clearInterval(timer); clearTimeout(pending); es.close(); };
}

function table(headers, rows, attrs = {}) {
  return h("table", attrs, h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))), h("tbody", {}, rows));
}

function usage(used, total, fmt = (x) => x) {
  const frac = total ? Math.min(1, used / total) : 0;
  return h("div", { class: "usage", title: `${fmt(used)} used of ${fmt(total)}` },
    h("div", { class: "bar" }, h("div", { style: `width:${(frac * 100).toFixed(1)}%` })),
    h("span", {}, `${fmt(total - used)} free / ${fmt(total)}`));
}

function renderCluster(main) {
  const nodes = h("div", { id: "nodes" });
  const events = h("ol", { id: "cluster-events", class: "events" });
  main.append(h("h1", {}, "Cluster"), nodes, h("h2", {}, "Events"), events);
  const stop = live(async () => {
    const list = await api("/nodes");
    nodes.replaceChildren(table(["node", "state", "cpus", "gpus", "memory", "labels", "launches", "last seen"],
      list.map((n) => h("tr", { "data-node": n.name },
        h("td", {}, n.name, h("div", { class: "muted" }, n.address)), h("td", {}, stateBadge(n.state)),
        h("td", {}, usage(n.used_cpus, n.cpus)), h("td", {}, n.gpus ? usage(n.used_gpus, n.gpus) : "none",
          n.gpu_type ? h("div", { class: "muted" }, n.gpu_type) : null),
        h("td", {}, usage(n.used_memory, n.memory, bytes)),
        h("td", {}, Object.entries(n.labels || {}).map(([k, v]) => h("span", { class: "label" }, `${k}=${v}`))),
        h("td", {}, n.launches.length), h("td", {}, duration(now() - n.last_seen) + " ago")))));
  }, 2000);
  const es = stream("/events/stream?tail=200", 0, { onRows: (_k, rows) => {
    for (const e of rows) {
      events.prepend(h("li", {}, h("span", { class: "muted" }, clock(e.time)), " ",
        h("a", { href: `#/jobs/${e.job_id}` }, e.job_id), ` ${e.job_name} `, stateBadge(e.state), " ", e.message));
    }
    while (events.children.length > 200) events.lastChild.remove();
  } });
  return () => { stop(); es.close(); };
}

function renderQueue(main) {
  const box = h("div", { id: "queue" });
  main.append(h("h1", {}, "Queue"), h("p", { class: "muted" }, "Waiting jobs in the order the scheduler considers them."), box);
  return live(async () => {
    const rows = await api("/queue");
    box.replaceChildren(rows.length ? table(["#", "job", "user", "workers", "priority", "waiting", "why", "estimated start"],
      rows.map((q) => h("tr", { "data-job": q.id }, h("td", {}, q.position), h("td", {}, h("a", { href: `#/jobs/${q.id}` }, q.id), " ", q.name),
        h("td", {}, q.user || ""), h("td", {}, q.workers), h("td", {}, q.priority), h("td", {}, duration(now() - q.submitted_at)),
        h("td", {}, q.reason), h("td", {}, q.estimated_start ? clock(q.estimated_start) + ` (in ${duration(q.estimated_start - now())})` : "unknown"))))
      : h("p", {}, "No job is waiting."));
  }, 2000);
}

function renderJobs(main) {
  const state = h("select", { id: "filter-state" }, h("option", { value: "" }, "any state"), STATES.map((s) => h("option", { value: s }, s)));
  const user = h("input", { id: "filter-user", placeholder: "user" });
  const text = h("input", { id: "filter-text", placeholder: "id or name" });
  const box = h("div", { id: "jobs" });
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  state.value = params.get("state") || "";
  main.append(h("h1", {}, "Jobs"), h("div", { class: "filters" }, state, user, text), box);
  let jobs = [];
  const draw = () => {
    const u = user.value.trim(), t = text.value.trim().toLowerCase();
    const shown = jobs.filter((j) => (!u || j.user === u) && (!t || j.id.includes(t) || j.name.toLowerCase().includes(t)));
    box.replaceChildren(table(["job", "name", "user", "state", "progress", "ETA", "restarts", "age"], shown.map((j) => {
      const p = progress(j);
      return h("tr", { "data-job": j.id }, h("td", {}, h("a", { href: `#/jobs/${j.id}` }, j.id)), h("td", {}, j.name), h("td", {}, j.user || ""),
        h("td", {}, stateBadge(j.state), j.waiting_reason ? h("div", { class: "muted" }, j.waiting_reason) : null),
        h("td", {}, p.fraction !== null && p.fraction !== undefined ? h("progress", { max: 1, value: p.fraction }) : null, " ", p.text),
        h("td", {}, p.eta), h("td", {}, j.restarts), h("td", {}, duration(now() - j.submitted_at)));
    }), { class: "jobs" }));
  };
  for (const el of [user, text]) el.addEventListener("input", draw);
  const stop = live(async () => { jobs = await api("/jobs?limit=500" + (state.value ? "&state=" + state.value : "")); draw(); });
  state.addEventListener("change", () => { location.hash = "#/jobs" + (state.value ? "?state=" + state.value : ""); });
  return stop;
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", route);

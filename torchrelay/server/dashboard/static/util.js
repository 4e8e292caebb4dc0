// Small helpers shared by the pages: element building, formatting.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== undefined && c !== null) el.append(c instanceof Node ? c : String(c));
  return el;
}

export function duration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}

export function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

export const now = () => Date.now() / 1000;
export const clock = (t) => t ? new Date(t * 1000).toLocaleTimeString() : "";
export const stateBadge = (state) => h("span", { class: "state s-" + state.toLowerCase() }, state);

export function num(v, digits = 4) {
  if (v === null || v === undefined) return "";
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1e4 ? v.toLocaleString(undefined, { maximumFractionDigits: 0 }) : Number(v.toPrecision(digits)).toString();
}

// Progress and ETA of a job from its last metrics (`step`, `total_steps`) and its start.
export function progress(job) {
  const m = job.last_metrics || {};
  if (m.step === undefined) return { text: "", eta: "" };
  const total = m.total_steps;
  const text = total ? `${m.step}/${total}` : `step ${m.step}`;
  let eta = "";
  if (total && job.started_at && m.step > 0 && !["SUCCEEDED", "FAILED", "CANCELLED"].includes(job.state)) {
    const rate = m.step / Math.max(1e-3, (m.time || now()) - job.started_at);
    eta = duration((total - m.step) / rate);
  }
  return { text, eta, fraction: total ? m.step / total : null };
}

export function showError(e) {
  const s = document.getElementById("status");
  s.textContent = e ? String(e.message || e) : "";
  s.className = e ? "error" : "muted";
}

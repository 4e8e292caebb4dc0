// The one place the pages talk to the server. Every read, every action and every stream goes
// through `api` or `stream`, so credentials (a token header, or the session cookie, which
// fetch and EventSource send same-origin) are added here and nowhere else.
export const API = "/api/v1";

export class ApiError extends Error {
  constructor(status, name, detail) { super(detail); this.status = status; this.name = name; }
}

export async function api(path, { method = "GET", body, raw = false } = {}) {
  const init = { method, credentials: "same-origin", headers: {} };
  if (body !== undefined) { init.body = JSON.stringify(body); init.headers["content-type"] = "application/json"; }
  const resp = await fetch(API + path, init);
  if (!resp.ok) {
    let name = "HTTP" + resp.status, detail = resp.statusText;
    try { const b = await resp.json(); name = b.error || name; detail = b.detail || detail; } catch (_) { /* not JSON */ }
    throw new ApiError(resp.status, name, detail);
  }
  return raw ? resp : resp.json();
}

export function url(path) { return API + path; }

// Follow a server-sent event stream from row `after`. The browser reconnects by itself after
// a drop, sending Last-Event-ID (the id of the last message), so nothing is missed or repeated.
// `onRows(kind, rows, id)` gets each message's rows; `onEnd(state)` the end of a job's stream.
export function stream(path, after, { onRows, onEnd, onState } = {}) {
  const sep = path.includes("?") ? "&" : "?";
  const es = new EventSource(API + path + sep + "after=" + after, { withCredentials: true });
  for (const kind of ["logs", "metrics", "events"]) {
    es.addEventListener(kind, (ev) => onRows && onRows(kind, JSON.parse(ev.data), Number(ev.lastEventId)));
  }
  es.addEventListener("end", (ev) => { es.close(); onEnd && onEnd(JSON.parse(ev.data)); });
  es.onopen = () => onState && onState("open");
  es.onerror = () => onState && onState(es.readyState === EventSource.CLOSED ? "closed" : "reconnecting");
  return es;
}

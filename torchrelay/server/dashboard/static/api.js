// The one place the pages talk to the server. Every read, every action and every stream goes
// through `api` or `stream`, so credentials (a token header, or the session cookie, which
// fetch and EventSource send same-origin) are added here and nowhere else.
export const API = "/api/v1";

export class ApiError extends Error {
  constructor(status, name, detail) { super(detail); this.status = status; this.name = name; }
}

// Signing in: the page opened as `/?token=T` (or the form shown at a 401) hands the token to
// POST /session, which answers with an HttpOnly, SameSite=Strict session cookie (an EventSource
// cannot send a header); the token then leaves the URL and is kept by no script.
export async function signIn(token) {
  const resp = await fetch(API + "/session", { method: "POST", credentials: "same-origin",
                                               headers: { authorization: "Bearer " + token.trim() } });
  if (!resp.ok) throw new ApiError(resp.status, "Unauthenticated", "that token is not accepted (HTTP " + resp.status + ")");
}

const query = new URLSearchParams(location.search);
const ready = query.has("token")
  ? signIn(query.get("token")).catch(() => {}).finally(() => {
      query.delete("token");
      history.replaceState(null, "", location.pathname + (query.toString() ? "?" + query : "") + location.hash);
    })
  : Promise.resolve();

function askForToken() {
  if (document.getElementById("signin")) return;
  const input = Object.assign(document.createElement("input"), { type: "password", placeholder: "token (relay token create)", id: "signin-token" });
  const form = document.createElement("form");
  form.id = "signin";
  form.append("Sign in with a torchrelay token: ", input, Object.assign(document.createElement("button"), { textContent: "Sign in" }));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try { await signIn(input.value); location.reload(); } catch (e) { input.value = ""; input.placeholder = e.message; }
  });
  document.body.prepend(form);
}

export async function api(path, { method = "GET", body, raw = false } = {}) {
  await ready;
  const init = { method, credentials: "same-origin", headers: {} };
  if (body !== undefined) { init.body = JSON.stringify(body); init.headers["content-type"] = "application/json"; }
  const resp = await fetch(API + path, init);
  if (resp.status === 401) askForToken();
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
export function stream(path, after, handlers = {}) {
  let es = null, closed = false;
  ready.then(() => { if (!closed) es = openStream(path, after, handlers); });
  return { close() { closed = true; if (es) es.close(); } };
}

function openStream(path, after, { onRows, onEnd, onState } = {}) {
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

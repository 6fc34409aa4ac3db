// Potluck's web page: a chat with the pool and a live dashboard of its nodes.
//
// Talks only to the server that served it (same origin): GET /v1/models for the model id,
// POST /v1/chat/completions with "stream": true (SSE, read through fetch so it can carry the
// API key and be aborted), GET /api/pool every second for the dashboard. Settings and
// conversations live in this browser's localStorage. Model text reaches the DOM only through
// renderMarkdown (escapes first) or textContent.

import { renderMarkdown } from "./markdown.js";
import { sseEvents } from "./sse.js";

const KEYS = { settings: "potluck.settings", conversations: "potluck.conversations", current: "potluck.current" };
const DEFAULTS = { temperature: 0.7, max_tokens: 512, system: "", api_key: "" };
const POLL_MS = 1000; // dashboard refresh while the page is visible
const POLL_HIDDEN_MS = 5000; // ... and while it is in the background (phones' batteries)
const POLL_TIMEOUT_MS = 4000; // a /api/pool call slower than this counts as "unreachable"
const MODELS_TIMEOUT_MS = 10000;
const SPARK_POINTS = 60; // one minute of pool tokens/s
const MAX_CONVERSATIONS = 50; // oldest are dropped beyond this (localStorage holds ~5 MB)

const $ = (id) => document.getElementById(id);

// ---- storage (localStorage throws in some private modes and when full: the page still works) ----

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw == null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function store(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

let settings = { ...DEFAULTS, ...load(KEYS.settings, {}) };
let conversations = load(KEYS.conversations, []); // [{id, title, updated, messages: [{role, content, state, stats}]}]
if (!Array.isArray(conversations)) conversations = [];
let currentId = load(KEYS.current, null);
let modelId = null;
let nLayerOfModel = 0;
let streaming = null; // {controller} while an answer is being received

function persist() {
  conversations.sort((a, b) => b.updated - a.updated);
  conversations = conversations.slice(0, MAX_CONVERSATIONS);
  if (!store(KEYS.conversations, conversations)) {
    // Full: drop the oldest conversations until it fits (keep at least the current one).
    while (conversations.length > 1 && !store(KEYS.conversations, conversations)) conversations.pop();
  }
  store(KEYS.current, currentId);
  renderHistory();
}

function authHeaders() {
  return settings.api_key ? { Authorization: `Bearer ${settings.api_key}` } : {};
}

// ---- errors: the server's OpenAI-shaped {"error": {...}} → one clear sentence ----

class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function apiError(res) {
  let message = `HTTP ${res.status} ${res.statusText}`.trim();
  let code = null;
  try {
    const body = await res.json();
    if (body?.error?.message) {
      message = body.error.message;
      code = body.error.code ?? null;
    } else if (typeof body?.detail === "string") {
      message = body.detail;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(res.status, message, code);
}

function explain(err) {
  if (err instanceof ApiError) {
    if (err.status === 401 || err.status === 403) {
      const which = settings.api_key ? "The API key saved in Settings was rejected" : "This server needs an API key";
      return `${which} (HTTP ${err.status}: ${err.message}). Enter the key given to potluck serve --api-key in Settings → API key.`;
    }
    if (err.status === 429) return `The pool is busy (HTTP 429: ${err.message}). Try again in a moment.`;
    if (err.status === 0) return err.message;
    return `The server answered HTTP ${err.status}: ${err.message}`;
  }
  return `Cannot reach the Potluck server at ${location.host} (${err.message}). Is potluck serve still running?`;
}

async function fetchJson(url, timeoutMs) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), timeoutMs);
  try {
    const res = await fetch(url, { headers: authHeaders(), signal: controller.signal, cache: "no-store" });
    if (!res.ok) throw await apiError(res);
    return await res.json();
  } catch (err) {
    if (controller.signal.aborted) throw new ApiError(0, `${url} did not answer within ${timeoutMs / 1000} s`);
    throw err;
  } finally {
    clearTimeout(timer);
  }
}

// ---- banner ----

function showBanner(text, action = null) {
  $("banner-text").textContent = text;
  const button = $("banner-action");
  button.hidden = !action;
  if (action) {
    button.textContent = action.label;
    button.onclick = () => {
      hideBanner();
      action.run();
    };
  }
  $("banner").hidden = false;
}

function hideBanner() {
  $("banner").hidden = true;
}

function bannerFor(err, retry = null) {
  const auth = err instanceof ApiError && (err.status === 401 || err.status === 403);
  showBanner(explain(err), auth ? { label: "Open settings", run: openSettings } : retry && { label: "Retry", run: retry });
}

// ---- the model ----

async function fetchModel() {
  const body = await fetchJson("/v1/models", MODELS_TIMEOUT_MS);
  const id = body?.data?.[0]?.id;
  if (!id) throw new ApiError(0, "The server lists no model at /v1/models.");
  modelId = id;
  $("model-pill").textContent = id;
  $("model-pill").dataset.state = "ok";
  return id;
}

function modelFailed(err) {
  const auth = err instanceof ApiError && (err.status === 401 || err.status === 403);
  $("model-pill").textContent = auth ? "API key needed" : "offline";
  $("model-pill").dataset.state = "error";
  bannerFor(err, () => fetchModel().catch(modelFailed));
}

// ---- conversations ----

function currentConversation() {
  return conversations.find((c) => c.id === currentId) ?? null;
}

function newConversation() {
  const conv = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "", updated: Date.now(), messages: [] };
  conversations.unshift(conv);
  currentId = conv.id;
  return conv;
}

function startNewChat() {
  stopStreaming();
  currentId = null;
  store(KEYS.current, null);
  renderConversation();
  renderHistory();
  hideBanner();
  $("prompt").focus();
}

function openConversation(id) {
  stopStreaming();
  currentId = id;
  store(KEYS.current, id);
  renderConversation();
  renderHistory();
  closeHistory();
}

function deleteConversation(id) {
  if (currentId === id) {
    stopStreaming();
    currentId = null;
  }
  conversations = conversations.filter((c) => c.id !== id);
  persist();
  renderConversation();
}

// What the model sees: the system prompt, then the turns so far. A question whose answer failed
// (no key, server down) is left out with its answer: the user asks it again.
function contextFor(conv, reply) {
  const before = conv.messages.slice(0, conv.messages.indexOf(reply));
  const failed = (m) => m?.role === "assistant" && m.state === "error";
  const turns = before
    .filter((m, i) => m.content && !failed(m) && !(m.role === "user" && failed(before[i + 1])))
    .map((m) => ({ role: m.role, content: m.content }));
  return settings.system.trim() ? [{ role: "system", content: settings.system }, ...turns] : turns;
}

// ---- messages in the DOM ----

function messageView(msg) {
  const el = document.createElement("article");
  el.className = `msg ${msg.role}`;
  const body = document.createElement("div");
  body.className = "msg-body";
  const meta = document.createElement("div");
  meta.className = "msg-meta";
  el.append(body, meta);
  let frame = 0;
  let chunks = 0;

  const paint = () => {
    frame = 0;
    if (msg.role === "user") {
      body.textContent = msg.content;
    } else {
      body.innerHTML = renderMarkdown(msg.content); // safe: renderMarkdown escapes all model text
      if (msg.state === "streaming") body.insertAdjacentHTML("beforeend", '<span class="caret" aria-hidden="true"></span>');
    }
    el.dataset.state = msg.state ?? "done";
    el.dataset.chunks = String(chunks);
    meta.replaceChildren(...metaParts(msg));
  };

  const view = {
    el,
    // A new piece of the answer arrived: repaint at most once per animation frame.
    update() {
      chunks++;
      const stuck = isScrolledDown();
      if (!frame) {
        frame = requestAnimationFrame(() => {
          paint();
          if (stuck) scrollDown();
        });
      }
    },
    finish() {
      if (frame) cancelAnimationFrame(frame);
      const stuck = isScrolledDown();
      paint();
      if (stuck) scrollDown();
    },
  };
  paint();
  return view;
}

function metaParts(msg) {
  const parts = [];
  const add = (text, cls = "") => {
    const span = document.createElement("span");
    span.textContent = text;
    if (cls) span.className = cls;
    parts.push(span);
  };
  if (msg.role !== "assistant") return parts;
  if (msg.state === "streaming") add("answering…", "pending");
  if (msg.state === "stopped") add("stopped", "stopped");
  if (msg.state === "error") add(msg.error ?? "failed", "error");
  const s = msg.stats;
  if (s) {
    if (s.tokens != null) add(`${s.tokens} tokens`);
    if (s.tokens_per_s != null) add(`${s.tokens_per_s.toFixed(1)} tok/s`);
    if (s.first_token_s != null) add(`first token ${s.first_token_s.toFixed(2)} s`);
    if (s.finish_reason === "length") add("cut at max tokens", "stopped");
  }
  if (msg.content && msg.state !== "streaming") {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "link-btn";
    copy.textContent = "copy";
    copy.onclick = () => copyText(msg.content).then((ok) => (copy.textContent = ok ? "copied" : "copy failed"));
    parts.push(copy);
  }
  return parts;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text); // only on https / localhost
    return true;
  } catch {
    const area = document.createElement("textarea"); // plain-http LAN pages: the old way
    area.value = text;
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

function isScrolledDown() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 48;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function renderConversation() {
  const box = $("messages");
  box.querySelectorAll(".msg").forEach((el) => el.remove());
  const conv = currentConversation();
  $("empty").hidden = Boolean(conv?.messages.length);
  for (const msg of conv?.messages ?? []) box.append(messageView(msg).el);
  scrollDown();
}

function renderHistory() {
  const list = $("history-list");
  list.replaceChildren();
  for (const conv of conversations) {
    const li = document.createElement("li");
    li.className = conv.id === currentId ? "current" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "history-open";
    const title = document.createElement("span");
    title.textContent = conv.title || "(empty)";
    const when = document.createElement("small");
    when.textContent = new Date(conv.updated).toLocaleString();
    open.append(title, when);
    open.onclick = () => openConversation(conv.id);
    const del = document.createElement("button");
    del.type = "button";
    del.className = "icon-btn small";
    del.title = "Delete this conversation";
    del.textContent = "×";
    del.onclick = () => deleteConversation(conv.id);
    li.append(open, del);
    list.append(li);
  }
  if (!conversations.length) {
    const li = document.createElement("li");
    li.className = "history-empty";
    li.textContent = "No conversations yet.";
    list.append(li);
  }
  $("clear-history").hidden = !conversations.length;
}

// ---- sending and streaming ----

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

function stopStreaming() {
  streaming?.controller.abort();
}

async function send(text) {
  if (streaming || !text.trim()) return;
  hideBanner();
  const conv = currentConversation() ?? newConversation();
  if (!conv.title) conv.title = text.trim().slice(0, 80);
  const question = { role: "user", content: text };
  const reply = { role: "assistant", content: "", state: "streaming" };
  conv.messages.push(question, reply);
  conv.updated = Date.now();
  $("empty").hidden = true;
  $("messages").append(messageView(question).el);
  const view = messageView(reply);
  $("messages").append(view.el);
  scrollDown();
  persist();

  const controller = new AbortController();
  streaming = { controller };
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null;
  let pieces = 0;
  let usage = null;
  let finish = null;
  try {
    if (!modelId) await fetchModel();
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
      body: JSON.stringify({
        model: modelId,
        messages: contextFor(conv, reply),
        stream: true,
        stream_options: { include_usage: true },
        temperature: settings.temperature,
        max_tokens: settings.max_tokens,
      }),
      signal: controller.signal,
    });
    if (!res.ok) throw await apiError(res);
    let complete = false;
    for await (const event of sseEvents(res.body)) {
      if (event.data === "[DONE]") {
        complete = true;
        break;
      }
      let chunk;
      try {
        chunk = JSON.parse(event.data);
      } catch {
        throw new ApiError(0, `The server sent an event that is not JSON: ${event.data.slice(0, 120)}`);
      }
      // An error after the stream started comes as an event (OpenAI's shape, no HTTP status).
      if (chunk.error) throw new ApiError(0, `The answer stopped with an error: ${chunk.error.message ?? "unknown"}`, chunk.error.code);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta?.content;
      if (delta) {
        tFirst ??= performance.now();
        pieces++;
        reply.content += delta;
        view.update();
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (!complete && !finish) throw new ApiError(0, "The connection to the server closed before the answer was complete.");
    reply.state = "done";
  } catch (err) {
    if (controller.signal.aborted) {
      reply.state = "stopped";
    } else {
      reply.state = "error";
      reply.error = explain(err);
      if (err instanceof ApiError && err.status === 404) modelId = null; // the server may have changed model: ask again
      bannerFor(err, () => retry(conv, question, reply));
    }
  } finally {
    const t1 = performance.now();
    const tokens = usage?.completion_tokens ?? (pieces || null);
    reply.stats = {
      tokens,
      tokens_per_s: tFirst != null && tokens > 1 && t1 > tFirst ? ((tokens - 1) * 1000) / (t1 - tFirst) : null,
      first_token_s: tFirst != null ? (tFirst - t0) / 1000 : null,
      finish_reason: finish,
    };
    conv.updated = Date.now();
    streaming = null;
    setBusy(false);
    view.finish();
    persist();
  }
}

function retry(conv, question, reply) {
  conv.messages = conv.messages.filter((m) => m !== question && m !== reply);
  if (currentId === conv.id) renderConversation();
  send(question.content);
}

// ---- the pool dashboard ----

const nodeViews = new Map(); // "name|address" → <li>
const rates = [];
let pollTimer = 0;
let polling = false;

function fmtRate(v) {
  if (v == null || !Number.isFinite(v)) return "—";
  return v >= 100 ? v.toFixed(0) : v.toFixed(1);
}

function fmtMs(v) {
  if (v == null || !Number.isFinite(v)) return "—";
  return `${v >= 100 ? v.toFixed(0) : v.toFixed(1)} ms`;
}

function fmtBytes(n) {
  if (!Number.isFinite(n)) return "?";
  return n >= 2 ** 30 ? `${(n / 2 ** 30).toFixed(1)} GiB` : `${Math.round(n / 2 ** 20)} MiB`;
}

// The prefix cache's bytes: as fmtBytes, with a decimal under 10 MiB (a small model's prefixes)
function fmtHeld(n) {
  if (!Number.isFinite(n) || n >= 10 * 2 ** 20) return fmtBytes(n);
  return `${n > 0 ? (n / 2 ** 20).toFixed(1) : 0} MiB`;
}

async function pollPool() {
  if (polling) return;
  polling = true;
  clearTimeout(pollTimer);
  try {
    renderPool(await fetchJson("/api/pool", POLL_TIMEOUT_MS));
    setPoolStatus("live", "live");
  } catch (err) {
    const auth = err instanceof ApiError && (err.status === 401 || err.status === 403);
    setPoolStatus(auth ? "auth" : "down", auth ? "needs API key" : "unreachable, retrying");
    $("pool-note").hidden = false;
    $("pool-note").textContent = auth ? "Enter the API key in Settings to see the pool." : explain(err);
  } finally {
    polling = false;
    pollTimer = setTimeout(pollPool, document.hidden ? POLL_HIDDEN_MS : POLL_MS);
  }
}

function setPoolStatus(state, text) {
  const el = $("pool-status");
  el.dataset.state = state;
  el.textContent = text;
}

// 30_532_122_624 -> "30.5B" (a model's parameters)
function fmtCount(n) {
  if (!(n > 0)) return "—";
  for (const [unit, size] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]]) {
    if (n >= size) return `${Number((n / size).toPrecision(3))}${unit}`;
  }
  return String(n);
}

function renderPool(pool) {
  if (!pool || !Array.isArray(pool.nodes)) throw new ApiError(0, "/api/pool answered without a list of nodes.");
  $("pool-note").hidden = true;
  const m = pool.model ?? {};
  nLayerOfModel = m.n_layer ?? 0;
  const experts = m.n_expert > 0 && `${fmtCount(m.active_parameters)} of ${fmtCount(m.parameters)} parameters active: ${m.n_expert_used} of ${m.n_expert} experts per token`;
  $("pool-model").textContent = [m.name, m.arch, m.quant, m.n_layer != null && `${m.n_layer} layers`, experts, m.n_ctx != null && `context ${m.n_ctx}`]
    .filter(Boolean)
    .join(" · ");
  if (m.n_ctx) $("max-tokens").max = String(m.n_ctx);

  $("pool-rate").textContent = fmtRate(pool.tokens_per_s);
  $("tab-rate").textContent = pool.tokens_per_s > 0 ? fmtRate(pool.tokens_per_s) : "";
  $("pool-active").textContent = String(pool.requests_active ?? "—");
  $("pool-queued").textContent = String(pool.requests_queued ?? "—");
  $("pool-total").textContent = String(pool.requests_total ?? "—");
  renderPrefixCache(pool.prefix_cache ?? {});
  rates.push(Number(pool.tokens_per_s) || 0);
  if (rates.length > SPARK_POINTS) rates.shift();
  drawSpark();

  // The node that costs the most per token (compute + its hop) is the pool's bottleneck.
  const cost = (n) => (n.compute_ms ?? 0) + (n.hop_ms ?? 0);
  const worst = pool.nodes.length > 1 ? pool.nodes.reduce((a, b) => (cost(b) > cost(a) ? b : a)) : null;

  const seen = new Set();
  const list = $("nodes");
  pool.nodes.forEach((node, index) => {
    const key = `${node.name}|${node.address}`;
    seen.add(key);
    let li = nodeViews.get(key);
    if (!li) {
      li = $("node-template").content.firstElementChild.cloneNode(true);
      nodeViews.set(key, li);
    }
    fillNode(li, node, node === worst && cost(node) > 0);
    if (list.children[index] !== li) list.insertBefore(li, list.children[index] ?? null);
  });
  for (const [key, li] of nodeViews) {
    if (!seen.has(key)) {
      li.remove();
      nodeViews.delete(key);
    }
  }
  renderBatches(Array.isArray(pool.batches) ? pool.batches : []);
}

// The prefix cache: the share of requests that reused a cached prompt prefix (and how many), the
// prompt tokens they did not compute, and what it holds (KV bytes, finished sequences).
function renderPrefixCache(c) {
  const looked = (c.hits ?? 0) + (c.misses ?? 0);
  $("pool-cache-rate").textContent = looked > 0 ? `${Math.round((100 * c.hits) / looked)}%` : "—";
  $("pool-cache-hits").textContent = looked > 0 ? `${c.hits} of ${looked} requests` : "";
  const tokens = c.cached_tokens;
  $("pool-cache-tokens").textContent = tokens == null ? "—" : tokens >= 10_000 ? fmtCount(tokens) : String(tokens);
  $("pool-cache-bytes").textContent = c.bytes == null ? "—" : fmtHeld(c.bytes);
  $("pool-cache-entries").textContent = c.entries == null ? "" : `${c.entries} sequence${c.entries === 1 ? "" : "s"}`;
}

// Batch jobs (the Batches API): one line each, with a bar of the requests done.
function renderBatches(batches) {
  const list = $("batches");
  list.replaceChildren(
    ...batches.map((b) => {
      const li = document.createElement("li");
      li.className = "batch";
      li.dataset.status = String(b.status);
      const done = (b.completed ?? 0) + (b.failed ?? 0);
      const pct = b.total > 0 ? Math.min(100, (100 * done) / b.total) : 0;
      const label = document.createElement("span");
      label.className = "batch-label";
      const failed = b.failed ? `, ${b.failed} failed` : "";
      label.textContent = `batch ${String(b.id).slice(-8)} · ${b.status} · ${b.completed ?? 0}/${b.total ?? 0}${failed}`;
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.setAttribute("role", "progressbar");
      bar.setAttribute("aria-valuenow", pct.toFixed(0));
      const fill = document.createElement("div");
      fill.className = "bar-fill";
      fill.style.width = `${pct}%`;
      bar.append(fill);
      li.append(label, bar);
      return li;
    }),
  );
}

function fillNode(li, node, slowest) {
  const q = (cls) => li.querySelector(cls);
  li.dataset.status = node.status ?? "unknown";
  li.dataset.name = node.name;
  q(".node-name").textContent = node.name;
  q(".node-device").textContent = String(node.device ?? "?").toUpperCase();
  q(".node-address").textContent = node.address === "local" ? "this machine (head)" : node.address;
  q(".node-slowest").hidden = !slowest;
  q(".node-status").hidden = node.status === "ok";
  q(".node-status").textContent = String(node.status ?? "unknown");

  const [start, stop] = Array.isArray(node.layers) ? node.layers : [0, 0];
  const total = nLayerOfModel || stop || 1;
  li.dataset.layers = `${start},${stop}`;
  q(".node-layers").textContent = stop > start ? `${start}–${stop - 1} (${stop - start}/${total})` : "none";
  const span = q(".layer-span");
  span.style.left = `${(100 * start) / total}%`;
  span.style.width = `${(100 * (stop - start)) / total}%`;

  const used = node.memory_used_bytes;
  const cap = node.memory_total_bytes;
  const pct = cap > 0 ? Math.min(100, (100 * used) / cap) : 0;
  const bar = q(".bar");
  bar.setAttribute("aria-valuenow", pct.toFixed(0));
  bar.dataset.level = pct >= 90 ? "high" : pct >= 70 ? "mid" : "low";
  q(".bar-fill").style.width = used > 0 ? `max(2px, ${pct}%)` : "0"; // a sliver stays visible
  q(".node-memory").textContent = `${fmtBytes(used)} / ${fmtBytes(cap)}`;

  q(".node-rate").textContent = fmtRate(node.tokens_per_s);
  q(".node-compute").textContent = fmtMs(node.compute_ms);
  q(".node-hop").textContent = node.address === "local" && node.hop_ms == null ? "—" : fmtMs(node.hop_ms);
}

function drawSpark() {
  const max = Math.max(1, ...rates);
  const step = 120 / (SPARK_POINTS - 1);
  const offset = SPARK_POINTS - rates.length;
  const points = rates.map((v, i) => `${((offset + i) * step).toFixed(1)},${(30 - (28 * v) / max).toFixed(1)}`);
  $("spark-line").setAttribute("points", points.join(" "));
}

// ---- settings ----

function openSettings() {
  $("temperature").value = String(settings.temperature);
  $("temperature-out").textContent = Number(settings.temperature).toFixed(2);
  $("max-tokens").value = String(settings.max_tokens);
  $("system-prompt").value = settings.system;
  $("api-key").value = settings.api_key;
  $("api-key").type = "password";
  $("api-key-show").textContent = "Show";
  $("settings").showModal();
}

function saveSettings(event) {
  event.preventDefault();
  const form = $("settings-form");
  if (!form.reportValidity()) return;
  const keyChanged = $("api-key").value.trim() !== settings.api_key;
  settings = {
    temperature: Number($("temperature").value),
    max_tokens: Math.max(1, Math.floor(Number($("max-tokens").value))),
    system: $("system-prompt").value,
    api_key: $("api-key").value.trim(),
  };
  store(KEYS.settings, settings);
  $("settings").close();
  if (keyChanged) {
    hideBanner();
    modelId = null;
    fetchModel().catch(modelFailed);
    pollPool();
  }
}

// ---- wiring ----

function setView(view) {
  document.body.dataset.view = view;
  document.querySelectorAll(".tab").forEach((t) => t.setAttribute("aria-pressed", String(t.dataset.view === view)));
}

function openHistory() {
  $("history").hidden = false;
  $("scrim").hidden = false;
  $("history-btn").setAttribute("aria-expanded", "true");
}

function closeHistory() {
  $("history").hidden = true;
  $("scrim").hidden = true;
  $("history-btn").setAttribute("aria-expanded", "false");
}

function autosize() {
  const area = $("prompt");
  area.style.height = "auto";
  area.style.height = `${Math.min(area.scrollHeight, 200)}px`;
}

function init() {
  // An answer that was streaming when the page was closed ended there.
  for (const conv of conversations) for (const m of conv.messages) if (m.state === "streaming") m.state = "stopped";
  if (!currentConversation()) currentId = null;

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || streaming) return;
    $("prompt").value = "";
    autosize();
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    // Enter sends on a keyboard; on touch screens Enter is a new line and the button sends.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing && !matchMedia("(pointer: coarse)").matches) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("prompt").addEventListener("input", autosize);
  $("stop").addEventListener("click", stopStreaming);
  $("new-chat-btn").addEventListener("click", startNewChat);
  $("settings-btn").addEventListener("click", openSettings);
  $("settings-form").addEventListener("submit", saveSettings);
  $("settings-cancel").addEventListener("click", () => $("settings").close());
  $("temperature").addEventListener("input", () => ($("temperature-out").textContent = Number($("temperature").value).toFixed(2)));
  $("api-key-show").addEventListener("click", () => {
    const shown = $("api-key").type === "text";
    $("api-key").type = shown ? "password" : "text";
    $("api-key-show").textContent = shown ? "Show" : "Hide";
    $("api-key-show").setAttribute("aria-pressed", String(!shown));
  });
  $("banner-close").addEventListener("click", hideBanner);
  $("history-btn").addEventListener("click", () => ($("history").hidden ? openHistory() : closeHistory()));
  $("history-close").addEventListener("click", closeHistory);
  $("scrim").addEventListener("click", closeHistory);
  $("clear-history").addEventListener("click", () => {
    if (!confirm("Delete all conversations stored in this browser?")) return;
    stopStreaming();
    conversations = [];
    currentId = null;
    persist();
    renderConversation();
  });
  document.querySelectorAll(".tab").forEach((t) => t.addEventListener("click", () => setView(t.dataset.view)));
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && !$("history").hidden) closeHistory();
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) pollPool();
  });

  renderConversation();
  renderHistory();
  fetchModel().catch(modelFailed);
  pollPool();
  document.body.dataset.ready = "true";
}

init();

// Conversations and the API key, kept in the browser's localStorage; JSON export and import.

const CONVERSATIONS = "tandem.conversations.v1";
const CURRENT = "tandem.current";
const API_KEY = "tandem.apiKey";
const SETTING_KEYS = ["model", "system", "temperature", "top_p", "top_k", "max_tokens", "seed"];
export const DEFAULT_TITLE = "New chat";

export function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

export function newConversation(settings = {}) {
  const now = Date.now();
  return { id: newId(), title: DEFAULT_TITLE, created: now, updated: now, settings: { ...settings }, messages: [] };
}

function cleanStats(stats) {
  if (!stats || typeof stats !== "object") return undefined;
  const out = {};
  for (const [k, v] of Object.entries(stats)) if (typeof v === "number" && Number.isFinite(v)) out[k] = v;
  return out;
}

function cleanMessage(m) {
  if (!m || typeof m !== "object" || typeof m.content !== "string") return null;
  if (!["user", "assistant", "error"].includes(m.role)) return null;
  const out = { role: m.role, content: m.content };
  const stats = cleanStats(m.stats);
  if (stats) out.stats = stats;
  if (typeof m.finish_reason === "string") out.finish_reason = m.finish_reason;
  if (m.stopped === true || m.pending === true) out.stopped = true; // a reply cut off by a reload
  return out;
}

function cleanSettings(s) {
  const out = {};
  if (!s || typeof s !== "object") return out;
  for (const key of SETTING_KEYS) {
    const v = s[key];
    if (key === "model" || key === "system") {
      if (typeof v === "string" && v) out[key] = v;
    } else if (typeof v === "number" && Number.isFinite(v)) out[key] = v;
  }
  return out;
}

/** A conversation from untrusted JSON (storage or an imported file), or null. */
export function cleanConversation(c) {
  if (!c || typeof c !== "object" || !Array.isArray(c.messages)) return null;
  const now = Date.now();
  return {
    id: typeof c.id === "string" && c.id ? c.id.slice(0, 64) : newId(),
    title: typeof c.title === "string" && c.title.trim() ? c.title.slice(0, 200) : DEFAULT_TITLE,
    created: Number.isFinite(c.created) ? c.created : now,
    updated: Number.isFinite(c.updated) ? c.updated : now,
    settings: cleanSettings(c.settings),
    messages: c.messages.map(cleanMessage).filter(Boolean),
    ...(typeof c.draft === "string" && c.draft ? { draft: c.draft } : {}),
  };
}

export function loadConversations() {
  try {
    const data = JSON.parse(localStorage.getItem(CONVERSATIONS) || "[]");
    return Array.isArray(data) ? data.map(cleanConversation).filter(Boolean) : [];
  } catch {
    return [];
  }
}

/** Writes every conversation; returns an error message when storage refused (full). */
export function saveConversations(conversations) {
  try {
    localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations));
    return null;
  } catch (e) {
    return `Could not save conversations in this browser (${e.name}): export them to keep them.`;
  }
}

export function loadCurrentId() {
  return localStorage.getItem(CURRENT);
}

export function saveCurrentId(id) {
  localStorage.setItem(CURRENT, id);
}

export function getApiKey() {
  return localStorage.getItem(API_KEY) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(API_KEY, key);
  else localStorage.removeItem(API_KEY);
}

export function exportJson(conversations) {
  return JSON.stringify({ format: "tandem-conversations", version: 1, conversations }, null, 2);
}

/** Conversations parsed from an export (or a bare array of them); ids that clash get new ones. */
export function importJson(text, existingIds) {
  const data = JSON.parse(text);
  const list = Array.isArray(data) ? data : data?.conversations;
  if (!Array.isArray(list)) throw new Error("no 'conversations' list in this file");
  const taken = new Set(existingIds);
  const out = [];
  for (const raw of list) {
    const c = cleanConversation(raw);
    if (!c) continue;
    if (taken.has(c.id)) c.id = newId();
    taken.add(c.id);
    out.push(c);
  }
  if (!out.length) throw new Error("the file holds no valid conversation");
  return out;
}

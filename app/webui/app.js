// The chat page: sidebar of conversations, the message view, the composer and its streaming.

import { ApiError, listModels, streamChat } from "./api.js";
import { askKey, alertBar } from "./dialogs.js";
import { el } from "./dom.js";
import { renderMarkdown } from "./markdown.js";
import { messageNode } from "./messages.js";
import { renderConversationList } from "./sidebar.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const NUMERIC = ["temperature", "top_p", "top_k", "max_tokens", "seed"];

const state = {
  conversations: store.loadConversations(),
  currentId: store.loadCurrentId(),
  models: [],
  running: new Map(), // conversation id -> AbortController of its streaming reply
  notice: null, // a storage problem to show once
};

function current() {
  return state.conversations.find((c) => c.id === state.currentId);
}

function persist() {
  const problem = store.saveConversations(state.conversations);
  if (problem && problem !== state.notice) {
    state.notice = problem;
    alertBar(problem);
  }
}

// ---- sidebar ------------------------------------------------------------------------------

function renderSidebar() {
  renderConversationList($("conv-list"), state.conversations, state.currentId, state.running, {
    open: (id) => switchTo(id),
    rename: (conv, title) => {
      conv.title = title;
      persist();
      renderSidebar();
    },
    remove: (conv) => {
      state.running.get(conv.id)?.abort();
      state.conversations = state.conversations.filter((c) => c.id !== conv.id);
      persist();
      renderAll();
    },
    redraw: () => renderSidebar(),
  });
  const conv = current();
  $("conv-title").textContent = conv ? conv.title : "";
  document.title = conv && conv.title !== store.DEFAULT_TITLE ? `${conv.title} · Tandem` : "Tandem";
}

function ensureConversation() {
  if (!current()) {
    const latest = [...state.conversations].sort((a, b) => b.updated - a.updated)[0];
    if (latest) state.currentId = latest.id;
    else {
      const conv = store.newConversation(defaultSettings());
      state.conversations.push(conv);
      state.currentId = conv.id;
    }
  }
  store.saveCurrentId(state.currentId);
}

function defaultSettings() {
  return state.models[0] ? { model: state.models[0].id } : {};
}

function newChat() {
  const empty = current();
  if (empty && !empty.messages.length) {
    $("input").focus();
    closeSidebar();
    return; // already on an empty conversation
  }
  const conv = store.newConversation(empty ? empty.settings : defaultSettings());
  state.conversations.push(conv);
  switchTo(conv.id);
}

function keepDraft(conv) {
  const text = $("input").value;
  if (text.trim()) conv.draft = text;
  else delete conv.draft;
}

function switchTo(id) {
  const from = current();
  const moving = from?.id !== id;
  if (from && moving) keepDraft(from);
  state.currentId = id;
  store.saveCurrentId(id);
  persist();
  renderAll();
  if (moving) {
    $("input").value = current()?.draft ?? "";
    autosize();
  }
  closeSidebar();
  $("input").focus();
}

function closeSidebar() {
  document.body.classList.remove("sidebar-open");
  $("scrim").hidden = true;
}

// ---- settings -----------------------------------------------------------------------------

function renderSettings() {
  const conv = current();
  if (!conv) return;
  const s = conv.settings;
  $("set-system").value = s.system ?? "";
  for (const key of NUMERIC) $(`set-${key}`).value = s[key] ?? "";
  const select = $("model");
  select.replaceChildren();
  const ids = state.models.map((m) => m.id);
  if (s.model && !ids.includes(s.model)) ids.push(s.model);
  for (const id of ids) select.append(new Option(id, id));
  select.value = s.model ?? ids[0] ?? "";
}

function bindSettings() {
  $("set-system").addEventListener("input", (e) => {
    const conv = current();
    if (e.target.value) conv.settings.system = e.target.value;
    else delete conv.settings.system;
    persist();
  });
  for (const key of NUMERIC) {
    $(`set-${key}`).addEventListener("input", (e) => {
      const conv = current();
      const v = e.target.value === "" ? NaN : Number(e.target.value);
      if (Number.isFinite(v)) conv.settings[key] = v;
      else delete conv.settings[key];
      persist();
    });
  }
  $("model").addEventListener("change", (e) => {
    current().settings.model = e.target.value;
    persist();
  });
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });
}

// ---- messages -----------------------------------------------------------------------------

function renderMessages() {
  const conv = current();
  const box = $("messages");
  box.replaceChildren();
  if (!conv || !conv.messages.length) {
    const empty = el("div", "empty");
    empty.append(el("h2", null, "Ask anything"));
    empty.append(el("p", null, state.models[0] ? `Model: ${state.models[0].id}` : ""));
    box.append(empty);
  } else {
    const on = {
      edit: (index, text) => editAndRegenerate(conv, index, text),
      cancel: () => renderMessages(),
      regenerate: () => regenerate(conv),
    };
    conv.messages.forEach((m, i) => box.append(messageNode(conv, m, i, on)));
  }
  box.scrollTop = box.scrollHeight;
  renderComposer();
}

function renderComposer() {
  const busy = state.running.has(state.currentId);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function renderAll() {
  ensureConversation();
  renderSidebar();
  renderSettings();
  renderMessages();
}

function editAndRegenerate(conv, index, text) {
  const old = conv.messages[index].content;
  state.running.get(conv.id)?.abort();
  conv.messages = conv.messages.slice(0, index);
  conv.messages.push({ role: "user", content: text });
  if (index === 0 && conv.title === titleFrom(old)) conv.title = titleFrom(text);
  generate(conv);
}

function regenerate(conv) {
  let end = conv.messages.length;
  while (end > 0 && conv.messages[end - 1].role !== "user") end--;
  if (!end) return;
  conv.messages = conv.messages.slice(0, end);
  generate(conv);
}

function titleFrom(text) {
  const line = text.replace(/\s+/g, " ").trim();
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || store.DEFAULT_TITLE;
}

// ---- sending and streaming ----------------------------------------------------------------

function readableError(e) {
  if (e.status === 0) return `${e.message} Is \`tandem serve\` still running? Try again once it is back.`;
  if (e.status === 401) return "The server refused the API key (401). Send again to enter another key.";
  if (e.status === 429) return `The server is busy (429): ${e.message}`;
  if (e.code === "context_length_exceeded")
    return `This conversation no longer fits the model's context: ${e.message} Start a new chat, edit an earlier message, or lower Max tokens in Settings.`;
  if (e.status === 503) return `The server cannot take requests now (503): ${e.message}`;
  return `Error${e.status ? ` ${e.status}` : ""}: ${e.message}`;
}

function requestBody(conv) {
  const s = conv.settings;
  const messages = [];
  if (s.system) messages.push({ role: "system", content: s.system });
  for (const m of conv.messages) {
    if (m.role === "user" || (m.role === "assistant" && !m.pending)) {
      messages.push({ role: m.role, content: m.content });
    }
  }
  const body = { model: s.model || state.models[0]?.id, messages };
  for (const key of NUMERIC) if (s[key] !== undefined) body[key] = s[key];
  return body;
}

async function send() {
  const input = $("input");
  const text = input.value.trim();
  const conv = current();
  if (!text || !conv || state.running.has(conv.id)) return;
  conv.messages = conv.messages.filter((m) => m.role !== "error");
  conv.messages.push({ role: "user", content: text });
  if (conv.title === store.DEFAULT_TITLE) conv.title = titleFrom(text);
  input.value = "";
  delete conv.draft;
  autosize();
  await generate(conv, text);
}

/** Streams a reply to the conversation's last user message. `typed`: the composer's text,
 * put back into the composer (and its turn dropped) if the request fails before any token. */
async function generate(conv, typed = null) {
  conv.messages = conv.messages.filter((m) => m.role !== "error");
  const reply = { role: "assistant", content: "", pending: true };
  conv.messages.push(reply);
  conv.updated = Date.now();
  const controller = new AbortController();
  state.running.set(conv.id, controller);
  persist();
  if (conv.id === state.currentId) renderMessages();
  renderSidebar();

  const started = performance.now();
  let firstAt = null;
  let lastSave = started;
  let frame = 0;
  let usage = null;
  const redraw = () => {
    frame = 0;
    if (conv.id !== state.currentId) return;
    const node = $("messages").querySelector(`.msg[data-index="${conv.messages.indexOf(reply)}"] .body`);
    if (!node) return;
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    node.replaceChildren(renderMarkdown(reply.content));
    if (atBottom) box.scrollTop = box.scrollHeight;
  };
  let failure = null;
  try {
    for await (const chunk of streamChat(requestBody(conv), controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const piece = choice.delta?.content;
      if (piece) {
        if (firstAt === null) firstAt = performance.now();
        reply.content += piece;
        if (!frame) frame = requestAnimationFrame(redraw);
        if (performance.now() - lastSave > 1000) {
          lastSave = performance.now();
          persist();
        }
      }
      if (choice.finish_reason) reply.finish_reason = choice.finish_reason;
    }
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else failure = e instanceof ApiError ? e : new ApiError(-1, String(e.message || e));
  }
  if (frame) cancelAnimationFrame(frame);
  const ended = performance.now();
  if (state.running.get(conv.id) === controller) state.running.delete(conv.id);
  delete reply.pending;
  const drop = (msg) => {
    const at = conv.messages.indexOf(msg);
    if (at >= 0) conv.messages.splice(at, 1);
  };
  const replaced = !conv.messages.includes(reply); // edited or regenerated while it ran

  if (failure && failure.status === 401 && !reply.content && !replaced) {
    drop(reply);
    const key = await askForKey();
    if (key) return generate(conv, typed);
  }
  if (failure && !replaced) {
    if (!reply.content) {
      const asked = conv.messages[conv.messages.indexOf(reply) - 1];
      drop(reply);
      if (typed !== null && asked?.role === "user" && asked.content === typed) {
        drop(asked);
        if (!conv.messages.length && conv.title === titleFrom(typed)) conv.title = store.DEFAULT_TITLE;
        if (conv.id === state.currentId) {
          const input = $("input");
          input.value = input.value ? `${typed}\n${input.value}` : typed;
          autosize();
        } else conv.draft = conv.draft ? `${typed}\n${conv.draft}` : typed;
      }
    } else reply.stopped = true;
    conv.messages.push({ role: "error", content: readableError(failure) });
  } else if (!failure) {
    reply.stats = {};
    if (usage) {
      reply.stats.prompt_tokens = usage.prompt_tokens;
      reply.stats.cached_tokens = usage.prompt_tokens_details?.cached_tokens ?? 0;
      reply.stats.completion_tokens = usage.completion_tokens;
    }
    if (firstAt !== null) {
      reply.stats.ttft_ms = firstAt - started;
      const n = usage?.completion_tokens;
      if (n > 1 && ended > firstAt) reply.stats.tokens_per_s = (n - 1) / ((ended - firstAt) / 1000);
    }
  }
  conv.updated = Date.now();
  persist();
  if (conv.id === state.currentId) renderMessages();
  renderSidebar();
}

function stop() {
  state.running.get(state.currentId)?.abort();
}

// ---- API key ------------------------------------------------------------------------------

async function askForKey() {
  const key = await askKey(store.getApiKey() ? "The server refused the stored API key." : "This server needs an API key.");
  $("forget-key").hidden = !store.getApiKey();
  return key;
}

async function loadModels() {
  for (;;) {
    try {
      state.models = await listModels();
      return;
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) {
        const key = await askForKey();
        if (key) continue;
      }
      alertBar(e instanceof ApiError ? `Could not list the models: ${readableError(e)}` : String(e));
      return;
    }
  }
}

// ---- import / export ----------------------------------------------------------------------

function exportAll() {
  const blob = new Blob([store.exportJson(state.conversations)], { type: "application/json" });
  const a = el("a");
  a.href = URL.createObjectURL(blob);
  a.download = `tandem-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importFile(file) {
  try {
    const added = store.importJson(await file.text(), state.conversations.map((c) => c.id));
    state.conversations.push(...added);
    state.currentId = added[0].id;
    store.saveCurrentId(state.currentId);
    persist();
    renderAll();
  } catch (e) {
    alertBar(`Import failed: ${e.message}`);
  }
}

// ---- composer -----------------------------------------------------------------------------

const NARROW = window.matchMedia("(max-width: 720px)");

function autosize() {
  const input = $("input");
  input.placeholder = NARROW.matches ? "Message" : "Message (Enter sends, Shift+Enter new line, Esc stops)";
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight + 2, 240)}px`;
  input.style.overflowY = input.scrollHeight + 2 > 240 ? "auto" : "hidden";
}

function bind() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("input").addEventListener("input", autosize);
  NARROW.addEventListener("change", autosize);
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.running.has(state.currentId)) {
      e.preventDefault();
      stop();
    }
  });
  $("new-chat").addEventListener("click", newChat);
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("change", (e) => {
    const file = e.target.files[0];
    e.target.value = "";
    if (file) importFile(file);
  });
  $("forget-key").addEventListener("click", () => {
    store.setApiKey("");
    $("forget-key").hidden = true;
  });
  $("toggle-sidebar").addEventListener("click", () => {
    const open = document.body.classList.toggle("sidebar-open");
    $("scrim").hidden = !open;
  });
  $("scrim").addEventListener("click", closeSidebar);
  window.addEventListener("storage", (e) => {
    if (e.key === "tandem.conversations.v1" && !state.running.size) {
      state.conversations = store.loadConversations();
      renderAll();
    }
  });
  bindSettings();
}

async function main() {
  bind();
  autosize();
  $("forget-key").hidden = !store.getApiKey();
  renderAll();
  $("input").value = current()?.draft ?? "";
  autosize();
  window.addEventListener("pagehide", () => {
    const conv = current();
    if (!conv) return;
    const before = conv.draft;
    keepDraft(conv);
    if (conv.draft !== before) persist();
  });
  await loadModels();
  for (const conv of state.conversations) if (!conv.settings.model && state.models[0]) conv.settings.model = state.models[0].id;
  renderAll();
  document.body.dataset.ready = "1";
  $("input").focus();
}

main();

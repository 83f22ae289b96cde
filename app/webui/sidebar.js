// The sidebar's list of conversations: open, rename in place, delete (a second click confirms).

import { button, el } from "./dom.js";

/** The list, newest first. `on`: {open(id), rename(conv, title), remove(conv), redraw()}. */
export function renderConversationList(list, conversations, currentId, running, on) {
  list.replaceChildren();
  const sorted = [...conversations].sort((a, b) => b.updated - a.updated);
  for (const conv of sorted) {
    const li = el("li", conv.id === currentId ? "active" : "");
    li.dataset.id = conv.id;
    const open = button(conv.title, "conv-open", () => on.open(conv.id));
    if (running.has(conv.id)) open.classList.add("busy");
    const rename = button("✎", "icon conv-rename", () => startRename(li, conv, on), "Rename");
    const del = button("✕", "icon conv-delete", () => confirmDelete(del, conv, on), "Delete");
    li.append(open, rename, del);
    list.append(li);
  }
}

function startRename(li, conv, on) {
  const input = el("input", "conv-rename-input");
  input.value = conv.title;
  input.setAttribute("aria-label", "Conversation name");
  let done = false;
  const commit = (save) => {
    if (done) return;
    done = true;
    if (save && input.value.trim()) on.rename(conv, input.value.trim().slice(0, 200));
    else on.redraw();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") commit(true);
    else if (e.key === "Escape") {
      e.stopPropagation();
      commit(false);
    }
  });
  input.addEventListener("blur", () => commit(true));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

function confirmDelete(del, conv, on) {
  if (!del.classList.contains("confirm")) {
    del.classList.add("confirm");
    del.textContent = "Delete?";
    setTimeout(() => del.isConnected && on.redraw(), 3000);
    return;
  }
  on.remove(conv);
}

// One message of a conversation as DOM: user text, a rendered reply with its figures, an error;
// and the in-place editor of an earlier question.

import { button, el } from "./dom.js";
import { copyButton, renderMarkdown } from "./markdown.js";

function formatStats(stats, stopped, finishReason) {
  const parts = [];
  if (stats.prompt_tokens !== undefined) {
    parts.push(`${stats.prompt_tokens} prompt tokens`);
    parts.push(`${stats.cached_tokens ?? 0} cached`);
  }
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} generated`);
  if (stats.ttft_ms !== undefined) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stopped) parts.push("stopped");
  else if (finishReason === "length") parts.push("max tokens reached");
  return parts.join(" · ");
}

/** One message's node. `on`: {edit(index, text), cancel(), regenerate()}. */
export function messageNode(conv, msg, index, on) {
  const node = el("div", `msg ${msg.role}`);
  node.dataset.index = index;
  const body = el("div", "body");
  node.append(body);
  if (msg.role === "user") {
    body.textContent = msg.content;
    const actions = el("div", "actions");
    actions.append(button("Edit", "msg-edit", () => startEdit(msg, index, node, on), "Edit and regenerate from here"));
    node.append(actions);
  } else if (msg.role === "assistant") {
    body.append(renderMarkdown(msg.content));
    if (msg.pending && !msg.content) body.append(el("span", "typing", "…"));
    const meta = el("div", "meta");
    if (msg.stats) {
      meta.textContent = formatStats(msg.stats, msg.stopped, msg.finish_reason);
      if (msg.stats.cached_tokens !== undefined) meta.dataset.cached = msg.stats.cached_tokens;
    } else if (msg.stopped) meta.textContent = "stopped";
    const actions = el("div", "actions");
    if (!msg.pending) {
      actions.append(copyButton(() => msg.content, "Copy"));
      if (index === conv.messages.length - 1) {
        actions.append(button("Regenerate", "msg-regenerate", () => on.regenerate(), "Generate this reply again"));
      }
    }
    node.append(meta, actions);
  } else {
    body.textContent = msg.content;
    const actions = el("div", "actions");
    if (index === conv.messages.length - 1 && conv.messages.some((m) => m.role === "user")) {
      actions.append(button("Retry", "msg-regenerate", () => on.regenerate(), "Send the conversation again"));
    }
    node.append(actions);
  }
  return node;
}

function startEdit(msg, index, node, on) {
  const area = el("textarea", "edit-area");
  area.value = msg.content;
  area.rows = Math.min(12, Math.max(2, msg.content.split("\n").length));
  const save = button("Save & regenerate", "primary msg-save", () => {
    const text = area.value.trim();
    if (text) on.edit(index, text);
  });
  const cancel = button("Cancel", "msg-cancel", () => on.cancel());
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      save.click();
    } else if (e.key === "Escape") {
      e.stopPropagation();
      on.cancel();
    }
  });
  const actions = el("div", "actions");
  actions.append(cancel, save);
  node.replaceChildren(area, actions);
  node.classList.add("editing");
  area.focus();
}

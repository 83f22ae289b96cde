// The API key dialog and page-level notices.

import { button, el } from "./dom.js";
import { setApiKey } from "./store.js";

const $ = (id) => document.getElementById(id);

/** A dismissable notice at the top of the page. */
export function alertBar(text) {
  const bar = el("div", "notice", text);
  bar.append(button("×", "close", () => bar.remove(), "Dismiss"));
  $("main").prepend(bar);
}

/** Shows the key dialog; resolves to the key saved, or null if cancelled. */
export function askKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason;
  $("key-input").value = "";
  return new Promise((resolve) => {
    const done = (key) => {
      dialog.removeEventListener("close", onClose);
      $("key-cancel").removeEventListener("click", onCancel);
      if (dialog.open) dialog.close();
      if (key) setApiKey(key);
      resolve(key);
    };
    const onClose = () => done(dialog.returnValue === "ok" ? $("key-input").value.trim() : null);
    const onCancel = () => done(null);
    dialog.addEventListener("close", onClose);
    $("key-cancel").addEventListener("click", onCancel);
    dialog.showModal();
    $("key-input").focus();
  });
}

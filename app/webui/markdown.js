// Safe Markdown: text in, DOM nodes out. Model output only ever becomes text nodes and
// attributes we choose (links: http, https and mailto only), never HTML.

import { el } from "./dom.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;
const INLINE = new RegExp(
  [
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)", // 1,2 code span
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 3 strong
    "__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)", // 4 strong
    "~~(?=\\S)([\\s\\S]*?\\S)~~", // 5 strike
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // 6 em
    "(?<![\\w])_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?!\\w)", // 7 em
    "\\[([^\\]\\n]+)\\]\\(\\s*<?((?:[^()\\s<>]|\\([^()\\s]*\\))+)>?(?:\\s+\"[^\"]*\")?\\s*\\)", // 8,9 link
    "(https?:\\/\\/[^\\s<>()\\[\\]]*[^\\s<>()\\[\\].,;:!?'\"*_~])", // 10 bare URL
    "\\\\([\\\\`*_{}\\[\\]()#+\\-.!~|>])", // 11 escape
    "(\\n)", // 12 line break
  ].join("|"),
);

function safeHref(url) {
  try {
    const parsed = new URL(url, "https://invalid.example/");
    if (!/^(https?|mailto):$/.test(parsed.protocol) || parsed.host === "invalid.example") return null;
    return parsed.href;
  } catch {
    return null;
  }
}

function link(text, href, parent, bare) {
  const safe = safeHref(href);
  if (!safe) {
    parent.append(text);
    return;
  }
  const a = el("a");
  a.href = safe;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  if (bare) a.textContent = text;
  else renderInline(text.replace(/https?:\/\//g, ""), a); // no link inside a link
  parent.append(a);
}

export function renderInline(text, parent) {
  let rest = text;
  while (rest.length) {
    const m = INLINE.exec(rest);
    if (!m) {
      parent.append(rest);
      return;
    }
    if (m.index) parent.append(rest.slice(0, m.index));
    if (m[1] !== undefined) {
      const code = m[2];
      parent.append(el("code", null, /^ .* $/.test(code) ? code.slice(1, -1) : code));
    } else if (m[3] !== undefined || m[4] !== undefined) {
      const strong = el("strong");
      renderInline(m[3] ?? m[4], strong);
      parent.append(strong);
    } else if (m[5] !== undefined) {
      const del = el("del");
      renderInline(m[5], del);
      parent.append(del);
    } else if (m[6] !== undefined || m[7] !== undefined) {
      const em = el("em");
      renderInline(m[6] ?? m[7], em);
      parent.append(em);
    } else if (m[8] !== undefined) {
      link(m[8], m[9], parent);
    } else if (m[10] !== undefined) {
      link(m[10], m[10], parent, true);
    } else if (m[11] !== undefined) {
      parent.append(m[11]);
    } else {
      parent.append(el("br"));
    }
    rest = rest.slice(m.index + m[0].length);
  }
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = el("textarea");
  area.value = text;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

export function copyButton(getText, label = "Copy") {
  const button = el("button", "copy", label);
  button.type = "button";
  button.addEventListener("click", async () => {
    try {
      await copyText(getText());
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => (button.textContent = label), 1500);
  });
  return button;
}

function codeBlock(lang, code) {
  const box = el("div", "code-block");
  const head = el("div", "code-head");
  head.append(el("span", "code-lang", lang || "text"), copyButton(() => code));
  const pre = el("pre");
  const inner = el("code", null, code);
  if (lang) inner.dataset.lang = lang;
  pre.append(inner);
  box.append(head, pre);
  return box;
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines) {
  const wrap = el("div", "table-wrap");
  const t = el("table");
  const head = splitRow(lines[0]);
  const aligns = splitRow(lines[1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : "",
  );
  const thead = el("thead");
  const hr = el("tr");
  head.forEach((cell, i) => {
    const th = el("th");
    if (aligns[i]) th.style.textAlign = aligns[i];
    renderInline(cell, th);
    hr.append(th);
  });
  thead.append(hr);
  const tbody = el("tbody");
  for (const line of lines.slice(2)) {
    const tr = el("tr");
    splitRow(line).slice(0, head.length).forEach((cell, i) => {
      const td = el("td");
      if (aligns[i]) td.style.textAlign = aligns[i];
      renderInline(cell, td);
      tr.append(td);
    });
    tbody.append(tr);
  }
  t.append(thead, tbody);
  wrap.append(t);
  return wrap;
}

function startsBlock(line, next) {
  return (
    FENCE.test(line) ||
    HEADING.test(line) ||
    RULE.test(line) ||
    QUOTE.test(line) ||
    ITEM.test(line) ||
    (line.includes("|") && next !== undefined && TABLE_SEP.test(next) && next.includes("-"))
  );
}

function list(lines, start) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered) {
    const n = parseInt(first[2], 10);
    if (n !== 1) node.start = n;
  }
  let i = start;
  let item = null;
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) {
      if (item) node.append(listItem(item));
      item = [m[3]];
      i++;
    } else if (m && m[1].length <= indent + 1) {
      break; // a list of the other kind starts
    } else if (line.trim() === "") {
      const next = lines[i + 1];
      if (next !== undefined && (/^\s{2,}\S/.test(next) || (ITEM.exec(next)?.[1].length ?? -1) === indent)) {
        item.push("");
        i++;
      } else break;
    } else if (/^\s+\S/.test(line) || !startsBlock(line, lines[i + 1])) {
      item.push(line.replace(new RegExp(`^\\s{0,${indent + 4}}`), ""));
      i++;
    } else break;
  }
  if (item) node.append(listItem(item));
  return [node, i];
}

function listItem(lines) {
  const li = el("li");
  const loose = lines.some((l, i) => i > 0 && (ITEM.test(l) || FENCE.test(l) || l === ""));
  if (!loose) renderInline(lines.join("\n"), li);
  else renderBlocks(lines, li);
  return li;
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.trim() === "") {
      i++;
      continue;
    }
    let m = FENCE.exec(line);
    if (m) {
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length) {
        const close = lines[i].trim();
        if (close.startsWith(fence[0].repeat(fence.length)) && /^([`~])\1*$/.test(close)) {
          i++;
          break;
        }
        body.push(lines[i]);
        i++;
      }
      parent.append(codeBlock(m[2], body.join("\n")));
      continue;
    }
    if ((m = HEADING.exec(line))) {
      const h = el(`h${m[1].length}`);
      renderInline(m[2], h);
      parent.append(h);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      const q = el("blockquote");
      renderBlocks(inner, q);
      parent.append(q);
      continue;
    }
    if (ITEM.test(line)) {
      const [node, next] = list(lines, i);
      parent.append(node);
      i = next;
      continue;
    }
    if (line.includes("|") && TABLE_SEP.test(lines[i + 1] ?? "") && lines[i + 1].includes("-")) {
      const rows = [line, lines[i + 1]];
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim() !== "") rows.push(lines[i++]);
      parent.append(table(rows));
      continue;
    }
    const para = [line];
    i++;
    while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i], lines[i + 1])) {
      para.push(lines[i]);
      i++;
    }
    const p = el("p");
    renderInline(para.join("\n"), p);
    parent.append(p);
  }
}

export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}

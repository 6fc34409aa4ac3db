// Markdown → HTML for model answers, safe by construction.
//
// Every piece of model text goes through escapeHtml() before it is placed in the output; markup is
// only ever added around escaped text. Links keep only http(s), mailto, relative and #fragment
// targets (so no `javascript:` URL can get in), and their href is escaped as well. The result may
// be assigned to innerHTML. Unfinished constructs (an unclosed ``` while a reply is still
// streaming) render as if closed at the end of the text.
//
// Covers what chat models write: fenced and indented code, inline code, headings, bold, italic,
// strikethrough, (nested) bullet and numbered lists, block quotes, tables, rules, links and bare
// URLs. Single newlines inside a paragraph are kept as line breaks (chat convention).

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const SAFE_URL = /^(https?:\/\/|mailto:|\/|#|\.\/)/i;

/** Render markdown `source` (untrusted text) to an HTML string that is safe for innerHTML. */
export function renderMarkdown(source) {
  // NUL is used below as a placeholder delimiter; model text never needs it.
  const text = String(source ?? "")
    .replace(/\r\n?/g, "\n")
    .replace(/\u0000/g, "");
  return blocks(text.split("\n"));
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = line.match(FENCE))) {
      const marker = m[1];
      const lang = m[2].replace(/[^\w+.#-]/g, "");
      const code = [];
      i++;
      while (i < lines.length && !isClosingFence(lines[i], marker)) code.push(lines[i++]);
      i++; // the closing fence (or past the end while still streaming)
      const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
      const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "";
      out.push(`<pre>${label}<code${cls}>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if (/^( {4}|\t)/.test(line) && !LIST_ITEM.test(line)) {
      const code = [];
      while (i < lines.length && (/^( {4}|\t)/.test(lines[i]) || !lines[i].trim())) {
        code.push(lines[i++].replace(/^( {4}|\t)/, ""));
      }
      while (code.length && !code[code.length - 1].trim()) code.pop();
      out.push(`<pre><code>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if ((m = line.match(HEADING))) {
      const level = m[1].length;
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) {
        inner.push(m[1]);
        i++;
      }
      out.push(`<blockquote>${blocks(inner)}</blockquote>`);
    } else if (LIST_ITEM.test(line)) {
      const items = [];
      while (i < lines.length) {
        const l = lines[i];
        if ((m = l.match(LIST_ITEM))) {
          items.push({ indent: indentOf(m[1]), ordered: /\d/.test(m[2]), start: parseInt(m[2], 10), lines: [m[3]] });
        } else if (l.trim() && /^\s/.test(l) && items.length) {
          items[items.length - 1].lines.push(l.trim()); // continuation of the item above
        } else if (!l.trim() && i + 1 < lines.length && LIST_ITEM.test(lines[i + 1])) {
          // a blank line between items: still the same list
        } else {
          break;
        }
        i++;
      }
      for (let k = 0; k < items.length; ) {
        const part = list(items, k); // a change of kind (bullets → numbers) starts a new list
        out.push(part.html);
        k = part.next;
      }
    } else if (isTableStart(lines, i)) {
      const head = cells(line);
      const aligns = cells(lines[i + 1]).map((c) =>
        c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "",
      );
      i += 2;
      const rows = [];
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(cells(lines[i++]));
      const td = (tag, c, k) => `<${tag}${aligns[k] ? ` style="text-align:${aligns[k]}"` : ""}>${inline(c)}</${tag}>`;
      out.push(
        `<div class="table-wrap"><table><thead><tr>${head.map((c, k) => td("th", c, k)).join("")}</tr></thead>` +
          `<tbody>${rows.map((r) => `<tr>${head.map((_, k) => td("td", r[k] ?? "", k)).join("")}</tr>`).join("")}</tbody></table></div>`,
      );
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && !startsBlock(lines, i)) para.push(lines[i++].trim());
      out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    }
  }
  return out.join("");
}

function isClosingFence(line, marker) {
  const t = line.trim();
  return t.length >= marker.length && t[0] === marker[0] && new RegExp(`^\\${marker[0]}+$`).test(t);
}

// A header row with pipes followed by a delimiter row such as |---|:-:|.
function isTableStart(lines, i) {
  const next = lines[i + 1];
  return lines[i].includes("|") && next !== undefined && next.includes("|") && TABLE_SEP.test(next);
}

function indentOf(ws) {
  return ws.replace(/\t/g, "    ").length;
}

function startsBlock(lines, i) {
  const l = lines[i];
  return (
    FENCE.test(l) ||
    HEADING.test(l) ||
    RULE.test(l) ||
    QUOTE.test(l) ||
    LIST_ITEM.test(l) ||
    isTableStart(lines, i)
  );
}

// Items deeper than the first item's indent become a list nested in the item above.
function list(items, from) {
  const base = items[from].indent;
  const ordered = items[from].ordered;
  const start = ordered && items[from].start !== 1 ? ` start="${items[from].start}"` : "";
  let html = ordered ? `<ol${start}>` : "<ul>";
  let i = from;
  while (i < items.length && items[i].indent >= base) {
    if (items[i].indent > base) {
      const nested = list(items, i);
      html = html.replace(/<\/li>$/, `${nested.html}</li>`);
      i = nested.next;
      continue;
    }
    if (items[i].ordered !== ordered && i > from) break;
    html += `<li>${items[i].lines.map(inline).join("<br>")}</li>`;
    i++;
  }
  html += ordered ? "</ol>" : "</ul>";
  return { html, next: i };
}

function cells(row) {
  return row
    .trim()
    .replace(/^\|/, "")
    .replace(/\|$/, "")
    .split("|")
    .map((c) => c.trim());
}

// Inline markup. Code spans and links are cut out first and stand as \u0000n\u0000 placeholders,
// so emphasis never reaches inside them; everything else is escaped before any tag is added.
function inline(raw) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = raw.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) => hold(`<code>${escapeHtml(code.trim() || code)}</code>`));
  s = s.replace(/\[([^\]\n]+)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)/g, (all, label, url) =>
    SAFE_URL.test(url) ? hold(link(url, emphasis(escapeHtml(label)))) : all,
  );
  s = s.replace(/\bhttps?:\/\/[^\s<>"'`\u0000]+[^\s<>"'`\u0000.,;:!?)\]]/g, (url) => hold(link(url, escapeHtml(url))));
  s = emphasis(escapeHtml(s));
  return s.replace(/\u0000(\d+)\u0000/g, (_, k) => held[Number(k)]);
}

function link(url, labelHtml) {
  return `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${labelHtml}</a>`;
}

// On already-escaped text: ** / __ bold, * / _ italic, ~~ strikethrough.
function emphasis(s) {
  return s
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}

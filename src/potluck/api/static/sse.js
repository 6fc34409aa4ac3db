// Server-sent events from a fetch() body (EventSource cannot POST or send headers).
//
// Follows the SSE parsing rules: lines end in \n, \r\n or \r; `data:` lines accumulate (joined by
// \n); a blank line dispatches the event; lines starting with ':' are comments (keep-alives).

/** Yield {event, data} for each event in a ReadableStream of bytes. */
export async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  let event = "message";
  const take = function* (final) {
    for (;;) {
      const m = buffer.match(/\r\n|\r|\n/);
      // A trailing \r may be the first half of \r\n: wait for the next chunk unless this is the end.
      if (!m || (!final && m[0] === "\r" && m.index === buffer.length - 1)) return;
      const line = buffer.slice(0, m.index);
      buffer = buffer.slice(m.index + m[0].length);
      if (line === "") {
        if (data.length) yield { event, data: data.join("\n") };
        data = [];
        event = "message";
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") data.push(value);
        else if (field === "event") event = value;
      }
    }
  };
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        finished = true;
        break;
      }
      buffer += decoder.decode(value, { stream: true });
      yield* take(false);
    }
    buffer += decoder.decode() + "\n\n"; // flush: an unterminated last event still counts
    yield* take(true);
  } finally {
    // The consumer stopped early (e.g. at [DONE]) or an error: close the connection.
    if (!finished) reader.cancel().catch(() => {});
    reader.releaseLock();
  }
}

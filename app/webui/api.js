// The page's side of the OpenAI-style API: /v1/models and streamed /v1/chat/completions (SSE).

import { getApiKey } from "./store.js";

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = getApiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorFrom(response) {
  let message = response.statusText || "request failed";
  let code = null;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
    code = body?.error?.code ?? null;
  } catch {
    /* not JSON: keep the status text */
  }
  return new ApiError(response.status, message, code);
}

async function send(path, init) {
  try {
    return await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, "Cannot reach the server.", "server_gone");
  }
}

export async function listModels() {
  const response = await send("/v1/models", { headers: headers() });
  if (!response.ok) throw await errorFrom(response);
  const body = await response.json();
  return (body.data || []).map((m) => ({ id: m.id, maxModelLen: m.max_model_len }));
}

/** Yields each parsed chunk of a streamed chat completion; throws ApiError (or AbortError). */
export async function* streamChat(body, signal) {
  const response = await send("/v1/chat/completions", {
    method: "POST",
    headers: headers(),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorFrom(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let done = false;
  try {
    while (!done) {
      let read;
      try {
        read = await reader.read();
      } catch (e) {
        if (e.name === "AbortError") throw e;
        throw new ApiError(0, "The connection to the server was lost mid-reply.", "server_gone");
      }
      if (read.done) break;
      buffer += decoder.decode(read.value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = frame
          .split("\n")
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") {
          done = true;
          break;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(500, chunk.error.message || "error", chunk.error.code);
        yield chunk;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
  if (!done) throw new ApiError(0, "The server closed the stream before the reply ended.", "server_gone");
}

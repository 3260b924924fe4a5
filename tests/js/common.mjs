// Shared by the judge scripts: where the gateway is, and how to report what was observed.
// Each script prints exactly one JSON line on stdout; pytest (tests/test_js_clients.py) asserts on it.

export function baseURL() {
  const url = process.argv[2] ?? process.env.GATEWAY_BASE_URL;
  if (!url) {
    throw new Error("usage: node <script>.mjs <gateway base URL, e.g. http://127.0.0.1:8080/v1>");
  }
  return url.endsWith("/v1") ? url : `${url.replace(/\/$/, "")}/v1`;
}

function clip(value, n = 2000) {
  if (value == null) return value;
  const text = typeof value === "string" ? value : JSON.stringify(value);
  return text.length > n ? `${text.slice(0, n)}…` : text;
}

// Everything a client error carries that helps tell why it rejected the gateway's output.
export function describeError(error) {
  if (error == null || typeof error !== "object") return { message: String(error) };
  const out = { name: error.name, message: clip(error.message) };
  for (const key of ["statusCode", "status", "responseBody", "url", "code", "param", "type"]) {
    if (error[key] !== undefined) out[key] = clip(error[key]);
  }
  if (error.value !== undefined) out.value = clip(error.value);
  if (error.cause) out.cause = describeError(error.cause);
  if (Array.isArray(error.errors)) out.errors = error.errors.slice(0, 3).map(describeError);
  return out;
}

// A fetch that records each request's JSON body and the response's status (for the scenario's report).
export function recordingFetch(log) {
  return async (input, init) => {
    let body = init?.body;
    try {
      body = typeof body === "string" ? JSON.parse(body) : body;
    } catch {
      // not JSON: keep it as it is
    }
    const entry = { url: String(input?.url ?? input), body };
    log.push(entry);
    const response = await fetch(input, init);
    entry.status = response.status;
    return response;
  };
}

// What a Responses request sent as input: item types (messages as role:NAME) and the store flag.
export function requestSummary(entry) {
  const input = Array.isArray(entry.body?.input) ? entry.body.input : [];
  return {
    status: entry.status,
    store: entry.body?.store,
    inputTypes: input.map((i) => i.type === "message" || (i.type == null && i.role) ? `role:${i.role}` : i.type),
  };
}

export function emit(observed) {
  process.stdout.write(`${JSON.stringify(observed)}\n`);
}

// Run a scenario; whatever happens, print one JSON line (with `error` when it threw) and exit 0.
export async function scenario(fn) {
  const observed = { ok: false };
  try {
    await fn(observed);
    observed.ok = observed.errors?.length ? false : true;
  } catch (error) {
    observed.error = describeError(error);
  }
  emit(observed);
}

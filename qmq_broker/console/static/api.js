// Calls to the broker's JSON API with the token the console was given (kept for this tab
// only, in sessionStorage), and its errors as ApiError.

const TOKEN_KEY = "qmq-console-token";

export class ApiError extends Error {
  constructor(status, code, message, field) {
    super(message);
    this.status = status;
    this.code = code;
    this.field = field;
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/** ``GET`` (or ``POST`` with ``body``) a broker path; the answer's JSON, or an ApiError. */
export async function call(path, { method = "GET", body } = {}) {
  const headers = { Accept: "application/json" };
  const bearer = token();
  if (bearer) headers.Authorization = `Bearer ${bearer}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      credentials: "omit",
    });
  } catch (error) {
    throw new ApiError(0, "unreachable", `the broker did not answer (${error.message})`);
  }
  let doc = null;
  try {
    doc = await response.json();
  } catch {
    doc = null;
  }
  if (!response.ok) {
    const problem = (doc && doc.error) || {};
    throw new ApiError(response.status, problem.code || "error", problem.message || response.statusText, problem.field);
  }
  return doc;
}

/** ``call`` that never throws but for a missing token: ``{value}`` or ``{error}``. */
export async function settle(path, options) {
  try {
    return { value: await call(path, options) };
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) throw error;
    return { error };
  }
}

export function subjectPath(subject, ...rest) {
  return ["/v1/subjects", encodeURIComponent(subject), ...rest.map((p) => encodeURIComponent(String(p)))].join("/");
}

// rvqtts's API page: the server's own OpenAPI description (openapi.json) shown per route, with its request fields as
// a table, its answers, and a "Try it" for the speech request and the GET routes. Whatever comes from the server is
// only ever set as text (textContent, createElement), never as markup. URLs are relative: the page is served by its
// server.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "rvqtts.apiKey"; // the speaking page's (page.js): one key per tab
let schemas = {}; // components.schemas
let example = null; // the speech request's textarea, refilled once the voices are known

// An element: `text` sets its text; other attributes are set as they are; children are nodes or strings (as text).
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  node.append(...children.filter((child) => child != null));
  return node;
}

function say(message, kind = "") {
  $("status").textContent = message;
  $("status").className = kind;
}

// fetch with the API key, at the route's path relative to this page.
function send(path, options = {}) {
  const headers = new Headers(options.headers);
  const key = sessionStorage.getItem(KEY);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return fetch(path.replace(/^\//, ""), { ...options, headers });
}

// JSON whose integers past 2**53 keep their digits (where the browser gives the reviver the source text).
const parse = (text) =>
  JSON.parse(text, (key, value, context) =>
    Number.isInteger(value) && !Number.isSafeInteger(value) && context?.source ? context.source : value,
  );

// ---- Schemas in words ----

const resolve = (schema) => {
  while (schema?.$ref) schema = schemas[schema.$ref.split("/").pop()];
  return schema || {};
};

// {type, range, optional} of a schema: `anyOf` with null is an optional value of the other types.
function describe(schema) {
  schema = resolve(schema);
  const options = (schema.anyOf || schema.oneOf)?.map(resolve);
  if (options) {
    const kinds = options.filter((option) => option.type !== "null").map(describe);
    const range = kinds.map((kind) => kind.range).filter(Boolean).join("; ");
    return { type: kinds.map((kind) => kind.type).join(" or "), range, optional: kinds.length < options.length };
  }
  let type = schema.type || "any";
  if (type === "object" && schema.properties) type = `{${Object.keys(schema.properties).join(", ")}}`;
  if (type === "array") type = `array of ${describe(schema.items).type}`;
  if (schema.format === "binary") type = "file";
  return { type, range: range(schema), optional: false };
}

function range(schema) {
  if (schema.enum) return schema.enum.map((value) => JSON.stringify(value)).join(", ");
  const low = schema.minimum ?? schema.exclusiveMinimum;
  const high = schema.maximum ?? schema.exclusiveMaximum;
  const bounds = [];
  if (low != null) bounds.push(`${"minimum" in schema ? "≥" : ">"} ${low}`);
  if (high != null) bounds.push(`${"maximum" in schema ? "≤" : "<"} ${high}`);
  if (schema.pattern) bounds.push(`matches ${schema.pattern}`);
  return bounds.join(", ");
}

// A table of an object schema's fields: name, type, range or choices, default, description.
function fieldsTable(schema) {
  schema = resolve(schema);
  const required = new Set(schema.required || []);
  const rows = Object.entries(schema.properties || {}).map(([name, property]) => {
    const { type, range } = describe(property);
    let given = "none";
    if (required.has(name)) given = "required";
    else if (property.default != null) given = JSON.stringify(property.default);
    return el("tr", {}, el("td", {}, el("code", { text: name })), el("td", { text: type }),
      el("td", { text: range }), el("td", { text: given }), el("td", { text: property.description || "" }));
  });
  const head = el("tr", {}, ...["Field", "Type", "Range or choices", "Default", "Description"].map((name) => el("th", { scope: "col", text: name })));
  return el("div", { class: "table" }, el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
}

function responsesList(responses) {
  return el("ul", {}, ...Object.entries(responses || {}).map(([status, response]) => {
    const content = Object.entries(response.content || {});
    const types = content.map(([type, body]) => {
      const name = body.schema?.$ref?.split("/").pop();
      return name ? `${type} (${name}: ${Object.keys(resolve(body.schema).properties || {}).join(", ")})` : type;
    });
    return el("li", {}, el("strong", { text: status }), ` ${response.description || ""}`, types.length ? ` — ${types.join(", ")}` : "");
  }));
}

// ---- The routes ----

function render(document) {
  schemas = document.components?.schemas || {};
  $("title").textContent = `${document.info?.title || "rvqtts"} ${document.info?.version || ""}`.trim();
  $("info").textContent = document.info?.description || "";
  for (const [path, methods] of Object.entries(document.paths || {})) {
    for (const [method, operation] of Object.entries(methods)) {
      const id = `${method}-${path}`.replace(/[^A-Za-z0-9]+/g, "-");
      const title = `${method.toUpperCase()} ${path}`;
      $("toc").append(el("li", {}, el("a", { href: `#${id}`, text: title })));
      $("endpoints").append(endpoint(id, title, path, method, operation));
    }
  }
}

function endpoint(id, title, path, method, operation) {
  const section = el("section", { id, class: "endpoint" }, el("h2", {}, el("code", { text: title })), el("p", { text: operation.summary || "" }));
  const parameters = operation.parameters || [];
  if (parameters.length) {
    section.append(el("h3", { text: "Parameters" }), fieldsTable({
      properties: Object.fromEntries(parameters.map((p) => [p.name, { ...p.schema, description: `in the ${p.in}` }])),
      required: parameters.filter((p) => p.required).map((p) => p.name),
    }));
  }
  for (const [type, body] of Object.entries(operation.requestBody?.content || {})) {
    section.append(el("h3", { text: `Request body (${type})` }), fieldsTable(body.schema));
  }
  section.append(el("h3", { text: "Responses" }), responsesList(operation.responses));
  if (method === "post" && path === "/v1/audio/speech") section.append(tryIt(path, method, true));
  else if (method === "get") section.append(tryIt(path, method, false));
  return section;
}

// ---- Try it ----

function tryIt(path, method, withBody) {
  const box = el("div", { class: "try" }, el("h3", { text: "Try it" }));
  const output = el("div", { class: "output", "aria-live": "polite" });
  let body = null;
  if (withBody) {
    const id = `body-${path.replace(/[^A-Za-z0-9]+/g, "-")}`;
    body = example = el("textarea", { id, rows: "6", spellcheck: "false" });
    body.value = body.dataset.filled = JSON.stringify({ input: "Hello." }, null, 2);
    box.append(el("label", { for: id, text: "Request body (JSON)" }), body);
  }
  const button = el("button", { type: "button", text: "Send" });
  button.addEventListener("click", () => request(path, method, body, output, button));
  box.append(el("div", { class: "buttons" }, button), output);
  return box;
}

async function request(path, method, body, output, button) {
  const options = { method };
  if (body) {
    try {
      JSON.parse(body.value);
    } catch (error) {
      return output.replaceChildren(el("p", { class: "error", text: `The body is not JSON: ${error.message}` }));
    }
    options.headers = { "Content-Type": "application/json" };
    options.body = body.value;
  }
  button.disabled = true;
  output.replaceChildren(el("p", { class: "note", text: "Sending…" }));
  try {
    const response = await send(path, options);
    const type = response.headers.get("Content-Type") || "";
    const line = el("p", { class: response.ok ? "ok" : "error", text: `${response.status} ${response.statusText} · ${type}` });
    if (response.ok && type.startsWith("audio/") && !type.startsWith("audio/pcm")) {
      const blob = await response.blob();
      const audio = el("audio", { controls: "" });
      audio.src = URL.createObjectURL(blob);
      line.append(` · ${blob.size} bytes`);
      output.replaceChildren(line, audio);
    } else if (type.startsWith("audio/")) {
      line.append(` · ${(await response.arrayBuffer()).byteLength} bytes of 16-bit PCM (not playable here)`);
      output.replaceChildren(line);
    } else {
      output.replaceChildren(line, el("pre", { text: pretty(await response.text()) }));
    }
  } catch (error) {
    output.replaceChildren(el("p", { class: "error", text: `The server cannot be reached: ${error.message}` }));
  } finally {
    button.disabled = false;
  }
}

function pretty(text) {
  try {
    return JSON.stringify(parse(text), null, 2);
  } catch {
    return text;
  }
}

// The speech example's voice: the model's first (GET /v1/audio/voices), where it has one. A body the user edited stays.
async function fillExample() {
  if (!example || (example.dataset.filled && example.value !== example.dataset.filled)) return;
  const response = await send("v1/audio/voices").catch(() => null);
  if (response?.status === 401) return say("This server asks for its API key: enter it above to try the routes.", "error");
  const voices = response?.ok ? (await response.json()).voices || [] : [];
  example.value = example.dataset.filled = JSON.stringify({ input: "Hello.", ...(voices.length ? { voice: voices[0] } : {}) }, null, 2);
}

async function load() {
  try {
    const response = await fetch("openapi.json");
    if (!response.ok) throw new Error(`the server answered ${response.status} ${response.statusText}`);
    render(parse(await response.text()));
  } catch (error) {
    return say(`The API's description cannot be read: ${error.message}`, "error");
  }
  await fillExample();
}

$("api-key").value = sessionStorage.getItem(KEY) || "";
$("api-key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
  say(key ? "The key is sent with every request from here." : "No key is sent.", "ok");
  fillExample();
});
load();

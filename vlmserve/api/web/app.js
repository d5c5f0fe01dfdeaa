// vlmserve's chat page: a client of this server's OpenAI-compatible API (POST v1/chat/completions
// with stream: true), no libraries. Model text is only ever put in the page as text (textContent),
// never parsed as HTML; the Content-Security-Policy the server sends allows no inline script.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "vlmserve.apiKey";
const SETTINGS_STORE = "vlmserve.settings";
// Number settings sent as given; an empty field leaves the server's default (--generation-config).
const NUMBER_SETTINGS = [
  ["temperature", parseFloat],
  ["top_p", parseFloat],
  ["top_k", (v) => parseInt(v, 10)],
  ["max_tokens", (v) => parseInt(v, 10)],
  ["repetition_penalty", parseFloat],
  ["presence_penalty", parseFloat],
  ["frequency_penalty", parseFloat],
  ["seed", (v) => parseInt(v, 10)],
];
const TEXT_SETTINGS = ["system", "stop", "regex"];

const state = {
  model: null, // the served model name (GET v1/models)
  card: null, // its entry in GET v1/models: `vlmserve` says its family, box convention, example questions
  history: [], // {role: "user", text, media: [Media]} | {role: "assistant", text}
  pending: [], // Media attached to the next message
  controller: null, // AbortController of the answer being streamed
};
// Media: {kind: "image" | "video", name, dataUrl (what is sent), objectUrl (what is shown), caption}

// -- grounding boxes ------------------------------------------------------------------------------
// The server names the convention its model writes boxes in (response field `vlmserve`,
// vlmserve/grounding.py in Python). Every syntax is looked for in any text; the convention only
// says the scale: absolute pixels of the resized picture the model saw, or 0..1000 of its width
// and height. Either way the box is mapped to the ORIGINAL picture's pixels.
const ABSOLUTE_CONVENTIONS = new Set(["qwen2.5-vl"]);
const NORMALIZED_SCALE = 1000;
const TAGS = [
  ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>"],
  ["<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>"],
];
const NUMBER = /-?\d+(?:\.\d+)?/g;
const SEPARATOR = /^[\s,;，、]*$/;
const BOX_KEYS = ["bbox_2d", "bbox"];
const POINT_KEYS = ["point_2d"];
const LABEL_KEYS = ["label", "text_content", "name", "text"];
const LOOSE_COORDS = /["']?(bbox_2d|bbox|point_2d)["']?\s*:\s*\[([^[\]{}]*)\]/g;
const LOOSE_LABEL = /["']?(?:label|text_content|name|text)["']?\s*:\s*["']([^"'\n]*)["']/;

const escapeRegExp = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
const numbers = (s) => (s.match(NUMBER) || []).map(Number);

function findTagged(text) {
  const found = [];
  for (const [rs, re, bs, be, qs, qe] of TAGS.map((t) => t.map(escapeRegExp))) {
    const pattern = new RegExp(`${rs}([\\s\\S]*?)${re}|${bs}([\\s\\S]*?)${be}|${qs}([\\s\\S]*?)${qe}`, "g");
    let label = null;
    let attachFrom = 0; // a box right after this offset belongs to `label`
    for (const m of text.matchAll(pattern)) {
      if (m[1] !== undefined) {
        label = m[1].trim() || null;
        attachFrom = m.index + m[0].length;
        continue;
      }
      if (label !== null && !SEPARATOR.test(text.slice(attachFrom, m.index))) label = null;
      attachFrom = m.index + m[0].length;
      if (m[3] !== undefined) {
        const corners = numbers(m[3]);
        if (corners.length === 8) found.push({ label, values: corners, kind: "quad", start: m.index });
        label = null;
        continue;
      }
      const values = numbers(m[2]);
      if (values.length === 2) found.push({ label, values, kind: "point", start: m.index });
      else if (values.length && values.length % 4 === 0) {
        for (let i = 0; i < values.length; i += 4) {
          found.push({ label, values: values.slice(i, i + 4), kind: "box", start: m.index });
        }
      }
    }
  }
  return found;
}

// The end of the JSON value that opens at `pos` ("{" or "["), or -1 where it is cut short.
function jsonEnd(text, pos) {
  let depth = 0;
  let inString = false;
  for (let i = pos; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      if (c === "\\") i++;
      else if (c === '"') inString = false;
    } else if (c === '"') inString = true;
    else if (c === "{" || c === "[") depth++;
    else if (c === "}" || c === "]") {
      depth--;
      if (depth === 0) return i + 1;
    }
  }
  return -1;
}

function* objects(value) {
  if (Array.isArray(value)) for (const v of value) yield* objects(v);
  else if (value !== null && typeof value === "object") {
    yield value;
    for (const v of Object.values(value)) yield* objects(v);
  }
}

function flatNumbers(value) {
  if (!Array.isArray(value)) return null;
  const out = [];
  for (const v of value) {
    if (Array.isArray(v)) {
      const inner = flatNumbers(v);
      if (inner === null) return null;
      out.push(...inner);
    } else if (typeof v === "number") out.push(v);
    else if (typeof v === "string" && /^\s*-?\d+(?:\.\d+)?\s*$/.test(v)) out.push(Number(v));
    else return null;
  }
  return out;
}

function fromObject(obj, start) {
  for (const [keys, kind, count] of [[BOX_KEYS, "box", 4], [POINT_KEYS, "point", 2]]) {
    const key = keys.find((k) => k in obj);
    if (key === undefined) continue;
    const values = flatNumbers(obj[key]);
    if (values === null || values.length !== count || !values.every(Number.isFinite)) return null;
    const labelKey = LABEL_KEYS.find((k) => typeof obj[k] === "string");
    const label = labelKey === undefined ? null : obj[labelKey].trim() || null;
    return { label, values, kind, start };
  }
  return null;
}

function findJson(text) {
  const found = [];
  const covered = [];
  let pos = text.indexOf("{");
  while (pos >= 0) {
    const end = jsonEnd(text, pos);
    let value;
    try {
      value = end < 0 ? undefined : JSON.parse(text.slice(pos, end));
    } catch {
      value = undefined;
    }
    if (value === undefined) {
      pos = text.indexOf("{", pos + 1); // not JSON from here: an inner object may still be
      continue;
    }
    covered.push([pos, end]);
    for (const obj of objects(value)) {
      const box = fromObject(obj, pos);
      if (box !== null) found.push(box);
    }
    pos = text.indexOf("{", end);
  }
  for (const m of text.matchAll(LOOSE_COORDS)) {
    if (covered.some(([a, b]) => a <= m.index && m.index < b)) continue;
    const kind = POINT_KEYS.includes(m[1]) ? "point" : "box";
    const values = numbers(m[2]);
    if (values.length !== (kind === "point" ? 2 : 4)) continue;
    const lo = text.lastIndexOf("{", m.index) + 1;
    const hi = text.indexOf("}", m.index + m[0].length);
    const label = LOOSE_LABEL.exec(text.slice(lo, hi < 0 ? text.length : hi));
    found.push({ label: label ? label[1].trim() || null : null, values, kind, start: m.index });
  }
  return found;
}

// Every box and point written in `text`, in the order written.
function findBoxes(text) {
  return [...findTagged(text), ...findJson(text)].sort((a, b) => a.start - b.start);
}

// One box in the original picture's pixels, clamped to it: {label, kind, x1, y1, x2, y2}.
function toOriginal(raw, convention, originalSize, resizedSize) {
  const [width, height] = originalSize;
  const absolute = ABSOLUTE_CONVENTIONS.has(convention);
  const sx = absolute ? width / resizedSize[0] : width / NORMALIZED_SCALE;
  const sy = absolute ? height / resizedSize[1] : height / NORMALIZED_SCALE;
  const xs = [];
  const ys = [];
  for (let i = 0; i < raw.values.length; i += 2) {
    xs.push(raw.values[i] * sx);
    ys.push(raw.values[i + 1] * sy);
  }
  const clamp = (v, hi) => Math.min(Math.max(v, 0), hi);
  return {
    label: raw.label,
    kind: raw.kind,
    x1: clamp(Math.min(...xs), width),
    y1: clamp(Math.min(...ys), height),
    x2: clamp(Math.max(...xs), width),
    y2: clamp(Math.max(...ys), height),
  };
}

// The tagged syntax a convention's model writes (vlmserve/grounding.py's BoxTags).
const tagsOf = (convention) => (convention === "qwen-vl" ? TAGS[1] : TAGS[0]);
// Numbers as Python's f"{v:g}" writes them for coordinates (6 significant digits).
const shortNumber = (v) => String(Number(v.toPrecision(6)));

// An answer as the page shows it (vlmserve.grounding.readable, as the terminal chat prints it):
// label tags dropped (the label stays), each box or quad as " [x1,y1 - x2,y2]", a point " [x,y]",
// other special tokens dropped. Until `complete`, a box or tag still arriving is held back.
function readable(text, convention, complete) {
  const [rs, re, bs, be, qs, qe] = tagsOf(convention);
  if (!complete) {
    const opened = text.lastIndexOf("<|");
    if (opened > text.lastIndexOf("|>")) text = text.slice(0, opened);
    for (const [start, end] of [[bs, be], [qs, qe]]) {
      const open = text.lastIndexOf(start);
      if (open > text.lastIndexOf(end)) text = text.slice(0, open);
    }
    for (const tag of [rs, re, bs, be, qs, qe]) {
      let cut = 0;
      for (let n = tag.length - 1; n > 0; n--) {
        if (text.endsWith(tag.slice(0, n))) {
          cut = n;
          break;
        }
      }
      text = text.slice(0, text.length - cut);
    }
  }
  text = text.split(rs).join("").split(re).join("");
  const [b1, b2, q1, q2] = [bs, be, qs, qe].map(escapeRegExp);
  text = text.replace(new RegExp(`${b1}([\\s\\S]*?)${b2}|${q1}([\\s\\S]*?)${q2}`, "g"), (m, box, quad) => {
    const values = numbers(box !== undefined ? box : quad).map(shortNumber);
    const pairs = [];
    for (let i = 0; i < values.length; i += 2) pairs.push(values.slice(i, i + 2).join(","));
    return ` [${pairs.join(" - ")}]`;
  });
  return text.replace(/<\|[a-z_]+\|>/g, "");
}

function parseBoxes(text, convention, originalSize, resizedSize) {
  return findBoxes(text).map((raw) => toOriginal(raw, convention, originalSize, resizedSize));
}

// A figure of the picture with each box drawn over it, placed in percent of the original size
// (so it stays on the same pixels however large the picture is shown).
function boxesFigure(media, boxes, originalSize) {
  const [width, height] = originalSize;
  const figure = document.createElement("figure");
  figure.className = "grounding";
  const overlay = document.createElement("div");
  overlay.className = "overlay";
  const img = document.createElement("img");
  img.src = media.objectUrl;
  img.alt = media.name;
  overlay.append(img);
  for (const box of boxes) {
    const el = document.createElement("div");
    el.className = box.kind === "point" ? "box point" : "box";
    for (const k of ["x1", "y1", "x2", "y2"]) el.dataset[k] = String(box[k]);
    el.style.left = `${(100 * box.x1) / width}%`;
    el.style.top = `${(100 * box.y1) / height}%`;
    if (box.kind !== "point") {
      el.style.width = `${(100 * (box.x2 - box.x1)) / width}%`;
      el.style.height = `${(100 * (box.y2 - box.y1)) / height}%`;
    }
    if (box.label) {
      const tag = document.createElement("span");
      tag.textContent = box.label;
      el.append(tag);
    }
    overlay.append(el);
  }
  const caption = document.createElement("figcaption");
  const f = (v) => Math.round(v);
  caption.textContent = boxes
    .map((b) => `${b.label || "(no label)"}: (${f(b.x1)}, ${f(b.y1)})-(${f(b.x2)}, ${f(b.y2)})`)
    .join("; ");
  caption.textContent += ` — in the picture's ${width}×${height} pixels`;
  figure.append(overlay, caption);
  return figure;
}

// -- the conversation -----------------------------------------------------------------------------

function addMessage(role) {
  const welcome = $("welcome");
  if (welcome) welcome.remove();
  const el = document.createElement("div");
  el.className = `message ${role}`;
  $("chat").append(el);
  return el;
}

function mediaElement(media) {
  const el = document.createElement(media.kind === "image" ? "img" : "video");
  el.src = media.objectUrl;
  if (media.kind === "video") el.controls = true;
  else el.alt = media.name;
  return el;
}

function showUserMessage(entry) {
  const el = addMessage("user");
  if (entry.media.length) {
    const row = document.createElement("div");
    row.className = "media";
    for (const media of entry.media) {
      const figure = document.createElement("figure");
      figure.className = "media-item";
      media.caption = document.createElement("figcaption");
      media.caption.textContent = media.name;
      media.figure = figure;
      figure.append(mediaElement(media), media.caption);
      row.append(figure);
    }
    el.append(row);
  }
  const text = document.createElement("div");
  text.className = "text";
  text.textContent = entry.text;
  el.append(text);
  scrollDown();
}

// The empty conversation says what the model can be asked: its example questions (the server's,
// from GET v1/models), each a button that puts it in the prompt box.
function showWelcome() {
  if (state.history.length || $("welcome")) return;
  const info = (state.card && state.card.vlmserve) || {};
  const el = document.createElement("div");
  el.id = "welcome";
  const title = document.createElement("h2");
  title.textContent = `Ask ${info.family || state.model || "the model"} about a picture`;
  el.append(title);
  if (info.about) {
    const about = document.createElement("p");
    about.textContent = info.about;
    el.append(about);
  }
  const how = document.createElement("p");
  how.textContent =
    "Attach a picture or a video with +, paste one or drop it anywhere on the page, then ask." +
    (info.grounding_convention ? " Boxes in an answer are drawn on the picture." : "");
  el.append(how);
  const questions = document.createElement("div");
  questions.className = "examples";
  for (const question of info.example_questions || []) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = question;
    button.addEventListener("click", () => {
      $("prompt").value = question;
      $("prompt").focus();
    });
    questions.append(button);
  }
  el.append(questions);
  $("chat").append(el);
}

function scrollDown() {
  const chat = $("chat");
  chat.scrollTop = chat.scrollHeight;
}

function apiMessages() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const entry of state.history) {
    if (entry.role === "assistant") {
      messages.push({ role: "assistant", content: entry.text });
      continue;
    }
    const content = entry.media.map((m) =>
      m.kind === "image"
        ? { type: "image_url", image_url: { url: m.dataUrl } }
        : { type: "video_url", video_url: { url: m.dataUrl } },
    );
    if (entry.text) content.push({ type: "text", text: entry.text });
    messages.push({ role: "user", content });
  }
  return messages;
}

function requestBody() {
  const body = { model: state.model, messages: apiMessages(), stream: true, stream_options: { include_usage: true } };
  for (const [name, parse] of NUMBER_SETTINGS) {
    const raw = $(name).value.trim();
    if (raw !== "") body[name] = parse(raw);
  }
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  body.skip_special_tokens = !$("keep_special").checked;
  const regex = $("regex").value;
  if (regex) body.structured_outputs = { regex };
  return body;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value;
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch {
    // not JSON: the status says enough
  }
  return `${response.status} ${response.statusText}`;
}

// Calls onEvent with each server-sent event's JSON until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// Each picture's and video's placeholder tokens (usage.multimodal_tokens, in prompt order).
function showTokens(items) {
  const media = state.history.filter((e) => e.role === "user").flatMap((e) => e.media);
  items.forEach((item, i) => {
    const m = media[i];
    if (!m || !m.caption) return;
    const [ow, oh] = item.original_size;
    const [rw, rh] = item.resized_size;
    m.figure.dataset.tokens = String(item.tokens);
    m.caption.textContent = `${item.tokens} tokens · ${ow}×${oh}` + (ow !== rw || oh !== rh ? ` → ${rw}×${rh}` : "");
  });
}

// Boxes in the answer are drawn on the conversation's latest picture.
function showBoxes(el, text, extension) {
  if (!extension || !extension.grounding_convention) return;
  const media = state.history.filter((e) => e.role === "user").flatMap((e) => e.media);
  const index = media.map((m) => m.kind).lastIndexOf("image");
  const item = extension.mm_items[index];
  if (index < 0 || !item) return;
  const boxes = parseBoxes(text, extension.grounding_convention, item.original_size, item.resized_size);
  if (boxes.length) el.append(boxesFigure(media[index], boxes, item.original_size));
}

async function send() {
  const text = $("prompt").value.trim();
  if (state.controller || (!text && !state.pending.length)) return;
  if (!state.model) await loadModel();
  const entry = { role: "user", text, media: state.pending.splice(0) };
  showPending();
  $("prompt").value = "";
  state.history.push(entry);
  showUserMessage(entry);

  const userEl = $("chat").lastElementChild;
  const answer = { role: "assistant", text: "" };
  const el = addMessage("assistant");
  el.dataset.state = "streaming";
  const textEl = document.createElement("div");
  textEl.className = "text";
  const meta = document.createElement("div");
  meta.className = "meta";
  el.append(textEl, meta);
  let extension = null;
  let usage = null;
  let finish = null;
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody()),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      if (chunk.vlmserve) extension = chunk.vlmserve;
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer.text += choice.delta.content;
          textEl.textContent = readable(answer.text, convention(extension), false);
          scrollDown();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
    el.dataset.state = "done";
  } catch (e) {
    const stopped = e.name === "AbortError";
    el.dataset.state = stopped ? "stopped" : "error";
    if (!stopped) el.classList.add("error");
    meta.textContent = stopped ? "stopped" : String(e.message || e);
  } finally {
    state.controller = null;
    setBusy(false);
  }
  textEl.textContent = readable(answer.text, convention(extension), true);
  el.dataset.text = answer.text;
  if (el.dataset.state !== "done") {
    // As the terminal chat does: a turn that failed or was stopped is left out of the conversation
    // sent next; a failed one's words and pictures go back in the prompt box to be sent again.
    state.history.splice(state.history.indexOf(entry), 1);
    for (const message of [userEl, el]) message.classList.add("left-out");
    meta.textContent += " · left out of the conversation";
    if (el.dataset.state === "error" && !$("prompt").value && !state.pending.length) {
      $("prompt").value = entry.text;
      state.pending.push(...entry.media);
      showPending();
    }
    scrollDown();
    return;
  }
  state.history.push(answer);
  if (usage) {
    showTokens(usage.multimodal_tokens || []);
    const parts = [`${usage.prompt_tokens} prompt + ${usage.completion_tokens} answer tokens`];
    if (finish) parts.push(`finish: ${finish}`);
    meta.textContent = parts.join(" · ");
  }
  showBoxes(el, answer.text, extension);
  scrollDown();
}

// The answer's box convention: the response's, else the model's (GET v1/models).
function convention(extension) {
  if (extension && extension.grounding_convention) return extension.grounding_convention;
  return state.card && state.card.vlmserve ? state.card.vlmserve.grounding_convention : null;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop-button").hidden = !busy;
  $("status").textContent = busy ? "answering…" : "";
}

// -- attachments ----------------------------------------------------------------------------------

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const file of files) {
    const kind = file.type.startsWith("image/") ? "image" : file.type.startsWith("video/") ? "video" : null;
    if (kind === null) {
      $("status").textContent = `${file.name || "that file"} is neither a picture nor a video`;
      continue;
    }
    const dataUrl = await readDataUrl(file);
    state.pending.push({ kind, name: file.name || kind, dataUrl, objectUrl: URL.createObjectURL(file) });
  }
  showPending();
}

function showPending() {
  const box = $("attachments");
  box.replaceChildren();
  state.pending.forEach((media, i) => {
    const el = document.createElement("div");
    el.className = "pending";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "remove";
    remove.addEventListener("click", () => {
      state.pending.splice(i, 1);
      showPending();
    });
    el.append(mediaElement(media), remove);
    box.append(el);
  });
}

// -- settings, key, model -------------------------------------------------------------------------

async function loadModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) {
      $("status").textContent = response.status === 401 ? "this server needs its API key" : await errorText(response);
      return;
    }
    const models = await response.json();
    state.card = models.data[0];
    state.model = state.card.id;
    $("model").textContent = state.model;
    $("status").textContent = "";
    const welcome = $("welcome");
    if (welcome) welcome.remove();
    showWelcome();
  } catch (e) {
    $("status").textContent = `cannot reach the server: ${e.message || e}`;
  }
}

function saveSettings() {
  const saved = {};
  for (const [name] of NUMBER_SETTINGS) saved[name] = $(name).value;
  for (const name of TEXT_SETTINGS) saved[name] = $(name).value;
  saved.keep_special = $("keep_special").checked;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(saved));
}

function restoreSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
  } catch {
    saved = {};
  }
  for (const [name] of NUMBER_SETTINGS) if (typeof saved[name] === "string") $(name).value = saved[name];
  for (const name of TEXT_SETTINGS) if (typeof saved[name] === "string") $(name).value = saved[name];
  if (typeof saved.keep_special === "boolean") $("keep_special").checked = saved.keep_special;
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
}

function init() {
  restoreSettings();
  $("settings").addEventListener("change", saveSettings);
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value);
    loadModel();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    $("chat").replaceChildren();
    showWelcome();
  });
  $("settings-toggle").addEventListener("click", () => document.body.classList.toggle("show-settings"));
  $("file").addEventListener("change", async (e) => {
    await attach([...e.target.files]);
    e.target.value = "";
  });
  document.addEventListener("paste", (e) => {
    const files = [...((e.clipboardData && e.clipboardData.files) || [])];
    if (files.length) {
      e.preventDefault();
      attach(files);
    }
  });
  let dragDepth = 0;
  document.addEventListener("dragenter", (e) => {
    e.preventDefault();
    dragDepth++;
    $("drop-hint").hidden = false;
  });
  document.addEventListener("dragover", (e) => e.preventDefault());
  document.addEventListener("dragleave", () => {
    dragDepth = Math.max(0, dragDepth - 1);
    if (dragDepth === 0) $("drop-hint").hidden = true;
  });
  document.addEventListener("drop", (e) => {
    e.preventDefault();
    dragDepth = 0;
    $("drop-hint").hidden = true;
    attach([...((e.dataTransfer && e.dataTransfer.files) || [])]);
  });
  loadModel();
}

init();

// The anatomist page: a form generated from the server's schema (the Recipe dataclass's fields and the
// plan's options), its state kept in the URL query, jobs polled while a cold trace runs, the answer drawn
// from the same JSON the CLI prints with --json. No framework, nothing loaded from elsewhere.
"use strict";

const GIB = 2 ** 30;
const POLL_MS = 250;
const state = { schema: null, job: null, timer: null, uploads: {}, pick: 0 };

const $ = (selector, root = document) => root.querySelector(selector);
const $$ = (selector, root = document) => Array.from(root.querySelectorAll(selector));

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const gib = (bytes) => `${(bytes / GIB).toFixed(2)} GiB`;
const pct = (x) => `${(100 * x).toFixed(0)}%`;
const num = (x, digits = 1) => x.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });

class ApiError extends Error {
  constructor(message, body) { super(message); this.body = body; }
}

async function api(path, options = {}) {
  const init = { ...options, headers: { "content-type": "application/json" } };
  const response = await fetch(path, init);
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok) {
    throw new ApiError((body && body.error) || `${response.status} ${response.statusText}`, body);
  }
  return body;
}

// ---- the form ----------------------------------------------------------------------------------
// The question comes first (model, GPU, method, trainer, length, batch, GPUs, nodes), then the button; every
// other option is under "advanced", in the groups of the CLI's --help. Labels are words; the field's name (the
// TrainingArguments name, the URL's key) and its help are its tooltip.

function view() { return $("input[name=view]:checked").value; }

function fieldId(field) {
  return field.views.length === 1 ? `f-${field.views[0]}-${field.name}` : `f-${field.name}`;
}

function defaultText(field) {
  const d = field.default;
  // unset: a choice the model settles (its attention); a switch the recipe settles (fp8_all_gather: on under FSDP)
  if (d === null || d === undefined) return field.kind === "choice" ? "by the model" : field.kind === "bool" ? "auto" : "";
  if (field.kind === "bool") return d ? "on" : "off";
  if (field.kind === "choice" && field.choice_labels) return field.choice_labels[field.choices.indexOf(d)] ?? String(d);
  return Array.isArray(d) ? d.join(", ") : String(d);
}

function choiceText(field, i) {
  return field.choice_labels ? field.choice_labels[i] : String(field.choices[i]);
}

function buildInput(field) {
  const id = fieldId(field);
  const common = { id, name: field.name, "data-name": field.name, "data-kind": field.kind };
  switch (field.kind) {
    case "bool":
      return el("select", common, el("option", { value: "", text: `${defaultText(field)} (default)` }),
        el("option", { value: "true", text: "on" }), el("option", { value: "false", text: "off" }));
    case "choice":
      return el("select", common, el("option", { value: "", text: `${defaultText(field)} (default)` }),
        field.choices.map((c, i) => el("option", { value: String(c), text: choiceText(field, i) })));
    case "flag":
      return el("input", { ...common, type: "checkbox" });
    case "multi": {
      const defaults = new Set((field.default || []).map(String));
      return el("span", { ...common, class: "multi", role: "group", "aria-label": field.label },
        field.choices.map((c, i) => el("label", {}, el("input", {
          type: "checkbox", value: String(c), checked: defaults.has(String(c)), "data-default": defaults.has(String(c)) ? "1" : "0",
        }), ` ${choiceText(field, i)}`)));
    }
    case "upload":
      return el("span", { ...common, class: "upload" },
        el("input", { type: "file", accept: field.name === "lengths" ? ".txt,.json,.csv" : ".json,.yaml,.yml",
          id: `${id}-file`, "aria-label": field.label }),
        el("span", { class: "upload-name", id: `${id}-name` }),
        el("button", { type: "button", class: "link", id: `${id}-clear`, hidden: true, text: "remove" }));
    default: {
      const numeric = field.kind === "int" || field.kind === "float";
      const list = field.name === "model" ? "model-list" : field.name === "gpu" ? "gpu-list" : null;
      return el("input", { ...common, type: "text", list, inputmode: numeric ? (field.kind === "int" ? "numeric" : "decimal") : null,
        placeholder: defaultText(field), spellcheck: "false" });
    }
  }
}

function tooltip(field) {
  const limits = [field.minimum !== null ? `at least ${field.minimum}` : null,
    field.maximum !== null ? `${field.below_maximum ? "below" : "at most"} ${field.maximum.toLocaleString("en-US")}` : null]
    .filter(Boolean).join(", ");
  return `${field.name}${field.flag ? ` (${field.flag})` : ""}: ${field.help}${limits ? ` Takes ${limits}.` : ""}`;
}

function buildField(field) {
  const question = field.group === "question";
  return el("div", { class: `field field-${field.kind}`, "data-views": field.views.join(" "), "data-field": field.name,
    title: tooltip(field) },
    el("label", { for: fieldId(field) }, field.label, question ? null : el("code", { class: "name", text: field.name })),
    buildInput(field),
    question ? null : el("small", { class: "help", text: field.help }));
}

function buildForm(schema) {
  const groups = new Map();
  for (const field of schema.fields) {
    if (field.group === "question") { $("#question").append(buildField(field)); continue; }
    if (!groups.has(field.group)) {
      const box = el("div", { class: "group-fields" });
      $("#groups").append(el("details", { class: "group", "data-group": field.group }, el("summary", { text: field.group }), box));
      groups.set(field.group, box);
    }
    groups.get(field.group).append(buildField(field));
  }
  $("#model-list").replaceChildren(...schema.models.map((m) => el("option", { value: m.name, label: m.about })));
  $("#gpu-list").replaceChildren(...schema.gpus.map((g) =>
    el("option", { value: g.name, label: `${gib(g.memory_bytes)}${g.aliases.length ? ", " + g.aliases.join(", ") : ""}` })));
  for (const field of schema.fields.filter((f) => f.kind === "upload")) {
    const id = fieldId(field);
    $(`#${id}-file`).addEventListener("change", (event) => upload(field.name, id, event.target));
    $(`#${id}-clear`).addEventListener("click", () => setUpload(field.name, id, null));
  }
  showView();
}

function showView() {
  const current = view();
  for (const node of $$("[data-views]")) node.hidden = !node.dataset.views.split(" ").includes(current);
  for (const box of $$("details.group")) box.hidden = !$$(".field", box).some((f) => !f.hidden);
  $("#run").textContent = current === "plan" ? "Plan" : "Estimate";
  const prompt = $("#answer .empty strong");
  if (prompt) prompt.textContent = $("#run").textContent;
}

function fieldsOfView() {
  return state.schema.fields.filter((f) => f.views.includes(view()));
}

function readForm() {
  const params = { view: view() };
  for (const field of fieldsOfView()) {
    const input = document.getElementById(fieldId(field));
    let value = "";
    if (field.kind === "flag") value = input.checked ? "true" : "";
    else if (field.kind === "multi") {
      const boxes = $$("input[type=checkbox]", input);
      const changed = boxes.some((b) => b.checked !== (b.dataset.default === "1"));
      value = changed ? boxes.filter((b) => b.checked).map((b) => b.value).join(",") : "";  // none ticked: the default
    } else if (field.kind === "upload") value = state.uploads[field.name] ? state.uploads[field.name].id : "";
    else value = input.value.trim();
    if (value !== "") params[field.name] = value;
  }
  return params;
}

function writeForm(params) {
  const wanted = params.view === "plan" ? "plan" : "estimate";
  $(`input[name=view][value=${wanted}]`).checked = true;
  showView();
  let advanced = false;
  for (const group of $$("details.group")) group.open = false;
  for (const field of fieldsOfView()) {
    const input = document.getElementById(fieldId(field));
    const value = params[field.name] ?? "";
    if (value !== "" && field.group !== "question") {  // a link that sets an advanced option shows its group
      advanced = true;
      input.closest("details.group").open = true;
    }
    if (field.kind === "flag") input.checked = value === "true";
    else if (field.kind === "multi") {
      const chosen = value === "" ? null : new Set(value.split(","));
      for (const box of $$("input[type=checkbox]", input)) box.checked = chosen ? chosen.has(box.value) : box.dataset.default === "1";
    } else if (field.kind === "upload") setUpload(field.name, fieldId(field), value ? { id: value, name: null } : null);
    else input.value = value;
  }
  $("#advanced").open = advanced;
}

function setUpload(kind, id, upload) {
  state.uploads[kind] = upload;
  $(`#${id}-name`).textContent = upload ? (upload.name || `uploaded file ${upload.id.slice(0, 8)}`) : "";
  $(`#${id}-clear`).hidden = !upload;
  if (!upload) $(`#${id}-file`).value = "";
  if (upload && !upload.name) {
    api(`/api/uploads/${upload.id}`).then((info) => {
      if (state.uploads[kind] && state.uploads[kind].id === info.id) $(`#${id}-name`).textContent = info.name;
    }).catch((error) => showError(error.message));
  }
}

async function upload(kind, id, input) {
  const file = input.files[0];
  if (!file) return;
  clearError();
  if (file.size > state.schema.max_upload_bytes) {
    showError(`${file.name} is ${(file.size / 1024).toFixed(0)} KiB; uploads are limited to ${state.schema.max_upload_bytes / 1024} KiB`);
    input.value = "";
    return;
  }
  try {
    const text = await file.text();
    const answer = await api("/api/uploads", { method: "POST", body: JSON.stringify({ kind, name: file.name, text }) });
    setUpload(kind, id, answer);
    if (kind === "config") $("#f-model").value = "";
  } catch (error) {
    setUpload(kind, id, null);
    showError(error.message);
  }
}

function toQuery(params) {
  return "?" + new URLSearchParams(params).toString();
}

function fromQuery(search) {
  return Object.fromEntries(new URLSearchParams(search).entries());
}

// ---- jobs -------------------------------------------------------------------------------------

async function run(params, { push = true } = {}) {
  clearTimeout(state.timer);
  clearError();
  if (push && toQuery(params) !== location.search) history.pushState(params, "", toQuery(params));
  showStatus("sending…", null);
  try {
    follow(await api("/api/run", { method: "POST", body: JSON.stringify(params) }));
  } catch (error) {
    hideStatus();
    showError(error.message, error.body && error.body.field);
  }
}

function follow(job) {
  state.job = job.id;
  if (job.status === "done") {
    hideStatus();
    render(job);
    return;
  }
  if (job.status === "queued") showStatus(`waiting for the request before this one (${num(job.waited_s, 0)} s)`, null);
  else if (job.to_trace) showStatus(`tracing step parts: ${job.traced} of ${job.to_trace} (${num(job.elapsed_s, 0)} s)`, job.traced / job.to_trace);
  else showStatus(`computing (${num(job.elapsed_s, 0)} s): a model seen for the first time is traced, which takes seconds to a minute`, null);
  state.timer = setTimeout(() => poll(job.id), POLL_MS);
}

async function poll(id) {
  if (id !== state.job) return;
  try {
    const job = await api(`/api/jobs/${id}`);
    if (id === state.job) follow(job);
  } catch (error) {
    if (id !== state.job) return;
    hideStatus();
    showError(error.message);
  }
}

function showStatus(text, fraction) {
  $("#status").hidden = false;
  $("#status-text").textContent = text;
  const bar = $("#status-bar");
  if (fraction === null) bar.removeAttribute("value");
  else bar.value = fraction;
  $("#answer").classList.add("stale");
}

function hideStatus() {
  $("#status").hidden = true;
  $("#answer").classList.remove("stale");
}

function showError(message, field = null) {
  const box = $("#error");
  box.textContent = message;
  box.hidden = false;
  if (!field) return;
  const wrapper = $$(`.field[data-field="${field}"]`).find((f) => !f.hidden);
  if (!wrapper) return;
  wrapper.classList.add("invalid");
  if (wrapper.closest("#advanced")) {
    $("#advanced").open = true;
    wrapper.closest("details.group").open = true;
  }
  const input = $("input, select", wrapper);
  if (input) input.setAttribute("aria-invalid", "true");
}

function clearError() {
  $("#error").hidden = true;
  $("#error").textContent = "";
  for (const f of $$(".field.invalid")) f.classList.remove("invalid");
  for (const i of $$("[aria-invalid]")) i.removeAttribute("aria-invalid");
}

// ---- the answer -------------------------------------------------------------------------------

function render(job) {
  const v = job.view;
  state.pick = v.picks.findIndex((p) => p.best);
  if (state.pick < 0) state.pick = 0;
  const body = v.kind === "plan" ? renderPlan(job, v) : renderEstimate(job, v);
  $("#answer").replaceChildren(body, renderFiles(job, v), renderShare(v));
}

function chart(job, name, alt) {
  return el("img", { class: "chart", src: `/api/jobs/${job.id}/charts/${name}.png`, alt, "data-chart": name });
}

function notesList(id, notes) {
  if (!notes.length) return null;
  return el("ul", { id, class: "notes" }, notes.map((n) => el("li", { text: n })));
}

function renderEstimate(job, v) {
  const r = v.result;
  const recipe = r.recipe;
  const peft = recipe.peft !== "none" ? `, ${recipe.peft} (r=${recipe.lora_r})` : "";
  const autocast = recipe.fp16 ? " + fp16 autocast" : recipe.bf16 ? " + bf16 autocast" : "";
  const mem = r.memory;
  const devices = r.nodes > 1 ? `${r.nodes} nodes x ${r.num_gpus / r.nodes}` : String(r.num_gpus);
  const table = el("div", { class: "scroll" }, el("table", { id: "table-anatomy" },
    el("thead", {}, el("tr", {}, el("th", { text: "component" }), el("th", { class: "num", text: "predicted" }),
      el("th", { class: "num", text: "share" }),
      el("th", { text: "bytes/param rule", title: v.rule_source }))),
    el("tbody", {}, v.anatomy.map((row) => el("tr", { "data-key": row.key },
      el("td", { title: row.description }, el("span", { class: "swatch", "data-category": row.key }), row.label),
      el("td", { class: "num", "data-key": row.key, "data-value": String(row.bytes), text: gib(row.bytes) }),
      el("td", { class: "num", text: pct(row.share) }),
      el("td", { class: "rule", text: row.rule })))),
    el("tfoot", {}, el("tr", {}, el("th", { text: "device total (nvidia-smi)" }),
      el("th", { class: "num", "data-key": "device_total", "data-value": String(mem.device_total), text: gib(mem.device_total) }),
      el("th", {}), el("th", {})))));
  for (const swatch of $$(".swatch", table)) {
    const category = state.schema.categories.find((c) => c.key === swatch.dataset.category);
    swatch.style.background = category ? category.colour : "#999";
  }
  const verdictClass = { fits: "fits", "does not fit": "no-fit" }[r.verdict] || "borderline";
  const likely = mem.interval ? ` (likely ${gib(mem.interval.low)} to ${gib(mem.interval.high)})` : "";
  return el("article", { id: "estimate" },
    el("h2", { id: "summary", text: `${r.model} (${r.task}, ${num(r.parameters / 1e6)} M parameters), seq ${r.seq_len}, ` +
      `batch ${recipe.per_device_train_batch_size} x ${recipe.gradient_accumulation_steps} accumulation, ` +
      `weights ${recipe.dtype}${autocast}${peft}, ${r.mode} on ${devices} x ${r.gpu.name} (${gib(r.gpu.memory_bytes)})` }),
    el("p", { id: "verdict", class: verdictClass, "data-fits": String(r.fits), "data-verdict": v.verdict,
      "data-max-batch": String(r.max_batch_size) },
      el("strong", { text: v.verdict }),
      `: ${gib(mem.device_total)}${likely} on the device at the peak, of ${gib(r.limit_bytes)} usable (${gib(r.gpu.memory_bytes)} less the ` +
      `${pct(r.memory_margin)} margin). Peak in `, el("strong", { id: "peak-phase", text: mem.peak_phase }),
      `: allocated ${gib(mem.peak_allocated)}, reserved ${gib(mem.peak_reserved)}. Largest batch that fits: `,
      el("strong", { id: "max-batch", text: v.largest_batch }), "."),
    mem.interval ? el("p", { id: "interval", class: mem.interval.validated ? "interval" : "interval unvalidated",
      text: `Memory interval: ${mem.interval.basis}.` }) : null,
    v.longest ? el("p", { id: "longest", class: "longest", text: v.longest }) : null,
    v.change ? el("p", { id: "change", class: "change", text: v.change }) : null,
    chart(job, "memory", "Memory anatomy of the step's peak, by component, against the GPU's capacity and the usable limit"),
    table,
    el("p", { class: "rule-note", text: `bytes/param rule: ${v.rule_source}.` }),
    notesList("notes", [...r.notes, ...v.messages]),
    r.time ? renderTime(r.time) : el("p", { text: "Inference: no time prediction (training steps only)." }));
}

function bars(id, parts, total) {
  return el("div", { id, class: "bars" }, Object.entries(parts).filter(([, s]) => s > 0).map(([name, s]) =>
    el("div", { class: "bar-row" }, el("span", { class: "bar-label", text: name }),
      el("span", { class: "bar" }, el("span", { class: "bar-fill", "data-share": String(s / total) })),
      el("span", { class: "bar-value", text: `${num(s * 1e3)} ms (${pct(s / total)})` }))));
}

function renderTime(t) {
  const section = el("section", { id: "time" },
    el("h3", { text: "Time anatomy of one step (roofline)" }),
    el("div", { class: "scroll" }, el("table", { id: "table-time" },
      el("thead", {}, el("tr", {}, ["step time", "samples/s", "tokens/s", "TFLOP/s", "MFU", "HFU"].map((h) => el("th", { text: h })))),
      el("tbody", {}, el("tr", {},
        el("td", { class: "num", "data-key": "step_s", "data-value": String(t.step_s), text: `${num(t.step_s * 1e3)} ms` +
          (t.interval ? `, likely ${num(t.interval.low * 1e3)} to ${num(t.interval.high * 1e3)} ms` : "") }),
        el("td", { class: "num", "data-key": "samples_per_second", "data-value": String(t.samples_per_second), text: num(t.samples_per_second) }),
        el("td", { class: "num", text: num(t.tokens_per_second, 0) }),
        el("td", { class: "num", text: num(t.flops_per_step / t.step_s / 1e12) }),
        el("td", { class: "num", text: pct(t.mfu) }),
        el("td", { class: "num", text: pct(t.hfu) }))))),
    el("h4", { text: "by phase" }), bars("phases", t.phases_s, t.step_s),
    el("h4", { text: "by operation class" }), bars("classes", t.classes_s, t.step_s),
    el("p", { id: "calibration", class: t.calibrated ? "rule-note" : "warning", text: t.calibration }),
    t.interval ? el("p", { id: "time-interval", class: t.interval.validated ? "interval" : "interval unvalidated",
      text: `Time interval: ${t.interval.basis}.` }) : null);
  for (const fill of $$(".bar-fill", section)) fill.style.width = pct(Number(fill.dataset.share));
  return section;
}

function renderPlan(job, v) {
  const r = v.result;
  const devices = r.nodes > 1 ? `${r.nodes} nodes x ${r.num_gpus / r.nodes}` : String(r.num_gpus);
  const table = el("div", { class: "scroll" }, el("table", { id: "table-pareto" },
    el("thead", {}, el("tr", {}, el("th", {}), v.columns.map((c) => el("th", { "data-key": c.key, text: c.header })),
      el("th", { class: "num", text: "device memory" }), el("th", { class: "num", text: "samples/s" }))),
    el("tbody", {}, v.picks.map((p, i) => el("tr", { "data-pick": String(i), "data-label": p.label, class: p.best ? "best" : "" },
      el("td", {}, el("input", { type: "radio", name: "pick", value: String(i), checked: i === state.pick,
        "aria-label": `pick ${p.label}`, onchange: () => selectPick(job, v, i) })),
      v.columns.map((c, k) => el("td", { "data-key": c.key, text: p.cells[c.key] + (p.best && k === 0 ? " (top pick)" : "") })),
      el("td", { class: "num", "data-key": "device_total", "data-value": String(p.device_total), text: gib(p.device_total) }),
      el("td", { class: "num", "data-key": "samples_per_second", "data-value": String(p.samples_per_second), text: num(p.samples_per_second) }))))));
  return el("article", { id: "plan" },
    el("h2", { id: "summary", text: `${r.model} seq ${r.seq_len} on ${devices} x ${r.gpu.name} (${gib(r.gpu.memory_bytes)}), ` +
      `global batch ${r.global_batch_size || "any"}, objective ${r.objective}: ${r.candidates} candidates, ${r.feasible} fit` }),
    chart(job, "throughput", "Throughput against peak device memory of every Pareto recipe"),
    el("h3", { text: "Pareto front (throughput vs peak device memory)" }),
    table,
    v.shared ? el("p", { id: "shared", class: "rule-note", text: `Every recipe above: ${v.shared}.` }) : null,
    el("div", { id: "pick" }, renderPick(v)),
    chart(job, "memory", "Memory anatomy of each Pareto recipe, against the GPU's capacity and the usable limit"),
    notesList("notes", [...r.notes, ...v.messages]));
}

function renderPick(v) {
  const p = v.picks[state.pick];
  return el("div", {},
    el("h3", { text: p.best ? "Top pick" : `Pick: ${p.label}` }),
    el("p", { id: "pick-summary", text: `${p.summary}: ${gib(p.device_total)} of limit ${gib(v.result.limit_bytes)}, ` +
      `${num(p.samples_per_second)} samples/s predicted` }),
    el("ul", { id: "reasons" }, p.reasons.map((reason) => el("li", { text: reason }))));
}

function selectPick(job, v, i) {
  state.pick = i;
  $("#pick").replaceChildren(renderPick(v));
  $("#files").replaceWith(renderFiles(job, v));
}

function renderFiles(job, v) {
  const what = v.kind === "plan" ? (v.picks[state.pick].best ? "the top pick" : v.picks[state.pick].label) : "this recipe";
  const list = el("div", { id: "file-list" });
  return el("section", { id: "files" },
    el("h3", { text: `Files to train ${what}` }),
    el("div", { class: "targets" }, state.schema.targets.map((t) => el("button", {
      type: "button", "data-target": t.name, text: t.name, onclick: () => listFiles(job, t.name, list) }))),
    list);
}

async function listFiles(job, target, list) {
  try {
    const answer = await api(`/api/jobs/${job.id}/files/${state.pick}/${target}`);
    list.replaceChildren(el("p", {}, "Download: ", answer.files.map((f, i) => [i ? ", " : "",
      el("a", { href: f.url, download: f.name, "data-file": f.name, text: f.name })])),
    el("pre", { class: "file" }, answer.files[0].text));
  } catch (error) {
    showError(error.message);
  }
}

function renderShare(v) {
  const link = el("input", { id: "share-link", readonly: true, value: location.href, "aria-label": "link to this view" });
  return el("section", { id: "share" },
    el("p", {}, "Same as: ", el("code", { id: "command", text: v.command })),
    el("p", {}, "Link to this view: ", link, " ", el("button", { type: "button", text: "copy", onclick: () => {
      link.select();
      if (navigator.clipboard) navigator.clipboard.writeText(link.value).catch(() => document.execCommand("copy"));
      else document.execCommand("copy");
    } })));
}

// ---- start ------------------------------------------------------------------------------------

async function start() {
  try {
    state.schema = await api("/api/schema");
  } catch (error) {
    showError(`the page could not load its form: ${error.message}`);
    return;
  }
  buildForm(state.schema);
  for (const radio of $$("input[name=view]")) radio.addEventListener("change", showView);
  $("#form").addEventListener("submit", (event) => { event.preventDefault(); run(readForm()); });
  $("#reset").addEventListener("click", () => { writeForm({ view: view() }); history.pushState({}, "", location.pathname); });
  window.addEventListener("popstate", () => {
    const params = fromQuery(location.search);
    writeForm(params);
    if (Object.keys(params).length) run(params, { push: false });
  });
  const params = fromQuery(location.search);
  if (Object.keys(params).length) {
    writeForm(params);
    run(params, { push: false });
  }
  document.body.dataset.ready = "1";
}

start();

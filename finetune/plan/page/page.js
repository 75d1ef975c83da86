// finetune plan's page: form fields -> POST /api/plan (debounced) -> ranked plans, bars, launch command, files.
// Served by `finetune plan --serve`; inlined with one answer (window.PLAN_DATA) by `finetune plan --html`.
"use strict";

const TERMS = ["weights", "gradients", "optimizer", "activations", "buffers"];
const PASTE = "__paste__";  // the model menu's "paste config.json" entry; never sent
const DEBOUNCE_MS = 250;
const form = document.getElementById("form");
const resultBox = document.getElementById("result");
const statusLine = document.getElementById("status");
let catalog = window.PLAN_CATALOG || null;
let lastData = null;
let selected = 0;
let timer = null;
let inFlight = null;

// --- small DOM helpers ---
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "class") node.className = value;
    else if (key === "width") node.style.width = value;
    else if (key === "left") node.style.left = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}
const fmt = (value, digits = 0) => value === null || value === undefined ? "–"
  : value.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
const label = (strategy) => (catalog && catalog.strategy_labels[strategy]) || strategy;
const describe = (p) => `${p.method} ${label(p.strategy)}${p.offload === "none" ? "" : ` + ${p.offload} offload`}`;

// --- the form and the URL ---
function fillMenus() {
  const add = (select, values) => values.forEach((v) => select.append(el("option", {value: v.value}, v.text)));
  add(form.model, catalog.models.map((m) => ({value: m.name, text: `${m.name} (${m.params_b}B)`})));
  add(form.model, [{value: PASTE, text: "paste a config.json…"}]);
  add(form.gpu, catalog.gpus.map((g) => ({value: g.name, text: `${g.name} (${g.memory_gib} GiB)`})));
  const byMemory = el("optgroup", {label: "any card, by its memory (speed as the nearest catalog card's)"});
  byMemory.append(...catalog.memory_sizes.map((gib) => el("option", {value: `${gib}GB`}, `${gib} GiB card`)));
  form.gpu.append(byMemory);
  for (const select of form.querySelectorAll("select[data-choices]")) {
    add(select, catalog.choices[select.dataset.choices].map((c) => ({value: c, text: c})));
  }
}

function fields() {
  const out = {};
  for (const input of form.querySelectorAll("input[name], select[name], textarea[name]")) {
    const value = input.value.trim();
    if (value && value !== PASTE && (input.name !== "config" || form.model.value === PASTE)) out[input.name] = value;
  }
  return out;
}

function fromUrl() {
  const params = new URLSearchParams(location.search);
  for (const [name, value] of params) {
    if (form.elements[name] && name !== "config") form.elements[name].value = value;
  }
  if (!params.toString()) form.q.value = "what fits on 2×A100 40GB";
}

function toUrl(sent) {
  const params = new URLSearchParams(Object.entries(sent).filter(([name]) => name !== "config"));
  history.replaceState(null, "", params.toString() ? `?${params}` : location.pathname);
}

function changed() {
  document.querySelector('[data-field="config"]').classList.toggle("hidden", form.model.value !== PASTE);
  if (form.count.value && !form.gpu.value && lastData) form.gpu.value = hardware(lastData).gpu;
  clearTimeout(timer);
  timer = setTimeout(ask, DEBOUNCE_MS);
}

async function ask() {
  const sent = fields();
  toUrl(sent);
  if (inFlight) inFlight.abort();
  inFlight = new AbortController();
  statusLine.textContent = "planning…";
  try {
    const response = await fetch("api/plan", {method: "POST", body: JSON.stringify(sent),
      headers: {"Content-Type": "application/json"}, signal: inFlight.signal});
    const body = await response.json();
    showErrors(body.errors || []);
    if (response.ok) { selected = null; show(body); }
    statusLine.textContent = response.ok ? "" : "fix the field marked in red";
  } catch (error) {
    if (error.name !== "AbortError") statusLine.textContent = `no answer from the planner: ${error.message}`;
  }
}

function showErrors(errors) {
  for (const box of document.querySelectorAll("[data-error]")) box.textContent = "";
  for (const box of document.querySelectorAll(".field.bad")) box.classList.remove("bad");
  for (const error of errors) {
    const box = document.querySelector(`[data-error="${error.field || ""}"]`) || document.querySelector('[data-error=""]');
    box.append(el("div", {}, error.message));
    const field = box.closest(".field");
    if (field) field.classList.add("bad");
  }
}

function placeholders(data) {
  const many = Array.isArray(data.result);
  const first = many ? data.result[0] : data.result;
  const hw = first.hardware;
  form.model.options[0].text = many ? "auto: all models" : `auto: ${first.model.name}`;
  form.gpu.options[0].text = `auto: ${hw.gpu}`;
  form.count.placeholder = hw.gpus_per_node;
  form.host_memory.placeholder = `${fmt(hw.host_memory_gib_per_node)} (usual)`;
  if (first.plans.length) form.seq_len.placeholder = first.plans[0].seq_len;
}

// --- the answer ---
const hardware = (data) => (Array.isArray(data.result) ? data.result[0] : data.result).hardware;

function show(data) {
  lastData = data;
  if (!window.PLAN_DATA) placeholders(data);
  resultBox.replaceChildren(...(Array.isArray(data.result) ? whatFits(data) : onePlan(data)));
}

function commandLine(text) {
  return el("div", {class: "command"}, el("span", {class: "muted"}, "in a terminal: "), el("code", {}, text), copyButton(text));
}

function onePlan(data) {
  const r = data.result;
  const hw = r.hardware;
  const plans = r.plans;
  if (selected === null || selected >= plans.length) selected = r.recommended ?? 0;
  const world = hw.count;
  const head = el("p", {class: "summary"},
    el("strong", {}, r.model.name), `: ${fmt(r.model.params / 1e9, 2)}B params on ${world}× ${hw.gpu} `,
    `(${fmt(hw.memory_gib)} GiB, ${hw.interconnect}${hw.nodes > 1 ? `, ${hw.nodes} nodes` : ""}), `,
    `seq len ${plans.length ? plans[0].seq_len : "?"}; host RAM ${fmt(hw.host_memory_gib_per_node)} GiB per node`,
    r.tokens ? `; ${fmt(r.tokens)} training tokens` : el("span", {class: "muted"}, " (hours and $: give training tokens)"));
  if (!plans.length) return [head, commandLine(data.command), refusedBox(`Nothing is planned on ${world}× ${hw.gpu}: the trainer refuses what was asked`, r.refused)];
  const verdict = r.recommended === null
    ? el("p", {class: "verdict bad"}, `Nothing fits on ${world}× ${hw.gpu}. Try more GPUs, QLoRA, a shorter sequence, or offload.`)
    : el("p", {class: `verdict ${plans[r.recommended].tight ? "tight" : "good"}`}, "Recommended: ", el("strong", {}, describe(plans[r.recommended])),
      `, micro batch ${plans[r.recommended].micro_batch_size}`, plans[r.recommended].gradient_checkpointing ? ", gradient checkpointing" : "",
      plans[r.recommended].tight ? `, fits, tight (margin ${fmt(plans[r.recommended].margin_gib, 1)} GiB)` : "",
      ` — ${fmt(plans[r.recommended].tokens_per_second)} tokens/s, likely ${span(plans[r.recommended].tokens_per_second_likely)}`,
      el("span", {class: "muted"}, ` (speed ${plans[r.recommended].speed_basis})`));
  const scale = barScale(hw.memory_gib, plans.map((p) => p.memory_per_gpu_gib.device));
  const hostScale = barScale(hw.host_memory_gib_per_node, plans.map((p) => p.host_memory_gib));
  const rows = plans.map((p, i) => el("tr", {class: rowClass(p, i, r.recommended), onclick: () => { selected = i; show(data); }},
    el("td", {}, i === r.recommended ? "★" : ""), el("td", {}, p.method), el("td", {}, label(p.strategy)), el("td", {}, p.offload),
    el("td", {class: "num"}, p.micro_batch_size), el("td", {}, p.gradient_checkpointing ? "yes" : "no"),
    el("td", {class: "barcell"}, memoryBar(p, scale, hw.memory_gib)),
    el("td", {class: "num"}, fmt(p.memory_per_gpu_gib.device, 1)),
    el("td", {class: "hostcell"}, hostBar(p, hostScale, hw.host_memory_gib_per_node)),
    el("td", {}, fitsText(p)),
    likelyCell(p.tokens_per_second, p.tokens_per_second_likely), likelyCell(p.hours, p.hours_likely, 1),
    likelyCell(p.usd, p.usd_likely), el("td", {class: "why"}, why(p, i, r.recommended))));
  const table = el("table", {id: "plans", class: "plans"},
    el("thead", {}, el("tr", {}, ["", "method", "strategy", "offload", "micro batch", "ckpt", `memory per GPU (line: ${hw.gpu}, ${fmt(hw.memory_gib)} GiB)`,
      "GiB", "host RAM", "fits", "tokens/s", "hours", "$", "why"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
  const p = plans[selected];
  const title = `${selected === r.recommended ? "Recommended" : `Plan ${selected + 1}`}: ${describe(p)}, micro batch ${p.micro_batch_size}`;
  const leftOut = r.refused.length ? refusedBox("Left out: the trainer refuses them", r.refused) : null;
  return [head, commandLine(data.command), verdict, leftOut, legend(), el("div", {class: "scroll"}, table),
    detail(title, p.reasons, p.launch_command, data.files[selected], p.fits)];
}

function fitsText(p) {
  if (!p.fits) return p.fits_device ? "NO (host)" : "NO";
  return p.tight ? `tight (${fmt(p.margin_gib, 1)} GiB)` : "yes";
}

// What the request asked for that the trainer would refuse, in its own words.
function refusedBox(title, reasons) {
  return el("div", {class: "verdict bad refused"}, title, el("ul", {}, reasons.map((reason) => el("li", {}, reason))));
}

function whatFits(data) {
  const hw = data.result[0].hardware;
  const results = data.result.filter((r) => r.plans.length);  // a model the trainer refuses as asked has no plan to show
  if (!results.length) return [commandLine(data.command), refusedBox("Nothing is planned: the trainer refuses what was asked", data.result[0].refused)];
  data = {...data, result: results, files: data.files.filter((_, i) => data.result[i].plans.length)};
  const best = data.result.map((r) => r.plans[r.recommended ?? 0]);
  if (selected === null) selected = Math.max(0, data.result.findIndex((r) => r.recommended !== null));
  const scale = barScale(hw.memory_gib, best.map((p) => p.memory_per_gpu_gib.device));
  const head = el("p", {class: "summary"}, el("strong", {}, `What fits on ${hw.count}× ${hw.gpu}`),
    ` (${fmt(hw.memory_gib)} GiB, host RAM ${fmt(hw.host_memory_gib_per_node)} GiB per node), seq len ${best[0].seq_len}`,
    data.result[0].tokens ? `; ${fmt(data.result[0].tokens)} training tokens` : el("span", {class: "muted"}, " (hours and $: give training tokens)"));
  const rows = data.result.map((r, i) => {
    const p = best[i];
    const methods = [...new Set(r.plans.filter((q) => q.fits).map((q) => q.method))].sort().join(", ") || "none";
    return el("tr", {class: rowClass(p, i, r.recommended === null ? -1 : i), onclick: () => { selected = i; show(data); }},
      el("td", {}, el("strong", {}, r.model.name), ` (${fmt(r.model.params / 1e9, 1)}B)`),
      el("td", {}, r.recommended === null ? "nothing fits" : describe(p)),
      el("td", {class: "num"}, r.recommended === null ? "–" : p.micro_batch_size),
      el("td", {class: "barcell"}, memoryBar(p, scale, hw.memory_gib)), el("td", {class: "num"}, fmt(p.memory_per_gpu_gib.device, 1)),
      r.recommended === null ? el("td", {class: "num"}, "–") : likelyCell(p.tokens_per_second, p.tokens_per_second_likely),
      likelyCell(p.hours, p.hours_likely, 1), likelyCell(p.usd, p.usd_likely), el("td", {}, methods),
      el("td", {}, window.PLAN_DATA ? "" : el("button", {type: "button", class: "small",
        onclick: (event) => { event.stopPropagation(); form.model.value = r.model.name; changed(); }}, "all plans →")));
  });
  const table = el("table", {id: "plans", class: "plans"},
    el("thead", {}, el("tr", {}, ["model", "recommended plan", "micro batch", `memory per GPU (line: ${fmt(hw.memory_gib)} GiB)`, "GiB",
      "tokens/s", "hours", "$", "methods that fit", ""].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
  const r = data.result[selected];
  const p = best[selected];
  const title = r.recommended === null ? `${r.model.name}: nothing fits (closest: ${describe(p)})` : `${r.model.name}: ${describe(p)}, micro batch ${p.micro_batch_size}`;
  return [head, commandLine(data.command), legend(), el("div", {class: "scroll"}, table),
    detail(title, p.reasons, p.launch_command, data.files[selected], r.recommended !== null)];
}

// A number with the range the speed model supports under it ("likely 4,800–8,000").
function likelyCell(value, likely, digits) {
  return el("td", {class: "num"}, fmt(value, digits), likely ? el("div", {class: "likely"}, span(likely, digits)) : "");
}

function span(likely, digits) {
  return `${fmt(likely[0], digits)}–${fmt(likely[1], digits)}`;
}

function rowClass(p, i, recommended) {
  return [p.fits ? "fits" : "nofit", p.tight ? "tight" : "", i === recommended ? "recommended" : "", i === selected ? "selected" : ""].join(" ");
}

function why(p, i, recommended) {
  if (i === recommended) return "recommended";
  let reason = p.reasons[p.reasons.length - 1];  // a fitting plan's last reason compares it with the recommended one
  if (!p.fits_device) reason = p.reasons[0];
  else if (!p.fits_host) reason = p.reasons.find((text) => text.includes("host RAM") && text.includes(">")) || p.reasons[0];
  const prefix = `${describe(p)}: `;  // the row already names the plan
  return reason.startsWith(prefix) ? reason.slice(prefix.length) : reason;
}

// Bars share one scale per table, capped at twice the limit so plans far over it don't squash the
// ones that fit; a bar cut at the edge ends in an arrow.
function barScale(limit, values) {
  return Math.min(Math.max(limit, ...values), 2 * limit) * 1.04;
}

function bar(parts, total, scale, limit, extraClass) {
  return el("div", {class: `bar ${extraClass}`},
    el("div", {class: "segs"}, parts.map(([term, gib]) => el("div", {class: `seg t-${term.split(" ")[0]}`, width: `${(100 * gib) / scale}%`}))),
    el("div", {class: "limit", left: `${(100 * limit) / scale}%`}),
    total > scale ? el("span", {class: "over"}, "▸") : null);
}

function memoryBar(p, scale, capacity) {
  const m = p.memory_per_gpu_gib;
  const known = TERMS.reduce((sum, term) => sum + m[term], 0);
  const parts = [...TERMS.map((term) => [term, m[term]]), ["cache + CUDA context", Math.max(0, m.device - known)]];
  const box = bar(parts, m.device, scale, capacity, "");
  box.title = parts.map(([term, gib]) => `${term} ${fmt(gib, 1)} GiB`).join("\n");
  return box;
}

function hostBar(p, scale, limit) {
  return el("div", {class: "hostwrap", title: `host RAM per node: ${fmt(p.host_memory_gib, 1)} GiB (offload ${fmt(p.host_memory_detail_gib.offload, 1)},`
    + ` loading ${fmt(p.host_memory_detail_gib.loading, 1)}) of ${fmt(limit)} GiB`},
  bar([["host", p.host_memory_gib]], p.host_memory_gib, scale, limit, "host"), el("span", {class: "num"}, fmt(p.host_memory_gib)));
}

function legend() {
  return el("div", {class: "legend"}, [...TERMS, "slack"].map((term) => el("span", {}, el("i", {class: `seg t-${term}`}), term === "slack" ? "allocator cache + CUDA context" : term)),
    el("span", {}, el("i", {class: "limitkey"}), "GPU memory"), el("span", {}, el("i", {class: "seg t-host"}), "host RAM per node (line: available)"),
    el("span", {class: "muted"}, "click a row for its details"));
}

function detail(title, reasons, launch, files, fits) {
  const folder = (launch.match(/--config_file (\S+)\/accelerate\.yaml/) || [null, "plan"])[1];
  return el("section", {class: `detail ${fits ? "" : "nofit"}`}, el("h2", {}, title),
    el("ul", {}, reasons.map((reason) => el("li", {}, reason))),
    el("h3", {}, "Launch"), el("div", {class: "launch"}, el("code", {id: "launch"}, launch), copyButton(launch)),
    el("h3", {}, "Files"),
    el("div", {class: "files"}, Object.entries(files || {}).map(([name, text]) =>
      el("button", {type: "button", onclick: () => download(name, text)}, `⤓ ${name}`)),
    el("span", {class: "muted"}, ` save them in ${folder}/ (the launch command reads ${folder}/accelerate.yaml); the same files as `,
      el("code", {}, `finetune plan … --write-config ${folder}`), "; submit the sbatch script with ", el("code", {}, "sbatch finetune.sbatch"),
      ", the cluster jobs with ", el("code", {}, `kubectl apply -f ${folder}/trainjob.yaml`), ", ",
      el("code", {}, `sky launch ${folder}/skypilot.yaml`), " or ", el("code", {}, `dstack apply -f ${folder}/dstack.yaml`), ".")));
}

function copyButton(text) {
  const button = el("button", {type: "button", class: "small copy"}, "copy");
  button.addEventListener("click", async (event) => {
    event.stopPropagation();
    try { await navigator.clipboard.writeText(text); } catch {
      const area = el("textarea", {}, text);
      document.body.append(area); area.select(); document.execCommand("copy"); area.remove();
    }
    button.textContent = "copied";
    setTimeout(() => { button.textContent = "copy"; }, 1200);
  });
  return button;
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], {type: "text/plain"}));
  const link = el("a", {href: url, download: name});
  document.body.append(link); link.click(); link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// --- start ---
async function start() {
  if (window.PLAN_DATA) {
    document.body.classList.add("static");
    show(window.PLAN_DATA);
    return;
  }
  catalog = await (await fetch("api/catalog")).json();
  fillMenus();
  fromUrl();
  form.addEventListener("input", changed);
  form.addEventListener("submit", (event) => event.preventDefault());
  for (const example of document.querySelectorAll(".example")) {
    example.addEventListener("click", () => { form.reset(); form.q.value = example.textContent; changed(); });
  }
  changed();
}

start();

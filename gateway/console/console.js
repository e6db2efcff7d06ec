// The operators' console: every page reads and changes the gateway through its admin API, with
// the key the user logged in with (kept in this tab's sessionStorage only). No framework: pages
// build DOM nodes with `h`, so text from the API is never parsed as HTML.

const main = document.getElementById("main");
const statusLine = document.getElementById("status");
const KEY = "servegate.key";
let operator = false;
let refreshTimer = null;
const charts = [];

// -- helpers -------------------------------------------------------------------------------
function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value === true) node.setAttribute(name, "");
    else if (value !== false && value != null) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child != null) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function say(message, error = false) {
  statusLine.textContent = message;
  statusLine.className = error ? "error" : "";
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(KEY)}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch { /* not JSON */ }
    throw new ApiError(response.status, message);
  }
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response.text();
}

function table(caption, columns, rows) {
  return h("div", { class: "table" }, h("table", {},
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, columns.map(([title]) => h("th", { scope: "col" }, title)))),
    h("tbody", {}, rows.length ? rows.map(row => h("tr", {}, columns.map(([, cell]) => h("td", {}, cell(row)))))
      : h("tr", {}, h("td", { colspan: columns.length }, "None yet.")))));
}

function field(label, name, attrs = {}) {
  return h("label", {}, label, h("input", { name, ...attrs }));
}

function formValues(form, numbers = [], decimals = []) {
  const values = {};
  for (const [name, raw] of new FormData(form).entries()) {
    const value = String(raw).trim();
    if (value === "") continue;
    values[name] = numbers.includes(name) ? Number(value) : value;
  }
  for (const name of decimals) if (values[name] !== undefined) values[name] = String(values[name]);
  return values;
}

const when = value => value ? new Date(value).toISOString().replace("T", " ").slice(0, 19) : "";
const whenUnix = seconds => seconds == null ? "" : when(seconds * 1000);  // batches and responses: Unix seconds
const FINISHED = new Set(["completed", "failed", "expired", "cancelled"]);
const LIMITS = [["rpm", "Requests/min"], ["tpm", "Tokens/min"], ["tokens_per_day", "Tokens/day"],
                ["max_concurrency", "Concurrent"], ["max_tokens_per_request", "Max tokens/request"]];
const BUDGETS = [["daily_budget_usd", "Daily budget (USD)"], ["monthly_budget_usd", "Monthly budget (USD)"]];
const limitColumns = [...LIMITS, ...BUDGETS].map(([name, title]) => [title, row => row[name] ?? "—"]);

function oneTimeKey(created, what) {
  return h("div", { class: "secret", role: "alert" },
    h("strong", {}, `${what}: copy it now, it is shown once and never stored.`),
    h("code", { id: "new-key" }, created.key),
    h("button", { type: "button", class: "secondary", onclick: () => navigator.clipboard?.writeText(created.key)
      .then(() => say("Key copied.")) }, "Copy"));
}

// -- pages ---------------------------------------------------------------------------------
const pages = {
  async tenants() {
    const tenants = await api("GET", "/admin/tenants");
    const create = h("form", { "aria-label": "Create a tenant", onsubmit: async event => {
      event.preventDefault();
      const body = formValues(event.target, LIMITS.map(([n]) => n), BUDGETS.map(([n]) => n));
      await act(() => api("POST", "/admin/tenants", body), `Tenant ${body.name} created.`);
    } },
      field("Name", "name", { required: true, pattern: "[A-Za-z0-9][A-Za-z0-9_.\\-]{0,63}" }),
      LIMITS.map(([name, label]) => field(label, name, { type: "number", min: 1 })),
      BUDGETS.map(([name, label]) => field(label, name, { type: "number", min: 0.01, step: 0.01 })),
      h("button", { type: "submit" }, "Create tenant"));
    const change = h("form", { "aria-label": "Change a tenant's limits", onsubmit: async event => {
      event.preventDefault();
      const { tenant, ...given } = formValues(event.target, LIMITS.map(([n]) => n), BUDGETS.map(([n]) => n));
      const body = Object.fromEntries(Object.entries(given).map(([k, v]) => [k, Number(v) === 0 ? null : v]));
      await act(() => api("PATCH", `/admin/tenants/${encodeURIComponent(tenant)}`, body), `Tenant ${tenant} updated.`);
    } },
      h("label", {}, "Tenant", h("select", { name: "tenant", required: true },
        tenants.map(t => h("option", { value: t.name }, t.name)))),
      LIMITS.map(([name, label]) => field(label, name, { type: "number", min: 0, placeholder: "unchanged" })),
      BUDGETS.map(([name, label]) => field(label, name, { type: "number", min: 0, step: 0.01, placeholder: "unchanged" })),
      h("button", { type: "submit" }, "Change limits"), h("small", {}, "0 lifts a limit."));
    return [h("h2", {}, "Tenants"), h("h3", {}, "New tenant"), create, h("h3", {}, "Change a tenant's limits"), change,
      table(`${tenants.length} tenants`, [
      ["Name", t => t.name], ["Tier", t => t.tier], ["Models", t => t.models.join(", ") || "all"],
      ...limitColumns,
      ["State", t => h("button", { type: "button", class: t.disabled ? "secondary" : "danger",
        onclick: () => act(() => api("PATCH", `/admin/tenants/${encodeURIComponent(t.name)}`, { disabled: !t.disabled }),
          `Tenant ${t.name} ${t.disabled ? "enabled" : "disabled"}.`) }, t.disabled ? "Enable" : "Disable")],
    ], tenants)];
  },

  async keys(shown) {
    const [keys, tenants] = await Promise.all([api("GET", "/admin/keys"), api("GET", "/admin/tenants")]);
    const scopes = operator ? ["inference", "admin", "operator"] : ["inference", "admin"];
    const create = h("form", { "aria-label": "Create a key", onsubmit: async event => {
      event.preventDefault();
      const body = formValues(event.target, ["rpm", "tpm", "expires_in_days"], ["daily_budget_usd"]);
      delete body.scope;
      body.scopes = [...event.target.querySelectorAll("input[name=scope]:checked")].map(box => box.value);
      await act(async () => render("keys", await api("POST", "/admin/keys", body)), null);
    } },
      h("label", {}, "Tenant", h("select", { name: "tenant", required: true },
        tenants.map(t => h("option", { value: t.name }, t.name)))),
      field("Name", "name", { maxlength: 128 }),
      h("fieldset", {}, h("legend", { class: "skip" }, "Scopes"), scopes.map(scope => h("label", {},
        h("input", { type: "checkbox", name: "scope", value: scope, checked: scope === "inference" }), scope))),
      field("Expires in days", "expires_in_days", { type: "number", min: 1 }),
      field("Requests/min", "rpm", { type: "number", min: 1 }),
      field("Tokens/min", "tpm", { type: "number", min: 1 }),
      field("Daily budget (USD)", "daily_budget_usd", { type: "number", min: 0.01, step: 0.01 }),
      h("button", { type: "submit" }, "Create key"));
    const live = key => !key.revoked_at;
    return [h("h2", {}, "Keys"), shown ? oneTimeKey(shown, `New key ${shown.prefix} for ${shown.tenant}`) : null,
      h("h3", {}, "New key"), create, table(`${keys.length} keys`, [
        ["Prefix", k => h("code", {}, k.prefix)], ["Tenant", k => k.tenant], ["Name", k => k.name],
        ["Scopes", k => k.scopes.join(", ")], ["Created", k => when(k.created_at)],
        ["Expires", k => when(k.expires_at) || "never"], ["Revoked", k => when(k.revoked_at)],
        ["", k => live(k) ? h("span", {},
          h("button", { type: "button", class: "secondary", "aria-label": `Rotate key ${k.prefix}`,
            onclick: () => act(async () => render("keys", await api("POST", `/admin/keys/${k.prefix}/rotate`)), null) },
            "Rotate"), " ",
          h("button", { type: "button", class: "danger", "aria-label": `Revoke key ${k.prefix}`,
            onclick: () => confirm(`Revoke key ${k.prefix}? Every replica refuses it within seconds.`) &&
              act(() => api("POST", `/admin/keys/${k.prefix}/revoke`), `Key ${k.prefix} revoked.`) }, "Revoke"))
          : ""],
      ], keys)];
  },

  async adapters() {
    const adapters = await api("GET", "/admin/adapters");
    const numbers = ["rpm", "tpm"], decimals = BUDGETS.map(([n]) => n);
    const create = h("form", { "aria-label": "Register an adapter", onsubmit: async event => {
      event.preventDefault();
      const { tenants, ...body } = formValues(event.target, numbers, decimals);
      body.tenants = (tenants || "").split(",").map(t => t.trim()).filter(Boolean);
      await act(() => api("POST", "/admin/adapters", body), `Adapter ${body.name} registered.`);
    } },
      field("Name (the model clients send)", "name", { required: true, maxlength: 128 }),
      field("Base model or alias", "base", { required: true, maxlength: 128 }),
      field("Path", "path", { required: true, maxlength: 1024 }),
      operator ? field("Owner tenant", "owner", { placeholder: "the operator's" }) : null,
      field("Also usable by (tenants, comma separated)", "tenants"),
      field("Requests/min", "rpm", { type: "number", min: 1 }),
      field("Tokens/min", "tpm", { type: "number", min: 1 }),
      BUDGETS.map(([name, label]) => field(label, name, { type: "number", min: 0.01, step: 0.01 })),
      h("button", { type: "submit" }, "Register adapter"));
    return [h("h2", {}, "LoRA adapters"), h("h3", {}, "New adapter"), create, table(`${adapters.length} adapters`, [
      ["Name", a => h("code", {}, a.name)], ["Base", a => a.base], ["Path", a => a.path],
      ["Owner", a => a.owner ?? "operator"], ["Also usable by", a => a.tenants.join(", ") || "—"],
      ["Requests/min", a => a.rpm ?? "—"], ["Tokens/min", a => a.tpm ?? "—"],
      ...BUDGETS.map(([name, title]) => [title, a => a[name] ?? "—"]), ["Created", a => when(a.created_at)],
      ["", a => h("button", { type: "button", class: "danger", "aria-label": `Remove adapter ${a.name}`,
        onclick: () => confirm(`Remove adapter ${a.name}? Requests naming it fail within seconds.`) &&
          act(() => api("DELETE", `/admin/adapters/${encodeURIComponent(a.name)}`), `Adapter ${a.name} removed.`) },
        "Remove")],
    ], adapters)];
  },

  async usage() {
    const params = new URLSearchParams(location.hash.split("?")[1] || "");
    const range = params.get("range") || "1h", by = params.get("by") || "model", tenant = params.get("tenant") || "";
    const hours = { "1h": 1, "24h": 24, "7d": 168 }[range] || 1;
    const bucket = hours <= 1 ? "minute" : hours <= 24 ? "hour" : "day";
    const since = new Date(Date.now() - hours * 3600e3).toISOString();
    const query = new URLSearchParams({ since, bucket, by, ...(tenant ? { tenant } : {}) });
    const series = await api("GET", `/admin/usage/series?${query}`);
    const controls = h("form", { "aria-label": "Usage range", onchange: event => {
      const next = new URLSearchParams(formValues(event.currentTarget));
      location.hash = `#/usage?${next}`;
    }, onsubmit: event => event.preventDefault() },
      h("label", {}, "Range", h("select", { name: "range" }, ["1h", "24h", "7d"].map(r =>
        h("option", { value: r, selected: r === range }, r)))),
      h("label", {}, "Per", h("select", { name: "by" }, ["model", "adapter", "key", "tenant"].map(g =>
        h("option", { value: g, selected: g === by }, g)))),
      operator ? field("Tenant", "tenant", { value: tenant, placeholder: "all" }) : null,
      h("button", { type: "button", class: "secondary", onclick: () => download(`/admin/usage/series.csv?${query}`) },
        "Export CSV"));
    const panels = [["Tokens", p => p.prompt_tokens + p.completion_tokens], ["Requests", p => p.requests],
                    ["Errors", p => p.errors], ["TTFT p50 (ms)", p => p.ttft_p50_ms],
                    ["TTFT p95 (ms)", p => p.ttft_p95_ms], ["Cost (USD)", p => Number(p.cost_usd)]];
    const total = series.series.reduce((n, s) => n + s.points.reduce((m, p) => m + p.requests, 0), 0);
    const grid = h("div", { class: "charts" }, panels.map(([title, value]) => chart(title, series, value, bucket)));
    return [h("h2", {}, "Usage"), controls,
      h("p", {}, `${total} requests in the last ${range}, per ${bucket}, by ${by}.`), grid];
  },

  async batches() {
    const params = new URLSearchParams(location.hash.split("?")[1] || "");
    const tenant = params.get("tenant") || "", status = params.get("status") || "";
    const query = new URLSearchParams({ limit: 200, ...(tenant ? { tenant } : {}), ...(status ? { status } : {}) });
    const batches = await api("GET", `/admin/batches?${query}`);
    const filters = h("form", { "aria-label": "Filter batches", onchange: event => {
      location.hash = `#/batches?${new URLSearchParams(formValues(event.currentTarget))}`;
    }, onsubmit: event => event.preventDefault() },
      operator ? field("Tenant", "tenant", { value: tenant, placeholder: "all" }) : null,
      h("label", {}, "Status", h("select", { name: "status" }, ["", "in_progress", "cancelling", "finalizing",
        "completed", "failed", "expired", "cancelled"].map(s => h("option", { value: s, selected: s === status },
        s || "any")))));
    const progress = b => {
      const { total, completed, failed } = b.request_counts, done = completed + failed;
      return h("span", {}, h("progress", { max: Math.max(total, 1), value: done,
        "aria-label": `Batch ${b.id}: ${done} of ${total} lines done` }),
        ` ${completed}/${total}` + (failed ? `, ${failed} failed` : ""));
    };
    const cancel = b => FINISHED.has(b.status) || b.status === "cancelling" ? "" :
      h("button", { type: "button", class: "danger", "aria-label": `Cancel batch ${b.id}`,
        onclick: () => confirm(`Cancel batch ${b.id}? The lines under way finish; no others start.`) &&
          act(() => api("POST", `/admin/batches/${encodeURIComponent(b.id)}/cancel`), `Batch ${b.id} cancelling.`) },
        "Cancel");
    return [h("h2", {}, "Batches"), filters, table(`${batches.length} batches, newest first`, [
      ["ID", b => h("code", {}, b.id)], ["Tenant", b => b.tenant], ["Key", b => b.key_prefix ?? "—"],
      ["Endpoint", b => b.endpoint], ["Status", b => h("span", { class: `batch-${b.status}` }, b.status)],
      ["Progress", progress], ["Created", b => whenUnix(b.created_at)], ["Finished", b => whenUnix(b.finished_at)],
      ["Files (input, output, errors)", b => [b.input_file_id, b.output_file_id, b.error_file_id]
        .map(id => id ?? "—").join(", ")],
      ...(operator ? [["Runner", b => b.runner ? `${b.runner} until ${whenUnix(b.lease_until)}` : "—"]] : []),
      ["", cancel],
    ], batches)];
  },

  async responses() {
    const params = new URLSearchParams(location.hash.split("?")[1] || "");
    const tenant = params.get("tenant") || "";
    const query = new URLSearchParams({ limit: 200, ...(tenant ? { tenant } : {}) });
    const responses = await api("GET", `/admin/responses?${query}`);
    const filters = operator ? h("form", { "aria-label": "Filter responses", onchange: event => {
      location.hash = `#/responses?${new URLSearchParams(formValues(event.currentTarget))}`;
    }, onsubmit: event => event.preventDefault() }, field("Tenant", "tenant", { value: tenant, placeholder: "all" }))
      : null;
    return [h("h2", {}, "Stored responses"), filters,
      h("p", {}, "Kept for /v1/responses clients to read and continue until they expire. Their text is not shown."),
      table(`${responses.length} stored responses, newest first`, [
        ["ID", r => h("code", {}, r.id)], ["Tenant", r => r.tenant], ["Key", r => r.key_prefix ?? "—"],
        ["Model", r => r.model], ["Status", r => r.status ?? "—"],
        ["Tokens (in, out)", r => r.usage ? `${r.usage.input_tokens}, ${r.usage.output_tokens}` : "—"],
        ["Created", r => whenUnix(r.created_at)], ["Expires", r => whenUnix(r.expires_at)],
        ["", r => h("button", { type: "button", class: "danger", "aria-label": `Delete response ${r.id}`,
          onclick: () => confirm(`Delete response ${r.id}? Its client can no longer read or continue it.`) &&
            act(() => api("DELETE", `/admin/responses/${encodeURIComponent(r.id)}`), `Response ${r.id} deleted.`) },
          "Delete")],
      ], responses)];
  },

  async routes() {
    const states = await api("GET", "/admin/routes");
    const sections = [];
    for (const state of states) {
      const [history, shadow] = await Promise.all([api("GET", `/admin/routes/${encodeURIComponent(state.alias)}`),
        api("GET", `/admin/routes/${encodeURIComponent(state.alias)}/shadow`)]);
      const alias = encodeURIComponent(state.alias);
      let canary = null;
      if (state.canary) {
        const live = await api("GET", `/admin/routes/${alias}/canary`);
        const stat = (title, name, format) => [title, side => format(live[side][name])];
        const ms = v => v == null ? "—" : `${Math.round(v)} ms`;
        canary = [table(`Canary v${live.canary.version} (${Math.round(live.canary.share * 100)}% of traffic) against ` +
          `v${live.active.version}, this replica's last ${live.policy.window_s} s`, [
          ["Version", side => `${side} v${live[side].version}`], stat("Requests", "requests", v => v),
          stat("Error rate", "error_rate", v => `${(v * 100).toFixed(1)}%`), stat("TTFT p95", "ttft_p95", ms),
          stat("TPOT p95", "tpot_p95", ms)],
          ["active", "canary"]),
          h("p", {}, `Guard: ${live.verdict ? `would end it: ${live.verdict}` :
            `holds (needs ${live.policy.min_requests} requests a side to judge)`}`),
          h("button", { type: "button", class: "secondary",
            onclick: () => act(() => api("POST", `/admin/routes/${alias}/promote`), `${state.alias}: canary promoted.`) },
            "Promote canary"), " ",
          h("button", { type: "button", class: "danger", onclick: () => {
            const reason = prompt(`Roll back the canary of ${state.alias}? Reason:`, "rolled back from the console");
            if (reason !== null) {
              act(() => api("POST", `/admin/routes/${alias}/rollback?reason=${encodeURIComponent(reason)}`),
                `${state.alias}: canary rolled back.`);
            }
          } }, "Roll back canary")];
      }
      sections.push(h("section", { "aria-label": `Route ${state.alias}` }, h("h3", {}, state.alias),
        canary,
        table("Versions", [["Version", v => `v${v.version}`], ["Status", v => v.status],
          ["Targets", v => v.spec.targets.map(t => `${t.backend}×${t.weight}`).join(", ")],
          ["Share", v => v.share == null ? "" : `${Math.round(v.share * 100)}%`], ["Created", v => when(v.created_at)]],
        history.versions),
        table("Changes (the guard's verdicts are by canary-guard)", [["At", c => when(c.at)], ["By", c => c.actor],
          ["Action", c => c.action], ["Version", c => c.target],
          ["Reason", c => c.after?.reason ?? ""]], history.changes.slice().reverse()),
        shadow.length ? table("Shadow comparison", Object.keys(shadow[0]).map(k => [k, row => row[k]]), shadow) : null));
    }
    return [h("h2", {}, "Routes"), states.length ? sections : h("p", {}, "No routes deployed.")];
  },

  async backends() {
    const backends = await api("GET", "/admin/backends");
    return [h("h2", {}, "Backends"), table("As this replica sees them", [
      ["Backend", b => b.name], ["Model", b => b.model], ["Runtime", b => [b.runtime, b.dtype].filter(Boolean).join(" ")],
      ["Health", b => h("span", { class: `health-${b.health}` }, b.health)],
      ["Running", b => b.running], ["Waiting", b => b.waiting],
      ["KV cache", b => h("span", {}, h("meter", { min: 0, max: 1, value: b.kv_usage,
        "aria-label": `KV cache ${Math.round(b.kv_usage * 100)}% used` }), ` ${Math.round(b.kv_usage * 100)}%`)],
      ["Prefix hits", b => b.prefix_hit_rate == null ? "—" : `${Math.round(b.prefix_hit_rate * 100)}%`],
      ["In flight", b => b.in_flight], ["Queued", b => b.queued],
      ["Breaker", b => h("span", { class: b.breaker_open ? "breaker-open" : "" }, b.breaker_open ? "open" : "closed")],
    ], backends)];
  },

  async audit() {
    const entries = await api("GET", "/admin/audit?limit=200");
    const changed = e => Object.keys(e.after || {}).filter(k => JSON.stringify(e.after[k]) !==
      JSON.stringify((e.before || {})[k])).map(k => `${k}: ${JSON.stringify(e.after[k])}`).join("; ");
    return [h("h2", {}, "Audit log"), table(`The last ${entries.length} changes`, [
      ["At", e => when(e.at)], ["Actor", e => e.actor], ["Action", e => e.action], ["Target", e => e.target],
      ["Change", e => changed(e)]], entries)];
  },
};

// -- charts --------------------------------------------------------------------------------
function chart(title, series, value, bucket) {
  const box = h("figure", { class: "chart", role: "img", "aria-label": `${title} per ${bucket}, by ${series.by}` },
    h("h3", {}, title));
  const times = [...new Set(series.series.flatMap(s => s.points.map(p => Date.parse(p.at) / 1000)))].sort((a, b) => a - b);
  const data = [times, ...series.series.map(s => {
    const byTime = new Map(s.points.map(p => [Date.parse(p.at) / 1000, value(p)]));
    return times.map(t => byTime.get(t) ?? null);
  })];
  const palette = ["#1f5fbf", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285"];
  requestAnimationFrame(() => {
    const width = Math.max(box.clientWidth - 16, 240);
    const span = [Date.parse(series.since) / 1000, Date.parse(series.until) / 1000];
    const plot = new uPlot({
      width, height: 200, scales: { x: { time: true, range: () => span } }, legend: { live: false },
      series: [{}, ...series.series.map((s, i) => ({ label: s.group || "—", stroke: palette[i % palette.length],
        width: 2, points: { show: true }, spanGaps: false }))],
      axes: [{}, { size: 60 }],
    }, data, box);
    plot.root.dataset.points = String(data.slice(1).flat().filter(v => v != null).length);
    charts.push(plot);
  });
  return box;
}

async function download(path) {
  const text = await api("GET", path);
  const link = h("a", { href: URL.createObjectURL(new Blob([text], { type: "text/csv" })), download: "usage.csv" });
  link.click();
  URL.revokeObjectURL(link.href);
}

// -- navigation ----------------------------------------------------------------------------
function schedule(task, ms) {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(() => document.visibilityState === "visible" ? task() : schedule(task, ms), ms);
}

async function act(change, message) {
  try {
    await change();
    if (message) say(message);
    if (message) await render(current());
  } catch (error) {
    say(error.message, true);
  }
}

const OPERATOR_PAGES = new Set(["tenants", "routes", "backends", "audit"]);
const LIVE_PAGES = new Set(["usage", "batches", "routes", "backends"]);  // redrawn every 5 s while shown

const hashPage = () => location.hash.replace(/^#\//, "").split("?")[0];

function current() {
  const page = hashPage();
  if (!page || (!operator && OPERATOR_PAGES.has(page))) return operator ? "tenants" : "keys";
  return page;
}

// Renders overlap (a click while a page loads, a refresh after a change): only the latest one
// may draw, or a page fetched before a change would overwrite the page fetched after it.
let latestRender = 0;

async function render(page, extra) {
  clearTimeout(refreshTimer);
  const build = pages[page];
  if (!build) return render(operator ? "tenants" : "keys");
  const ticket = ++latestRender;
  // The address names the page shown, so its own link does not load it a second time.
  if (hashPage() !== page) history.replaceState(null, "", `#/${page}`);
  for (const link of document.querySelectorAll("nav a")) {
    link.toggleAttribute("aria-current", link.getAttribute("href") === `#/${page}`);
    if (link.hasAttribute("aria-current")) link.setAttribute("aria-current", "page");
  }
  try {
    const nodes = await build(extra);
    if (ticket !== latestRender) return;
    charts.splice(0).forEach(plot => plot.destroy());
    main.replaceChildren(...nodes.flat().filter(Boolean));
    document.title = `${page[0].toUpperCase()}${page.slice(1)} · servegate console`;
    if (LIVE_PAGES.has(page)) schedule(() => render(page), 5000);
  } catch (error) {
    if (ticket !== latestRender) return;
    if (error.status === 401) return logout("The key was refused; log in again.");
    say(error.message, true);
  }
}

function login(message = "") {
  document.getElementById("nav").hidden = true;
  const form = h("form", { "aria-label": "Log in", onsubmit: async event => {
    event.preventDefault();
    sessionStorage.setItem(KEY, new FormData(event.target).get("key"));
    await start();
  } },
    h("label", {}, "Admin or operator key", h("input", { name: "key", type: "password", required: true,
      autocomplete: "off", autofocus: true })),
    h("button", { type: "submit" }, "Log in"));
  main.replaceChildren(h("section", { class: "login" }, h("h2", {}, "Log in"),
    h("p", {}, "With a key that has the admin scope (its tenant) or the operator scope (everything)."), form));
  form.querySelector("input").focus();
  say(message, Boolean(message));
}

function logout(message = "") {
  sessionStorage.removeItem(KEY);
  clearTimeout(refreshTimer);
  login(message);
}

async function start() {
  try {
    operator = (await api("GET", "/admin/me")).operator;
  } catch (error) {
    return logout(error.status === 403 ? "This key has no admin scope." : error.message);
  }
  const nav = document.getElementById("nav");
  nav.hidden = false;
  for (const link of nav.querySelectorAll("[data-operator]")) link.hidden = !operator;
  say(operator ? "Logged in as an operator." : "Logged in as a tenant administrator.");
  await render(current());
  main.focus();
}

document.getElementById("logout").addEventListener("click", () => logout("Logged out."));
window.addEventListener("hashchange", () => {
  if (!sessionStorage.getItem(KEY)) return;
  say("");
  render(current());
});
if (sessionStorage.getItem(KEY)) start(); else login();

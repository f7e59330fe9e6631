// Loads dashboards the way Grafana's dashboard scene loads each panel, with Grafana's own
// published code, and reports every setting that loading changes.
//
//   node load_dashboards.mjs GRAFANA_VERSION UI_MODULE DASHBOARD.json...
//
// Per panel, the steps of @grafana/scenes' VizPanel._pluginLoaded:
//   1. the panel plugin's migration handler; Grafana runs it whenever the saved pluginVersion
//      differs from the running Grafana's, so on every upgrade. It is run here unconditionally:
//      a panel must come through it unchanged. Published handlers: stat and bargauge use
//      sharedSingleStatMigrationHandler (@grafana/ui). The table and timeseries handlers live
//      in Grafana's app, not in a package; for those only step 2 runs.
//   2. getPanelOptionsWithDefaults (@grafana/data): the plugin's option defaults (the panel
//      config defaults of @grafana/schema) merged under the saved options, the field config
//      cleaned against the field-config registry, thresholds fixed.
// The standard field-config registry is filled by Grafana's app; here it holds every
// standard property id @grafana/data declares (FieldConfigProperty), without the app's
// default values, so a setting the dashboard leaves out is not filled in: the dashboards
// state the settings compared below. Custom (plugin-specific) properties are not published:
// they are cleaned away in step 2 and not compared.
//
// Compared before and after, per panel: reduction, unit, min, max, decimals, thresholds,
// value mappings, no-value text, colour, and the standard properties of every override.
// Per dashboard: schemaVersion against @grafana/schema's (an older one goes through Grafana's
// schema migrations on load), and every panel's pluginVersion against GRAFANA_VERSION.
//
// Output: one JSON report on stdout. Exit 0 when it could load everything (the verdict is the
// report's), 2 on bad arguments or an install that does not match GRAFANA_VERSION.

import { readFileSync } from "node:fs";
import { createRequire, register } from "node:module";
import { pathToFileURL } from "node:url";

const require = createRequire(import.meta.url);

const [grafanaVersion, uiModulePath, ...dashboardPaths] = process.argv.slice(2);
if (!grafanaVersion || !uiModulePath || dashboardPaths.length === 0) {
  console.error("usage: node load_dashboards.mjs GRAFANA_VERSION UI_MODULE DASHBOARD.json...");
  process.exit(2);
}

// @grafana/data is written for a browser: at load it subscribes to the window's "storage"
// event. react-use (which it imports) must first see no window, or it takes its browser path
// and wants a document too.
require("react-use");
globalThis.window = { addEventListener() {}, removeEventListener() {} };
const data = require("@grafana/data");
const schema = require("@grafana/schema");
const installed = require("@grafana/data/package.json").version;
if (installed !== grafanaVersion) {
  console.error(`@grafana/data ${installed} is installed, the dashboards target ${grafanaVersion}`);
  process.exit(2);
}

register("./loader_hooks.mjs", import.meta.url, {
  data: {
    requireFrom: import.meta.url,
    exportNames: {
      lodash: Object.keys(require("lodash")),
      "@grafana/data": Object.keys(data),
      "@grafana/schema": Object.keys(schema),
    },
  },
});
const ui = await import(pathToFileURL(uiModulePath).href);

async function panelConfigDefaults(type, file) {
  const module = await import(`@grafana/schema/dist/esm/raw/composable/${type}/panelcfg/x/${file}`);
  return module.defaultOptions ?? {};
}

const PANEL_TYPES = {
  stat: { migration: "sharedSingleStatMigrationHandler",
          defaults: await panelConfigDefaults("stat", "StatPanelCfg_types.gen.js") },
  bargauge: { migration: "sharedSingleStatMigrationHandler",
              defaults: await panelConfigDefaults("bargauge", "BarGaugePanelCfg_types.gen.js") },
  table: { migration: null,
           defaults: await panelConfigDefaults("table", "TablePanelCfg_types.gen.js") },
  timeseries: { migration: null,
                defaults: await panelConfigDefaults("timeseries", "TimeSeriesPanelCfg_types.gen.js") },
};

const STANDARD_PROPERTIES = Object.values(data.FieldConfigProperty);
data.standardFieldConfigEditorRegistry.setInit(() => STANDARD_PROPERTIES.map((id) => ({
  id, path: id, name: id, override: true, editor: null, category: ["Standard options"],
  process: (value) => value, shouldApply: () => true,
})));

function plugin(type) {
  const panelPlugin = new data.PanelPlugin(null);
  panelPlugin.meta = { id: type, name: type, info: { version: grafanaVersion } };
  panelPlugin.useFieldConfig({});
  panelPlugin.setPanelOptions((builder) => {
    for (const [path, defaultValue] of Object.entries(PANEL_TYPES[type].defaults)) {
      builder.addCustomEditor({ id: path, path, name: path, editor: null, defaultValue });
    }
  });
  return panelPlugin;
}

// JSON cannot hold -Infinity: Grafana saves the base threshold step as null.
function canonical(value) {
  if (value === -Infinity || value === null) return null;
  if (Array.isArray(value)) return value.map(canonical);
  if (value && typeof value === "object") {
    return Object.fromEntries(Object.keys(value).sort()
      .filter((key) => value[key] !== undefined)
      .map((key) => [key, canonical(value[key])]));
  }
  return value;
}

function effective(panel) {
  const defaults = panel.fieldConfig?.defaults ?? {};
  const overrides = (panel.fieldConfig?.overrides ?? []).map((override) => ({
    matcher: override.matcher,
    properties: override.properties.filter((property) => STANDARD_PROPERTIES.includes(property.id)),
  }));
  return canonical({
    reduction: panel.options?.reduceOptions,
    unit: defaults.unit, min: defaults.min, max: defaults.max, decimals: defaults.decimals,
    thresholds: defaults.thresholds, mappings: defaults.mappings, noValue: defaults.noValue,
    color: defaults.color, overrides,
  });
}

function load(panel) {
  const type = PANEL_TYPES[panel.type];
  // What VizPanel hands the migration handler; a deep copy, as Grafana's state is.
  const loaded = structuredClone({
    id: panel.id, type: panel.type, title: panel.title, pluginVersion: panel.pluginVersion,
    options: panel.options, fieldConfig: panel.fieldConfig,
  });
  if (type.migration) {
    loaded.options = ui[type.migration](loaded);
  }
  const withDefaults = data.getPanelOptionsWithDefaults({
    plugin: plugin(panel.type), currentOptions: loaded.options,
    currentFieldConfig: loaded.fieldConfig, isAfterPluginChange: false,
  });
  return { ...loaded, ...withDefaults };
}

function checkPanel(panel) {
  const report = { id: panel.id, title: panel.title, type: panel.type, problems: [], changes: [] };
  if (!PANEL_TYPES[panel.type]) {
    report.problems.push(`panel type ${panel.type} is not one this check knows how to load`);
    return report;
  }
  report.migration = PANEL_TYPES[panel.type].migration;
  if (panel.pluginVersion !== grafanaVersion) {
    report.problems.push(`pluginVersion ${JSON.stringify(panel.pluginVersion)}: Grafana `
      + `${grafanaVersion} runs the panel's migration on every load`);
  }
  const before = effective(panel);
  const after = effective(load(panel));
  for (const setting of new Set([...Object.keys(before), ...Object.keys(after)])) {
    if (JSON.stringify(before[setting]) !== JSON.stringify(after[setting])) {
      report.changes.push({ setting, before: before[setting] ?? null, after: after[setting] ?? null });
    }
  }
  return report;
}

function checkDashboard(path) {
  const dashboard = JSON.parse(readFileSync(path, "utf-8"));
  const problems = [];
  const currentSchema = schema.defaultDashboard.schemaVersion;
  if (dashboard.schemaVersion !== currentSchema) {
    problems.push(`schemaVersion ${dashboard.schemaVersion}: Grafana ${grafanaVersion} migrates `
      + `it to ${currentSchema} on load`);
  }
  const panels = dashboard.panels.flatMap((panel) => [panel, ...(panel.panels ?? [])])
    .filter((panel) => panel.type !== "row");
  return { path, schemaVersion: dashboard.schemaVersion, problems, panels: panels.map(checkPanel) };
}

const report = {
  grafanaVersion,
  schemaVersion: schema.defaultDashboard.schemaVersion,
  dashboards: dashboardPaths.map(checkDashboard),
};
process.stdout.write(JSON.stringify(report, null, 2) + "\n");

// Module hooks for load_dashboards.mjs; they only change how modules are found, never code.
//
// - The vendored @grafana/ui module is ESM and imports `lodash`, `@grafana/data` and
//   `@grafana/schema` by name. Node cannot import names from lodash's CommonJS build, and
//   @grafana/data's ESM build fails the same way, so those three specifiers resolve to a
//   module that re-exports the CommonJS instance the harness already loaded: one copy of
//   each library, the same one the harness calls.
// - @grafana/schema ships its per-panel defaults as ESM in `.js` files of a package without
//   "type": "module"; they are loaded as what they are, ES modules.

let exportNames = {};
let requireFrom = "";

export async function initialize(data) {
  exportNames = data.exportNames;
  requireFrom = data.requireFrom;
}

export async function resolve(specifier, context, nextResolve) {
  if (Object.hasOwn(exportNames, specifier) && context.parentURL?.endsWith(".mjs")
      && context.parentURL.includes("/vendor/")) {
    return { url: `grafana-cjs:${specifier}`, shortCircuit: true };
  }
  return nextResolve(specifier, context);
}

export async function load(url, context, nextLoad) {
  if (url.startsWith("grafana-cjs:")) {
    const specifier = url.slice("grafana-cjs:".length);
    const names = exportNames[specifier].filter(
      (name) => /^[A-Za-z_$][\w$]*$/.test(name) && name !== "default");
    const source = [
      `import { createRequire } from "node:module";`,
      `const library = createRequire(${JSON.stringify(requireFrom)})(${JSON.stringify(specifier)});`,
      `export default library;`,
      `export const { ${names.join(", ")} } = library;`,
    ].join("\n");
    return { format: "module", source, shortCircuit: true };
  }
  if (url.includes("/@grafana/schema/dist/esm/") && url.endsWith(".js")) {
    return nextLoad(url, { ...context, format: "module" });
  }
  return nextLoad(url, context);
}

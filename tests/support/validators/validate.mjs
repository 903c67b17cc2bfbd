// Validates Kubernetes custom resources against the Prometheus Operator's and cert-manager's own schemas, as
// published in the npm packages @kubernetes-models/prometheus-operator and @kubernetes-models/cert-manager.
//
// Input (stdin): a JSON array of objects. Output (stdout): a JSON array, one entry per object, in order:
//   {"object": "ServiceMonitor/raven-gateway", "errors": ["spec.endpoints[0].port: must be string", ...]}
// An empty "errors" means the object is valid. Exit status: 0 when every object is valid, 1 when any is not,
// 2 when the input cannot be read.
//
// Two checks per object:
// 1. the package's model class for its apiVersion/kind: `new Model(object).validate()` throws on a bad object
//    (wrong type, bad enum value, missing required field, bad format);
// 2. strict: a field that the schema never looks at is unknown. The published schemas, like the CRDs they come
//    from, do not forbid extra fields (the API server prunes them, or refuses them with kubectl's strict field
//    validation), so the same compiled validator runs once more on a copy of the object whose every mapping
//    records which keys the validator read; a key it never read is reported. Fields that a schema leaves
//    free-form (x-kubernetes-preserve-unknown-fields) would be reported too: none of Raven's objects has one.
//    (Top-level keys are checked by name: the model copies them before validating.)

const PACKAGES = {
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
  "cert-manager.io": "@kubernetes-models/cert-manager",
  "acme.cert-manager.io": "@kubernetes-models/cert-manager",
};
const TOP_LEVEL = new Set(["apiVersion", "kind", "metadata", "spec", "status"]);
const MIN_NODE = 18;

function describe(obj) {
  const kind = obj && typeof obj === "object" ? obj.kind : undefined;
  const name = obj && typeof obj === "object" && obj.metadata ? obj.metadata.name : undefined;
  return `${kind ?? "?"}/${name ?? "?"}`;
}

async function modelFor(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string" || !/^[A-Za-z0-9]+$/.test(kind)) {
    return { error: "apiVersion and kind must be strings" };
  }
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/", 2) : ["", apiVersion];
  const pkg = PACKAGES[group];
  if (pkg === undefined) {
    return { error: `no schema here for API group "${group}" (known: ${Object.keys(PACKAGES).join(", ")})` };
  }
  let mod;
  try {
    mod = await import(`${pkg}/${group}/${version}/${kind}`);
  } catch {
    return { error: `${pkg} has no ${kind} in ${apiVersion}` };
  }
  const model = mod[kind];
  if (typeof model !== "function" || model.apiVersion !== apiVersion || model.kind !== kind) {
    return { error: `${pkg} has no ${kind} in ${apiVersion}` };
  }
  return { model };
}

function pathOf(instancePath) {
  // "/spec/endpoints/0/port" -> "spec.endpoints[0].port"
  return instancePath
    .split("/")
    .slice(1)
    .map((p) => p.replaceAll("~1", "/").replaceAll("~0", "~"))
    .reduce((acc, p) => (/^\d+$/.test(p) ? `${acc}[${p}]` : acc ? `${acc}.${p}` : p), "");
}

function schemaErrors(err) {
  if (Array.isArray(err.errors) && err.errors.length > 0) {
    return err.errors.map((e) => `${pathOf(e.instancePath ?? "") || "(top level)"}: ${e.message}`);
  }
  return [String(err.message ?? err)];
}

// A deep copy whose mappings record the keys read from them (get, has, own-property lookups).
function tracked(value, path, seen) {
  if (Array.isArray(value)) {
    return value.map((v, i) => tracked(v, `${path}[${i}]`, seen));
  }
  if (value === null || typeof value !== "object") {
    return value;
  }
  const copy = {};
  for (const [k, v] of Object.entries(value)) {
    copy[k] = tracked(v, path ? `${path}.${k}` : k, seen);
  }
  const read = new Set();
  seen.push({ path, keys: Object.keys(copy), read });
  return new Proxy(copy, {
    get(target, key, receiver) {
      if (typeof key === "string") read.add(key);
      return Reflect.get(target, key, receiver);
    },
    has(target, key) {
      if (typeof key === "string") read.add(key);
      return Reflect.has(target, key);
    },
    getOwnPropertyDescriptor(target, key) {
      if (typeof key === "string") read.add(key);
      return Reflect.getOwnPropertyDescriptor(target, key);
    },
  });
}

function unknownFields(model, obj) {
  const errors = [];
  for (const key of Object.keys(obj)) {
    if (!TOP_LEVEL.has(key)) errors.push(`${key}: unknown field`);
  }
  const seen = [];
  const copy = tracked(obj, "", seen);
  try {
    model.prototype.validate.call(copy);
  } catch {
    return errors; // already reported by the first check
  }
  for (const { path, keys, read } of seen) {
    if (path === "") continue;
    for (const key of keys) {
      if (!read.has(key)) errors.push(`${path}.${key}: unknown field`);
    }
  }
  return errors;
}

async function check(obj) {
  if (obj === null || typeof obj !== "object" || Array.isArray(obj)) {
    return ["not an object"];
  }
  const { model, error } = await modelFor(obj.apiVersion, obj.kind);
  if (error) return [error];
  try {
    new model(obj).validate();
  } catch (err) {
    return schemaErrors(err);
  }
  return unknownFields(model, obj);
}

async function main() {
  const major = Number(process.versions.node.split(".")[0]);
  if (major < MIN_NODE) {
    process.stderr.write(`validate.mjs: Node.js ${MIN_NODE} or newer is needed, this is ${process.versions.node}\n`);
    return 2;
  }
  let objects;
  try {
    const chunks = [];
    for await (const chunk of process.stdin) chunks.push(chunk);
    objects = JSON.parse(Buffer.concat(chunks).toString("utf8"));
  } catch (err) {
    process.stderr.write(`validate.mjs: the input is not JSON: ${err.message}\n`);
    return 2;
  }
  if (!Array.isArray(objects)) {
    process.stderr.write("validate.mjs: the input must be a JSON array of objects\n");
    return 2;
  }
  const results = [];
  for (const obj of objects) {
    results.push({ object: describe(obj), errors: await check(obj) });
  }
  process.stdout.write(`${JSON.stringify(results)}\n`);
  return results.some((r) => r.errors.length > 0) ? 1 : 0;
}

process.exitCode = await main();

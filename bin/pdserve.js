#!/usr/bin/env node
// Entry point of the `pdserve` CLI: runs the compiled code in dist/ (built by `npm install` via
// the `prepare` script, or `npm run build`).
import { existsSync } from 'node:fs';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { dirname, join } from 'node:path';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const main = join(root, 'dist', 'cli', 'main.js');
if (!existsSync(main)) {
  console.error(`pdserve: ${main} is missing; run \`npm run build\` (or \`npm install\`) in ${root} first`);
  process.exit(1);
}
const { runCli } = await import(pathToFileURL(main).href);
await runCli(process.argv);

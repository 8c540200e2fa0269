#!/usr/bin/env node
// Atomic build: compile into a fresh `.dist-<id>/` beside `dist`, then swap the `dist` symlink
// to it with one rename(2). A pdserve process started from the old build keeps importing from
// its own folder (Node resolves modules by real path), so rebuilding under a running cluster
// (e.g. `npm install` running `prepare`) never hands a restarting worker half-written files.
// The newest KEEP builds are kept; older ones are removed. Used by `npm run build`, `prepare`
// and `pretest`.
import { spawnSync } from 'node:child_process';
import { cpSync, lstatSync, readdirSync, readFileSync, renameSync, rmSync, symlinkSync, statSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const KEEP = 4;
const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const id = `${Date.now().toString(36)}-${process.pid}`;
const outName = `.dist-${id}`;
const out = join(root, outName);
const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');
const r = spawnSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.json'), '--outDir', out], { stdio: 'inherit' });
if (r.status !== 0) {
  rmSync(out, { recursive: true, force: true });
  process.exit(r.status ?? 1);
}
// The build's identity (src/base/version.ts reads it): package version and git commit
// (`-dirty` with uncommitted changes to tracked files; `unknown` outside a git checkout).
const git = (...args) => {
  const g = spawnSync('git', ['-C', root, ...args], { encoding: 'utf8' });
  return g.status === 0 ? g.stdout.trim() : undefined;
};
const commit = git('rev-parse', '--short=12', 'HEAD');
const dirty = commit !== undefined && (git('status', '--porcelain', '--untracked-files=no') ?? '') !== '';
const { version } = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'));
writeFileSync(join(out, 'build-info.json'), `${JSON.stringify({ version, commit: commit ? `${commit}${dirty ? '-dirty' : ''}` : 'unknown' })}\n`);
// Non-TypeScript files of src/ (report templates: src/bench/report.md) beside their
// compiled modules, which read them by a URL relative to their own.
cpSync(join(root, 'src'), out, { recursive: true, filter: (p) => statSync(p).isDirectory() || !p.endsWith('.ts') });
const dist = join(root, 'dist');
let st;
try {
  st = lstatSync(dist);
} catch {
  st = undefined;
}
// A plain dist/ folder from an older checkout: move it aside once (rename is atomic too).
if (st && !st.isSymbolicLink()) renameSync(dist, join(root, `.dist-old-${id}`));
const tmpLink = join(root, `.dist-link-${id}`);
symlinkSync(outName, tmpLink, 'dir');
renameSync(tmpLink, dist);
// Prune: keep the newest KEEP builds (the live one included).
const builds = readdirSync(root)
  .filter((n) => n.startsWith('.dist-') && !n.startsWith('.dist-link-'))
  .map((n) => ({ n, t: statSync(join(root, n)).mtimeMs }))
  .sort((a, b) => b.t - a.t);
for (const b of builds.slice(KEEP)) if (b.n !== outName) rmSync(join(root, b.n), { recursive: true, force: true });

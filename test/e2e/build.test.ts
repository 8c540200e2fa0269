/**
 * The build is atomic: `npm run build` (also run by `npm install`'s `prepare`) compiles into a
 * fresh `.dist-<id>/` and swaps the `dist` symlink with one rename, so a process started from the
 * previous build keeps a complete tree to import from while the rebuild runs and after it.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, lstatSync, realpathSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { test } from 'node:test';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

test('a rebuild swaps dist atomically and leaves the previous build intact', () => {
  const dist = join(root, 'dist');
  assert.ok(lstatSync(dist).isSymbolicLink(), 'dist is a symlink to a build folder (npm test builds first)');
  const before = realpathSync(dist);
  const r = spawnSync(process.execPath, [join(root, 'scripts', 'build.mjs')], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  const now = realpathSync(dist);
  assert.notEqual(now, before, 'dist points at the new build');
  assert.ok(existsSync(join(now, 'cli', 'main.js')), 'the new build is complete');
  assert.ok(existsSync(join(before, 'cli', 'main.js')) && existsSync(join(before, 'router', 'index.js')), 'the previous build is still whole for processes running from it');
  const v = spawnSync(process.execPath, [join(root, 'bin', 'pdserve.js'), '--help'], { encoding: 'utf8' });
  assert.equal(v.status, 0);
  assert.match(v.stdout, /Usage: pdserve/);
});

/**
 * The Node version the README and package.json promise (engines.node) is one every locked
 * dependency supports: npm warns (EBADENGINE) at install for any that needs a later one. And every
 * locked package with an install script has its decision in package.json's `allowScripts`: npm 11
 * blocks such scripts by default and ends `npm install` with a warning listing each one it skipped.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

const read = (f: string) => JSON.parse(readFileSync(new URL(`../../${f}`, import.meta.url), 'utf8'));

/** [major, minor] of the first version in a range alternative (its lower bound for >=, ^, ~ or an exact version). */
function lowerBound(alt: string): [number, number] | null {
  const m = /(\d+)(?:\.(\d+))?/.exec(alt);
  return m ? [Number(m[1]), Number(m[2] ?? 0)] : null;
}

test('every locked package runs on the Node version package.json promises', () => {
  const ours = lowerBound(read('package.json').engines.node as string)!;
  const lock = read('package-lock.json') as { packages: Record<string, { engines?: { node?: string } }> };
  const bad = Object.entries(lock.packages)
    .filter(([, p]) => typeof p.engines?.node === 'string')
    .filter(([, p]) =>
      !p.engines!.node!.split('||').some((alt) => {
        const lb = lowerBound(alt);
        return lb === null || lb[0] < ours[0] || (lb[0] === ours[0] && lb[1] <= ours[1]);
      }),
    )
    .map(([name, p]) => `${name}: node ${p.engines!.node}`);
  assert.deepEqual(bad, []);
});

test('every locked package with an install script is decided in allowScripts (npm 11 installs without a warning)', () => {
  const allow = (read('package.json').allowScripts ?? {}) as Record<string, boolean>;
  const lock = read('package-lock.json') as { packages: Record<string, { hasInstallScript?: boolean }> };
  const undecided = Object.entries(lock.packages)
    .filter(([, p]) => p.hasInstallScript === true)
    .map(([path]) => path.slice(path.lastIndexOf('node_modules/') + 'node_modules/'.length))
    .filter((name) => !(name in allow));
  assert.deepEqual(undecided, []);
  // denied (what npm 11 did silently): the prebuilt binaries, optional dependencies, serve; node-llama-cpp's
  // postinstall would load llama.cpp at install, or build it from source when no prebuilt one fits
  assert.equal(allow['node-llama-cpp'], false);
});

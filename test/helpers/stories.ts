/**
 * The trained test model, stories260K.gguf (TinyStories llama, vocab 512, no chat template; it
 * ends a story with BOS), found at `../shared/models/` from the repository root — in a git
 * worktree, from its main checkout's root too. Never committed; a test that needs it and finds
 * none says so loudly (and fails under CI=true).
 */
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');

/** The absolute path of stories260K.gguf, or null when absent. */
export function storiesModel(): string | null {
  const roots = [ROOT];
  try {
    roots.push(dirname(resolve(ROOT, execFileSync('git', ['rev-parse', '--git-common-dir'], { cwd: ROOT, encoding: 'utf8' }).trim())));
  } catch {
    // not a git checkout: the repo root alone
  }
  for (const r of roots) {
    const p = resolve(r, '../shared/models/stories260K.gguf');
    if (existsSync(p)) return p;
  }
  return null;
}

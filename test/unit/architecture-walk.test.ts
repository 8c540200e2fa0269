/**
 * docs/ARCHITECTURE.md's walk ("One request, traced") names functions as `name()` and methods as
 * `Class.method()`: each must be defined in src/ (a method in the file that defines its class),
 * so a rename or a move that leaves the walk behind fails here instead of misleading a reader.
 */
import assert from 'node:assert/strict';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

const ROOT = fileURLToPath(new URL('../../', import.meta.url));

function sources(dir: string): { path: string; text: string }[] {
  return readdirSync(dir).flatMap((f) => {
    const p = join(dir, f);
    return statSync(p).isDirectory() ? sources(p) : f.endsWith('.ts') ? [{ path: p.slice(ROOT.length), text: readFileSync(p, 'utf8') }] : [];
  });
}

/** The walk's section of the doc: from its heading to the next `## `. */
function walk(doc: string): string {
  const start = doc.indexOf('## One request, traced');
  assert.ok(start >= 0, 'docs/ARCHITECTURE.md has no "One request, traced" section');
  const end = doc.indexOf('\n## ', start + 1);
  return doc.slice(start, end < 0 ? undefined : end);
}

/** `name()` / `Class.method()` inside backticks. */
function citedCalls(text: string): string[] {
  return [...new Set([...text.matchAll(/`((?:[A-Z]\w*\.)?[A-Za-z_]\w*)\(\)`/g)].map((m) => m[1]!))];
}

/** A definition of `name` in `text`: function, const/let arrow or function, class member or object method. */
function defines(text: string, name: string): boolean {
  const n = name.replace(/\$/g, '\\$');
  return [
    new RegExp(`\\bfunction\\*?\\s+${n}\\s*[(<]`),
    new RegExp(`\\b(?:const|let|var)\\s+${n}\\s*(?::[^=]+)?=`),
    new RegExp(`^\\s*(?:(?:public|private|protected|static|async|override|readonly|get)\\s+)*${n}\\s*[(<]`, 'm'),
    new RegExp(`^\\s*(?:(?:public|private|protected|static|readonly)\\s+)*${n}\\s*[:=]\\s*(?:async\\s*)?(?:\\(|function)`, 'm'),
  ].some((re) => re.test(text));
}

const SRC = sources(join(ROOT, 'src'));

test("every function the architecture walk cites is defined in src/ (methods in their class's file)", () => {
  const cited = citedCalls(walk(readFileSync(join(ROOT, 'docs', 'ARCHITECTURE.md'), 'utf8')));
  assert.ok(cited.length >= 30, `the walk cites ${cited.length} functions as name(): expected the 13 steps' names`);
  const missing = cited.filter((c) => {
    const [cls, fn] = c.includes('.') ? c.split('.') : [undefined, c];
    const files = cls ? SRC.filter((f) => new RegExp(`\\bclass\\s+${cls}\\b`).test(f.text)) : SRC;
    return !files.some((f) => defines(f.text, fn!));
  });
  assert.deepEqual(missing, [], 'cited in docs/ARCHITECTURE.md\'s walk but not defined in src/');
});

test('the definition finder tells a definition from a call', () => {
  assert.ok(defines('export function pickPair(a) {}', 'pickPair'));
  assert.ok(defines('  private async handleGenerate(raw: unknown) {', 'handleGenerate'));
  assert.ok(defines('export const newRoomId = (): RoomId => x;', 'newRoomId'));
  assert.ok(defines('  static fromFailure(f: RoomFailure): ApiError {', 'fromFailure'));
  assert.ok(!defines('  this.driver.pickPair(x);', 'pickPair'));
  assert.ok(!defines('const y = pickPair(x);', 'pickPair'));
  assert.deepEqual(citedCalls('`a()` and `B.c()` but not `d` or `e(x)`'), ['a', 'B.c']);
});

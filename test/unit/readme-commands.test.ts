/**
 * Every command the README gives is one the CLI has: each `node bin/pdserve.js SUB …` line of its
 * shell blocks names a command and only that command's flags, each `pdserve SUB` of the commands
 * table is a command, each backticked `--flag` in the text is a flag of some command, and each
 * `npm …` is a script of package.json. (test/e2e/up.test.ts runs the quick start's requests.)
 * The same for the reference docs (docs/*.md, SECURITY.md): each backticked `--flag` is a flag of
 * some command, or of the other program the sentence names.
 */
import assert from 'node:assert/strict';
import { readdirSync, readFileSync } from 'node:fs';
import { test } from 'node:test';
import type { Command } from 'commander';
import { cliProgram } from '../../src/cli/main.js';

const README = readFileSync(new URL('../../README.md', import.meta.url), 'utf8');
const SCRIPTS = Object.keys((JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { scripts: Record<string, string> }).scripts);

/** The shell blocks' logical lines (`\` continuations joined, comments cut). */
function shellLines(md: string): string[] {
  return [...md.matchAll(/```sh\n([\s\S]*?)```/g)].flatMap((m) =>
    m[1]!
      .replace(/\\\n\s*/g, ' ')
      .split('\n')
      .map((l) => l.replace(/(^|\s)#.*$/, '').trim())
      .filter((l) => l.length > 0),
  );
}

/** Long flags of `cmd` (`--no-x` for a negatable one included). */
function flagsOf(cmd: Command): Set<string> {
  return new Set(cmd.options.flatMap((o) => [o.long, o.negate ? o.long : undefined].filter((x): x is string => !!x)).concat('--help'));
}

test('README: every pdserve command line names a command and flags that command has', async () => {
  const program = await cliProgram(['node', 'pdserve']);
  const byName = new Map(program.commands.map((c) => [c.name(), c]));
  const bad: string[] = [];
  const lines = shellLines(README).flatMap((l) => l.split(/&&|;/).map((x) => x.trim()));
  const cli = lines.filter((l) => /^node bin\/pdserve\.js\b/.test(l));
  assert.ok(cli.length >= 5, `README shell blocks hold ${cli.length} pdserve command lines`);
  for (const line of cli) {
    const [sub, ...args] = line.replace(/^node bin\/pdserve\.js\s+/, '').split(/\s+/);
    const cmd = byName.get(sub!);
    if (!cmd) {
      bad.push(`${line}: no command ${sub}`);
      continue;
    }
    const flags = flagsOf(cmd);
    for (const a of args) if (a.startsWith('--') && !flags.has(a.split('=')[0]!)) bad.push(`${line}: ${sub} has no ${a}`);
  }
  for (const line of lines.filter((l) => /^npm\b/.test(l))) {
    const m = /^npm (?:run (\S+)|(start|test))/.exec(line);
    if (m && !SCRIPTS.includes(m[1] ?? m[2]!)) bad.push(`${line}: no npm script ${m[1] ?? m[2]}`);
  }
  for (const m of README.matchAll(/^\| `pdserve ([a-z-]+)`(?:, `([a-z-]+)`)?(?:, `([a-z-]+)`)? \|/gm)) for (const sub of m.slice(1).filter(Boolean)) if (!byName.has(sub!)) bad.push(`commands table: no command ${sub}`);
  const all = new Set([...byName.values()].flatMap((c) => [...flagsOf(c)]));
  for (const m of README.matchAll(/`(--[a-z][a-z0-9-]*)/g)) if (!all.has(m[1]!)) bad.push(`text: no command has ${m[1]}`);
  assert.deepEqual(bad, []);
});

/** Flags of other programs the docs cite: curl, node's test runner, llama.cpp's server, SGLang. */
const FOREIGN_FLAGS = new Set(['--cacert', '--test-concurrency', '--cache-ram', '--enable-deterministic-inference']);

test('docs/*.md and SECURITY.md: every backticked --flag is a flag of a pdserve command', async () => {
  const program = await cliProgram(['node', 'pdserve']);
  const all = new Set([...program.commands.flatMap((c) => [...flagsOf(c)]), '--version']);
  // `pdserve sim` parses its own flags: its usage line is their list
  const sim = /usage: pdserve sim [^'`]*/.exec(readFileSync(new URL('../../src/sim/index.ts', import.meta.url), 'utf8'));
  assert.ok(sim, 'src/sim/index.ts prints a usage line');
  for (const m of sim[0].matchAll(/--[a-z][a-z0-9-]*/g)) all.add(m[0]);
  const docs = new URL('../../docs/', import.meta.url);
  const files = [new URL('../../SECURITY.md', import.meta.url), ...readdirSync(docs).filter((f) => f.endsWith('.md')).map((f) => new URL(f, docs))];
  const bad: string[] = [];
  for (const f of files) {
    for (const m of readFileSync(f, 'utf8').matchAll(/`(--[a-z][a-z0-9-]*)/g)) {
      const flag = m[1]!;
      // `--internal-tls-*`, `--kill-*-every`: a family named by its prefix
      const known = flag.endsWith('-') ? [...all].some((x) => x.startsWith(flag)) : all.has(flag) || FOREIGN_FLAGS.has(flag);
      if (!known) bad.push(`${f.pathname.split('/').slice(-2).join('/')}: ${flag}`);
    }
  }
  assert.deepEqual(bad, []);
});

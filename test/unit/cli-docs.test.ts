import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { CLI_DOC_PATH, cliMarkdown } from '../../src/cli/cli-docs.js';
import { cliProgram } from '../../src/cli/main.js';

test('docs/CLI.md is the reference generated from the commander definitions (run: node --import tsx src/cli/cli-docs.ts --write)', async () => {
  const program = await cliProgram([]);
  const md = cliMarkdown(program);
  const doc = readFileSync(new URL(`../../${CLI_DOC_PATH}`, import.meta.url), 'utf8');
  assert.equal(doc, md, `${CLI_DOC_PATH} is stale`);
  // every command and every flag of every command is in it, with its default
  for (const c of program.commands) {
    assert.ok(md.includes(`## pdserve ${c.name()}\n`), c.name());
    for (const o of c.options) {
      if (o.hidden) continue;
      assert.ok(md.includes(`\`${o.flags.replace(/\|/g, '\\|')}\``), `${c.name()} ${o.flags}`);
    }
  }
  assert.match(md, /\| `--threads <n>` \| `1` \| llama\.cpp threads/);
});

test('a default reads as --help prints it: durations as typed, an infinite rate as inf, never null or Infinity', async () => {
  const program = await cliProgram([]);
  const md = cliMarkdown(program);
  const bench = program.commands.find((c) => c.name() === 'bench')!;
  assert.match(bench.helpInformation(), /--request-rate[^]*?\(default: inf\)/);
  assert.match(md, /\| `--request-rate <r>` \| `inf` \|/);
  assert.match(md, /\| `--duration <time>` \| `1m` \|/);
  assert.doesNotMatch(md, /\| `(?:null|Infinity|NaN)` \|/);
  for (const c of program.commands) assert.doesNotMatch(c.helpInformation(), /\(default: (?:null|Infinity|NaN)\)/, c.name());
});

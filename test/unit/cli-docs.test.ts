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

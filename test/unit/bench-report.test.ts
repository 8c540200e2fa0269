/**
 * BENCHMARKS.md is the report template (src/bench/report.md) filled with tables rendered
 * from bench/results/*.json. The template and the code must name the same placeholders, the
 * committed file must be what `bench-suite --render-only` makes from the committed results, and a
 * report without results still states every goal.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { REPORT_TEMPLATE, renderReport, type SuiteMeta } from '../../src/bench/report.js';
import { reportFromResults } from '../../src/bench/suite.js';
import { fillTemplate, placeholders, readTemplate } from '../../src/bench/template.js';

const ROOT = fileURLToPath(new URL('../../', import.meta.url));
const RESULTS = join(ROOT, 'bench', 'results');
const plots = mkdtempSync(join(tmpdir(), 'pdserve-report-'));
after(() => rmSync(plots, { recursive: true, force: true }));

const template = readTemplate(REPORT_TEMPLATE, new URL('../../src/bench/', import.meta.url));
const suite = JSON.parse(readFileSync(join(RESULTS, 'suite.json'), 'utf8')) as { meta: SuiteMeta; sectionsRun: number[] };

describe('report template', () => {
  it('fills every placeholder; an empty block takes its line away', () => {
    assert.equal(fillTemplate('# t\n\n{{a}}\n\n{{b}}\n\nend {{c}}.\n', { a: 'A', b: '', c: 'C' }), '# t\n\nA\n\nend C.\n');
    assert.deepEqual(placeholders('{{x}} {{y_1}} {{x}}'), ['x', 'y_1']);
  });

  it('refuses a placeholder without a value and a value without a placeholder, naming them', () => {
    assert.throws(() => fillTemplate('{{a}} {{b}}', { a: '1' }), /no value for \{\{b\}\}/);
    assert.throws(() => fillTemplate('{{a}}', { a: '1', extra: '2' }), /no placeholder for extra/);
    assert.throws(() => renderReport(suite.meta, new Map(), {}, [], [], `${template}\n{{not_a_figure}}\n`), /no value for \{\{not_a_figure\}\}/);
    assert.throws(() => renderReport(suite.meta, new Map(), {}, [], [], template.replace('{{s3_body}}', '')), /no placeholder for s3_body/);
  });
});

describe('BENCHMARKS.md', () => {
  it('is what --render-only makes from bench/results (after editing the template or the report code: node bin/pdserve.js bench-suite --render-only)', () => {
    const md = reportFromResults(RESULTS, plots, suite.meta, suite.sectionsRun);
    assert.doesNotMatch(md, /\{\{/);
    assert.equal(readFileSync(join(ROOT, 'BENCHMARKS.md'), 'utf8'), md, 'BENCHMARKS.md is stale: run node bin/pdserve.js bench-suite --render-only');
  });

  it('is a reference of at most 5,000 words (as `wc -w` counts them: tables included)', () => {
    const words = readFileSync(join(ROOT, 'BENCHMARKS.md'), 'utf8').split(/\s+/).filter(Boolean).length;
    assert.ok(words <= 5000, `BENCHMARKS.md has ${words} words: trim the template (src/bench/report.md) or the renderers' tables, not the figures' JSON`);
  });

  it('with stored results: a summary table first, each section its table and reading', () => {
    const md = reportFromResults(RESULTS, plots, suite.meta, suite.sectionsRun);
    const headings = [...md.matchAll(/^## (.+)$/gm)].map((m) => m[1]);
    assert.equal(headings[0], 'Summary');
    for (const n of [1, 2, 3, 4, 5, 6, 7, 8, 9]) assert.ok(headings.some((h) => h!.startsWith(`${n}. `)), `section ${n}`);
    assert.match(md, /## Summary\n\n\| goal \| measured \| met\? \|/);
    assert.match(md, /\| 1\.0 MiB \| 64 \| [\d.]+ \([\d.]+\) \|.*\| \*\*\d\.\d\d×\*\* not judged \|/);
    assert.match(md, /Over TCP the excess over the floor is the work a bare socket skips/);
    // §8 needs llama-server built here (cmake, ninja): a checkout may hold no §8 results yet
    assert.doesNotMatch(md.replace(/^## 8\. Against llama-server\n[\s\S]*?(?=^## )/m, ''), /Not run yet/);
  });

  it('without results: every section says so and every goal is still stated', () => {
    const md = renderReport(suite.meta, new Map(), {}, [], ['_gpu figures_']);
    assert.equal((md.match(/_Not run yet\._/g) ?? []).length, 13, "one per section, §1's large states, §7's agents at scale and agent trace, §8's profile, §9's two routers");
    assert.match(md, /router adds ≤ 3 ms to TTFT p99 \(§5\) \| n\/a \| not measured/);
    assert.match(md, /PD TTFT ≤ 1\.10 × colocated at 512–8192 prompt tokens/);
    assert.match(md, /ITL p99 ≤ 0\.2 × colocated under prefill interference/);
    assert.match(md, /## GPU offload[^#]*_gpu figures_/);
  });
});

/**
 * The dashboard's time axis (assets/dashboard/app.js), run in a node:vm context with a stand-in
 * DOM and a uPlot that records its options: the x axis labels are one-line 24-hour HH:MM:SS in
 * local time, one per tick, with uPlot told to keep them at least 90 px apart (a label is ~60 px).
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { createContext, runInContext } from 'node:vm';

type Axis = { space: number; values: (u: unknown, ticks: number[]) => string[] };
type Opts = { axes: Axis[]; series: { label?: string; spanGaps?: boolean }[] };

/** Run app.js once against one /dashboard/data answer; resolves with the options of each chart it made. */
async function chartsOf(data: unknown): Promise<Opts[]> {
  const made: Opts[] = [];
  const el = (): Record<string, unknown> => {
    const e: Record<string, unknown> = { textContent: '', className: '', innerHTML: '', dataset: {}, clientWidth: 400, children: [] as unknown[] };
    e.appendChild = (c: unknown) => (e.children as unknown[]).push(c);
    e.append = (...c: unknown[]) => (e.children as unknown[]).push(...c);
    return e;
  };
  const els = new Map<string, Record<string, unknown>>();
  const document = { getElementById: (id: string) => els.get(id) ?? els.set(id, el()).get(id), querySelector: () => el(), createElement: () => el(), body: el() };
  let rendered!: () => void;
  const done = new Promise<void>((r) => (rendered = r));
  const context = createContext({
    document,
    uPlot: function uPlot(opts: Opts) {
      made.push(opts);
      return { setData() {} };
    },
    fetch: async () => ({ ok: true, json: async () => data }),
    // the poll's next round: the first render is all this test needs
    setTimeout: () => rendered(),
  });
  runInContext(readFileSync(new URL('../../assets/dashboard/app.js', import.meta.url), 'utf8'), context);
  await done;
  return made;
}

test('the time axis: HH:MM:SS in 24-hour local time, a label per tick, at least 90 px apart', async () => {
  const at = (h: number, m: number, s: number) => new Date(2026, 11, 2, h, m, s).getTime() / 1000;
  const t = [at(15, 4, 5), at(15, 4, 10), at(9, 0, 0), at(0, 0, 59), at(23, 59, 55)];
  const empty = t.map(() => null);
  const data = {
    status: 'ok', at: 0, gather_ms: 1, router: { inflight: 0, requests: {}, kv_events: {} }, prefix_store: null, rooms_by_phase: {}, findings: [], workers: [], room_failures: [],
    series: { t, ttft_p50_ms: empty, ttft_p95_ms: empty, itl_p50_ms: empty, itl_p95_ms: empty, tokens_per_s: t.map(() => 0), requests_per_s: empty, failed_per_s: empty, rejected_per_s: empty, failures: [] },
  };
  const charts = await chartsOf(data);
  assert.equal(charts.length, 3, 'TTFT, ITL and throughput charts');
  for (const c of charts) {
    const x = c.axes[0]!;
    assert.ok(x.space >= 90, `labels at least 90 px apart: ${x.space}`);
    assert.deepEqual(x.values(null, t), ['15:04:05', '15:04:10', '09:00:00', '00:00:59', '23:59:55']);
  }
});

test('an idle bucket (null: no request finished) is a gap in every line, not a line drawn across it', async () => {
  const t = [100, 105, 110, 115, 120];
  const gap = [12, null, null, 15, 14];
  const data = {
    status: 'ok', at: 0, gather_ms: 1, router: { inflight: 0, requests: {}, kv_events: {} }, prefix_store: null, rooms_by_phase: {}, findings: [], workers: [], room_failures: [],
    series: { t, ttft_p50_ms: gap, ttft_p95_ms: gap, itl_p50_ms: gap, itl_p95_ms: gap, tokens_per_s: t.map(() => 0), requests_per_s: t.map(() => 0), failed_per_s: t.map(() => 0), rejected_per_s: t.map(() => 0), failures: [] },
  };
  const charts = await chartsOf(data);
  for (const c of charts) {
    const lines = c.series.slice(1);
    assert.ok(lines.length > 0);
    // uPlot joins the points around a null only with spanGaps: true (its default is false)
    for (const s of lines) assert.notEqual(s.spanGaps, true, `series ${s.label} spans gaps`);
  }
});

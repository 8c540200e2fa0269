/**
 * `pdserve doctor --request ID` when a worker refuses its /debug/rooms (doctor run without the
 * cluster secret): the report says so, naming the worker and the secret, instead of a timeline
 * that silently lacks that worker's rooms. Real HTTP servers on loopback.
 */
import assert from 'node:assert/strict';
import { createServer, type Server } from 'node:http';
import { after, test } from 'node:test';
import { requestReport, renderRequestReport } from '../../src/doctor/request.js';

const servers: Server[] = [];
after(() => Promise.all(servers.map((s) => new Promise((r) => s.close(r)))));

/** A server answering `routes[path]` = [status, body]; 404 for anything else. Returns its base URL. */
async function serve(routes: (base: string) => Record<string, [number, unknown]>): Promise<string> {
  let base = '';
  const s = createServer((req, res) => {
    const [status, body] = routes(base)[req.url ?? ''] ?? [404, { error: { message: 'not found' } }];
    res.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(body));
  });
  servers.push(s);
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  base = `http://127.0.0.1:${(s.address() as { port: number }).port}`;
  return base;
}

const trace = { trace: 't1', rid: 'r1', room: '42', rooms: ['42'], label: null, prefill: null, decode: null, events: [{ at: 1000, what: 'received' }], outcome: 'ok' };
const room = { room: '42', rid: 'r1', trace: 't1', state: 'Success', phase: 'done', timeline: [{ at: 1001, why: 'create', state: 'Bootstrapping', phase: 'prealloc' }, { at: 1002, why: 'kv_done', state: 'Success', phase: 'done' }] };

test('doctor --request: a worker that refuses /debug/rooms unsigned is named with the cluster secret, not left out silently', async () => {
  const refused: [number, unknown] = [401, { error: { message: 'unsigned request', type: 'authentication_error', param: null, code: 'worker_unauthenticated' } }];
  const decode = await serve(() => ({ '/debug/rooms': refused }));
  const prefill = await serve(() => ({ '/debug/rooms': [200, { now: 2000, live: [], recent: [room] }] }));
  const router = await serve(() => ({ '/debug/traces/t1': [200, trace], '/workers': [200, { workers: [{ role: 'prefill', url: prefill }, { role: 'decode', url: decode }] }] }));
  const r = await requestReport(router, 't1', 2000);
  assert.equal(r.rooms.length, 1, 'the readable worker\'s room is joined');
  const notes = r.notes.filter((n) => n.includes(decode));
  assert.equal(notes.length, 1, JSON.stringify(r.notes));
  assert.match(notes[0]!, /HTTP 401/);
  assert.match(notes[0]!, /PDSERVE_CLUSTER_SECRET/);
  assert.ok(!r.notes.some((n) => n.includes(prefill)), 'a readable worker has no note');
  assert.match(renderRequestReport(r), /note: decode .*cluster secret/);
});

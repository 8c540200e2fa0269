/**
 * Builds and protocols (src/base/version.ts): the compatibility rule (same major), what a peer
 * that reports nothing speaks, the KV handshake's settings comparison, the router's `mismatch`
 * for a worker of another major, and doctor's findings for a mixed cluster.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { BUILD, IMPLIED_PROTOCOL, PROTOCOL_VERSION, peerProtocol, protocolMismatch, protocolVersion } from '../../src/base/version.js';
import { settingsMismatch } from '../../src/kv/handshake.js';
import { mismatchOf, routerMismatch, settingsFromHealth } from '../../src/router/pair-settings.js';
import type { WorkerState } from '../../src/router/worker-state.js';
import { diagnose } from '../../src/observe/diagnose.js';
import type { ClusterSnapshot, WorkerProbe } from '../../src/observe/gather.js';

test('same major = compatible; another major or a malformed version never', () => {
  assert.equal(protocolMismatch('1.0', '1.7'), undefined);
  assert.equal(protocolMismatch('1.0', '2.0'), 'protocol 1.0 ≠ 2.0 (another major)');
  assert.equal(protocolMismatch('1.0', 'banana'), 'protocol 1.0 ≠ banana (not MAJOR.MINOR)');
  assert.equal(peerProtocol(undefined), IMPLIED_PROTOCOL, 'a peer that reports none speaks 1.0');
  assert.equal(peerProtocol(7), '7');
  assert.equal(protocolVersion(), PROTOCOL_VERSION);
  assert.match(BUILD.id, /^\d+\.\d+\.\d+\+\S+$/);
  assert.equal(BUILD.id, `${BUILD.version}+${BUILD.commit}`);
});

test('the KV handshake: another protocol major is a settings mismatch naming both builds; a minor or an absent one is not', () => {
  const base = { fingerprint: 'f'.repeat(64), contextSize: 1024, batchSize: 128, flashAttention: false };
  assert.equal(settingsMismatch({ ...base, protocol: '1.0' }, { ...base, protocol: '1.3' }), undefined);
  assert.equal(settingsMismatch({ ...base, protocol: '1.0' }, base), undefined, 'an older peer (no protocol) speaks 1.0');
  assert.equal(settingsMismatch({ ...base, protocol: '1.0', build: '0.1.0+aaa' }, { ...base, protocol: '2.0', build: '0.2.0+bbb' }), 'protocol 1.0 ≠ 2.0 (another major), builds 0.1.0+aaa and 0.2.0+bbb');
  assert.deepEqual(settingsFromHealth({ ...base, protocol: '2.0', build: 'x' }), { ...base, protocol: '2.0', build: 'x' });
});

test("the router: a worker of another major is `mismatch with the router` (never a candidate); one of its own major pairs as before", () => {
  const settings = { fingerprint: 'f'.repeat(64), contextSize: 1024, batchSize: 128, flashAttention: false };
  const w = (role: 'prefill' | 'decode', protocol?: string): WorkerState => ({ role, url: `http://${role}-${protocol}`, bootstrapHost: null, bootstrapPort: null, healthy: true, draining: false, model: null, load: 0, lastError: null, lastCheckAt: 0, consecutiveFailures: 0, settings: { ...settings, ...(protocol ? { protocol, build: `b-${protocol}` } : {}) } });
  const odd = w('decode', '2.0');
  assert.match(routerMismatch(odd)!, /^protocol 1\.2 ≠ 2\.0 \(another major\): the router runs \S+, the worker b-2\.0$/);
  assert.match(mismatchOf(odd, [w('prefill', '1.0'), odd])!, /^mismatch with the router: protocol 1\.2 ≠ 2\.0/);
  assert.equal(routerMismatch(w('decode', '1.4')), undefined);
  assert.equal(routerMismatch(w('decode')), undefined, 'no protocol reported: 1.0');
  assert.equal(mismatchOf(w('decode', '1.0'), [w('prefill', '1.0')]), null);
});

const ok = (body: unknown) => ({ ok: true, status: 200, body, ms: 1 }) as any;
function worker(role: 'prefill' | 'decode', health: Record<string, unknown>): WorkerProbe {
  return { ref: { role, url: `http://${role}:1`, router: { healthy: true } }, health: ok({ status: 'ok', role, fingerprint: 'fp', slots: 1, slots_free: 1, ...health }), metrics: ok([]), rooms: ok({ role, now: 0, live: [], recent: [] }) };
}
function snap(workers: WorkerProbe[]): ClusterSnapshot {
  return { at: 0, gatherMs: 1, source: 'router http://r', router: { url: 'http://r', health: ok({ status: 'ok', build: { id: '0.1.0+new' }, protocol: '1.0' }), workers: ok({ workers: [] }), metrics: ok([]), traces: ok({ traces: [] }) }, workers } as unknown as ClusterSnapshot;
}

test('doctor: a worker of another major is a critical protocol_mismatch naming both builds; builds of one major are info', () => {
  const d = diagnose(snap([worker('prefill', { build: { id: '0.1.0+new' }, protocol: '1.0' }), worker('decode', { build: { id: '0.2.0+next' }, protocol: '2.0' })]));
  const f = d.findings.filter((x) => x.kind === 'protocol_mismatch');
  assert.equal(f.length, 1, JSON.stringify(d.findings.map((x) => x.kind)));
  assert.equal(f[0]!.severity, 'critical');
  assert.match(f[0]!.title, /^decode http:\/\/decode:1 \(0\.2\.0\+next\) cannot work with the router \(0\.1\.0\+new\): protocol 2\.0 ≠ 1\.0/);
  const old = diagnose(snap([worker('prefill', {}), worker('decode', { build: { id: '0.1.0+new' }, protocol: '1.0' })]));
  assert.ok(!old.findings.some((x) => x.kind === 'protocol_mismatch'), 'an older build (no protocol) speaks 1.0');
  const b = old.findings.find((x) => x.kind === 'builds');
  assert.equal(b?.severity, 'info');
  assert.ok(b!.details.some((l) => l.startsWith('an older build (no build id): prefill')));
  assert.ok(!diagnose(snap([worker('prefill', { build: { id: '0.1.0+new' }, protocol: '1.0' })])).findings.some((x) => x.kind === 'builds' || x.kind === 'protocol_mismatch'), 'one build: nothing');
});

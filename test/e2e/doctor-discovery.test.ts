/**
 * `pdserve doctor --discovery` against a real etcd (no model, no workers): records of workers
 * that are not running are gathered from etcd and reported unreachable (exit 2); a bad
 * --discovery value and an etcd that is down are clear errors (exit 3) within 10 s.
 * Without an `etcd` binary (Debian's etcd-server) it says so loudly (a failure under CI=true).
 */
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Etcd3 } from 'etcd3';
import { memberKey } from '../../src/membership/etcd.js';
import { freePort } from '../../src/up/cluster.js';
import { cli } from '../helpers/cli.js';
import { etcdBinary, startEtcd, type TestEtcd } from '../helpers/etcd.js';

let etcd: TestEtcd | undefined;

before(async () => {
  if (etcdBinary()) etcd = await startEtcd();
});
after(async () => {
  await etcd?.stop();
});

test('doctor --discovery gathers the workers etcd lists and names the dead ones', async (t) => {
  if (!etcd) {
    const msg = 'etcd is NOT installed: doctor --discovery was NOT tested (apt-get install etcd-server)';
    process.stderr.write(`\n!!!!! ${msg} !!!!!\n\n`);
    t.diagnostic(msg);
    assert.ok(!process.env.CI, msg);
    return;
  }
  const kv = new Etcd3({ hosts: etcd.clientUrl });
  const dead = { prefill: `http://127.0.0.1:${await freePort('127.0.0.1')}`, decode: `http://127.0.0.1:${await freePort('127.0.0.1')}` };
  try {
    for (const [role, url] of Object.entries(dead)) {
      await kv.put(memberKey(role, url)).value(JSON.stringify({ role, url, bootstrap_host: role === 'prefill' ? '127.0.0.1' : null, bootstrap_port: role === 'prefill' ? 1 : null, host: 'h', pid: 1, started_at: 1 }));
    }
    const out = await cli(['doctor', '--discovery', etcd.uri, '--json']);
    assert.equal(out.code, 2, out.out + out.err);
    const j = JSON.parse(out.out) as { source: string; findings: { kind: string; data?: { url?: string } }[] };
    assert.match(j.source, /^etcd etcd:\/\//);
    const unreachable = j.findings.filter((f) => f.kind === 'worker_unreachable').map((f) => f.data?.url).sort();
    assert.deepEqual(unreachable, Object.values(dead).sort());
  } finally {
    kv.close();
  }
  const bad = await cli(['doctor', '--discovery', 'http://nope']);
  assert.equal(bad.code, 3);
  assert.match(bad.err, /expected etcd:\/\/HOST:PORT/);
  const down = await cli(['doctor', '--discovery', `etcd://127.0.0.1:${await freePort('127.0.0.1')}`, '--json']);
  assert.equal(down.code, 3, down.out + down.err);
  assert.ok(down.ms < 10_000, `${down.ms} ms`);
  assert.match(JSON.parse(down.out).error, /cannot read worker membership from etcd|longer than/);
});

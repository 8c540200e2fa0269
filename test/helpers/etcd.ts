/**
 * A throwaway etcd for tests: `startEtcd` of src/up/etcd.ts (the one `pdserve up` starts) on free
 * loopback ports with a temp data dir (removed on stop). `etcdBinary()` is null when etcd is not
 * installed (`.ci/run` installs Debian's etcd-server); tests then say so loudly and skip.
 */
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort } from '../../src/up/cluster.js';
import { etcdOnPath, startEtcd as startEtcdProcess, type LocalEtcd } from '../../src/up/etcd.js';

/** The `etcd` binary on PATH, or null. */
export const etcdBinary = etcdOnPath;

export type TestEtcd = LocalEtcd;

/**
 * Start etcd and wait until GET /health answers (deadline `timeoutMs`). `ports` reuses a stopped
 * one's address; under `wrap` (a network namespace) the default ports are etcd's own 2379/2380.
 */
export async function startEtcd(o: { host?: string; bin?: string; timeoutMs?: number; wrap?: string[]; ports?: { client: number; peer: number } } = {}): Promise<TestEtcd> {
  const host = o.host ?? '127.0.0.1';
  const bin = o.bin ?? etcdBinary();
  if (!bin) throw new Error('etcd is not installed (apt-get install etcd-server)');
  const client = o.ports?.client ?? (o.wrap ? 2379 : await freePort(host));
  const peer = o.ports?.peer ?? (o.wrap ? 2380 : await freePort(host));
  return startEtcdProcess({ bin, host, dataDir: mkdtempSync(join(tmpdir(), 'pdserve-etcd-')), ports: { client, peer }, wrap: o.wrap, timeoutMs: o.timeoutMs });
}

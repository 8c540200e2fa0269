/**
 * A throwaway etcd for tests: Debian's `etcd` binary on free loopback ports with a temp data dir
 * (removed on stop). `etcdBinary()` is null when etcd is not installed (`.ci/run` installs
 * Debian's etcd-server); tests then say so loudly and skip.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort } from '../../src/up/cluster.js';

export function etcdBinary(): string | null {
  const r = spawnSync('sh', ['-c', 'command -v etcd'], { encoding: 'utf8' });
  return r.status === 0 && r.stdout.trim() ? r.stdout.trim() : null;
}

export interface TestEtcd {
  /** etcd://host:port, the form --discovery takes. */
  uri: string;
  clientUrl: string;
  /** The client and peer ports (pass them back to start it again, empty, on the same address). */
  ports: { client: number; peer: number };
  child: ChildProcess;
  /** Stop it and delete its data (a restart with the same ports is an etcd wiped). */
  stop(): Promise<void>;
}

/** Start etcd and wait until GET /health answers (deadline `timeoutMs`). */
export async function startEtcd(o: { host?: string; bin?: string; timeoutMs?: number; wrap?: string[]; ports?: { client: number; peer: number } } = {}): Promise<TestEtcd> {
  const host = o.host ?? '127.0.0.1';
  const bin = o.bin ?? etcdBinary();
  if (!bin) throw new Error('etcd is not installed (apt-get install etcd-server)');
  const dir = mkdtempSync(join(tmpdir(), 'pdserve-etcd-'));
  const cport = o.ports?.client ?? (o.wrap ? 2379 : await freePort(host));
  const pport = o.ports?.peer ?? (o.wrap ? 2380 : await freePort(host));
  const clientUrl = `http://${host}:${cport}`;
  const peerUrl = `http://${host}:${pport}`;
  const args = ['--name', 't', '--data-dir', dir, '--listen-client-urls', clientUrl, '--advertise-client-urls', clientUrl, '--listen-peer-urls', peerUrl, '--initial-advertise-peer-urls', peerUrl, '--initial-cluster', `t=${peerUrl}`, '--log-level', 'error'];
  const [cmd, argv] = o.wrap ? [o.wrap[0]!, [...o.wrap.slice(1), bin, ...args]] : [bin, args];
  const child = spawn(cmd, argv, { stdio: 'ignore' });
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      const exited = new Promise((r) => child.once('exit', r));
      child.kill('SIGTERM');
      const t = setTimeout(() => child.kill('SIGKILL'), 3000);
      await exited;
      clearTimeout(t);
    }
    rmSync(dir, { recursive: true, force: true });
  };
  const end = Date.now() + (o.timeoutMs ?? 15_000);
  for (;;) {
    try {
      const r = await fetch(`${clientUrl}/health`, { signal: AbortSignal.timeout(500) });
      if (r.ok && ((await r.json()) as { health?: string }).health === 'true') break;
    } catch {
      // not up yet
    }
    if (child.exitCode !== null || Date.now() > end) {
      await stop();
      throw new Error(`etcd did not become ready on ${clientUrl}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return { uri: `etcd://${host}:${cport}`, clientUrl, ports: { client: cport, peer: pport }, child, stop };
}

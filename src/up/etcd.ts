/**
 * A local etcd for `pdserve up --routers K` (several routers share membership, admission shards
 * and stored Responses through etcd): Debian's `etcd` binary (package etcd-server) on free
 * loopback ports, its data in a folder under the cluster's log folder, removed on stop.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { ConfigError, PdError } from '../base/errors.js';

/** The `etcd` binary on PATH, or null. */
export function etcdOnPath(): string | null {
  const r = spawnSync('sh', ['-c', 'command -v etcd'], { encoding: 'utf8' });
  return r.status === 0 && r.stdout.trim() ? r.stdout.trim() : null;
}

/** A running local etcd. */
export interface LocalEtcd {
  /** `etcd://HOST:PORT`, the form --discovery takes. */
  uri: string;
  child: ChildProcess;
  /** SIGTERM (SIGKILL after 3 s) and remove its data folder. Idempotent. */
  stop(): Promise<void>;
}

/**
 * Start etcd on `host` (client and peer ports from `ports()`), data under `dir`, and wait until
 * its GET /health says true (deadline `timeoutMs`, default 15 s).
 * @throws ConfigError when no `etcd` binary is installed; PdError ETCD_FAILED when it does not become ready.
 */
export async function startLocalEtcd(o: { host: string; dir: string; ports: () => Promise<number>; timeoutMs?: number }): Promise<LocalEtcd> {
  const bin = etcdOnPath();
  if (!bin) throw new ConfigError('several routers need etcd and no `etcd` binary is installed (apt-get install etcd-server), or pass --discovery etcd://HOST:PORT');
  const dir = join(o.dir, 'etcd');
  mkdirSync(dir, { recursive: true });
  const clientUrl = `http://${o.host}:${await o.ports()}`;
  const peerUrl = `http://${o.host}:${await o.ports()}`;
  const args = ['--name', 'pdserve', '--data-dir', dir, '--listen-client-urls', clientUrl, '--advertise-client-urls', clientUrl, '--listen-peer-urls', peerUrl, '--initial-advertise-peer-urls', peerUrl, '--initial-cluster', `pdserve=${peerUrl}`, '--log-level', 'error'];
  const child = spawn(bin, args, { stdio: 'ignore' });
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
      throw new PdError('ETCD_FAILED', `the local etcd did not become ready on ${clientUrl}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return { uri: `etcd://${clientUrl.slice('http://'.length)}`, child, stop };
}

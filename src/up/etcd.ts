/**
 * A local etcd for `pdserve up --routers K` (several routers share membership, admission shards
 * and stored Responses through etcd): Debian's `etcd` binary (package etcd-server) on free
 * loopback ports, its data in a folder under the cluster's log folder, removed on stop. The test
 * harness starts its throwaway etcds with the same `startEtcd`.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { ConfigError, PdError } from '../base/errors.js';
import { childReady, stopChild } from './child.js';

/** The `etcd` binary on PATH, or null. */
export function etcdOnPath(): string | null {
  const r = spawnSync('sh', ['-c', 'command -v etcd'], { encoding: 'utf8' });
  return r.status === 0 && r.stdout.trim() ? r.stdout.trim() : null;
}

/** A running etcd. */
export interface LocalEtcd {
  /** `etcd://HOST:PORT`, the form --discovery takes. */
  uri: string;
  /** `http://HOST:PORT`, its client URL. */
  clientUrl: string;
  /** Its client and peer ports (pass them back to start it again, empty, on the same address). */
  ports: { client: number; peer: number };
  child: ChildProcess;
  /** SIGTERM (SIGKILL after 3 s) and remove its data folder. Idempotent. */
  stop(): Promise<void>;
}

/**
 * Start Debian's etcd `bin` as a one-member cluster on `host` (client and peer ports `ports`),
 * its data in `dataDir` (made if missing, removed on stop), and wait until its GET /health says
 * true (deadline `timeoutMs`, default 15 s). `wrap` is a command line to run it under (as
 * `ip netns exec NS`); its first word is the process spawned.
 * @throws PdError ETCD_FAILED when it exits or is not ready by the deadline (it is stopped first).
 */
export async function startEtcd(o: { bin: string; host: string; dataDir: string; ports: { client: number; peer: number }; wrap?: readonly string[]; timeoutMs?: number }): Promise<LocalEtcd> {
  mkdirSync(o.dataDir, { recursive: true });
  const clientUrl = `http://${o.host}:${o.ports.client}`;
  const peerUrl = `http://${o.host}:${o.ports.peer}`;
  const args = ['--name', 'pdserve', '--data-dir', o.dataDir, '--listen-client-urls', clientUrl, '--advertise-client-urls', clientUrl, '--listen-peer-urls', peerUrl, '--initial-advertise-peer-urls', peerUrl, '--initial-cluster', `pdserve=${peerUrl}`, '--log-level', 'error'];
  const [cmd, argv] = o.wrap?.length ? [o.wrap[0]!, [...o.wrap.slice(1), o.bin, ...args]] : [o.bin, args];
  const child = spawn(cmd, argv, { stdio: 'ignore' });
  const stop = async () => {
    await stopChild(child, 'SIGTERM', 3000);
    rmSync(o.dataDir, { recursive: true, force: true });
  };
  const health = async () => {
    const r = await fetch(`${clientUrl}/health`, { signal: AbortSignal.timeout(500) });
    return r.ok && ((await r.json()) as { health?: string }).health === 'true';
  };
  if (!(await childReady(child, health, o.timeoutMs ?? 15_000))) {
    await stop();
    throw new PdError('ETCD_FAILED', `etcd did not become ready on ${clientUrl}`);
  }
  return { uri: `etcd://${o.host}:${o.ports.client}`, clientUrl, ports: { ...o.ports }, child, stop };
}

/**
 * Start the local etcd of `pdserve up --routers K` on `host` (client and peer ports from
 * `ports()`), data under `dir`/etcd: `startEtcd` with the binary on PATH.
 * @throws ConfigError when no `etcd` binary is installed; PdError ETCD_FAILED when it does not become ready.
 */
export async function startLocalEtcd(o: { host: string; dir: string; ports: () => Promise<number>; timeoutMs?: number }): Promise<LocalEtcd> {
  const bin = etcdOnPath();
  if (!bin) throw new ConfigError('several routers need etcd and no `etcd` binary is installed (apt-get install etcd-server), or pass --discovery etcd://HOST:PORT');
  const client = await o.ports();
  const peer = await o.ports();
  return startEtcd({ bin, host: o.host, dataDir: join(o.dir, 'etcd'), ports: { client, peer }, timeoutMs: o.timeoutMs });
}

/**
 * `pdserve doctor --discovery etcd://HOST:PORT[,…]`: the worker list from etcd membership (the
 * records workers publish under `pdserve/v1/workers/`, see ./etcd.ts), read once per round with
 * the same `listMembers` the router's watch uses. With `--url` as well, the router is probed too and
 * its GET /workers rows are joined by URL; workers only one side knows are flagged
 * (`membership: 'etcd_only' | 'router_only'`) for the diagnosis.
 */
import { etcdClient, listMembers } from './etcd.js';
import { listRouters } from './router-state.js';
import { systemClock } from '../base/clock.js';
import type { WorkerRef, WorkerSource } from '../observe/gather.js';
import { PdError } from '../base/errors.js';

/** A WorkerSource reading etcd membership (and the router's rows when `routerUrl` is given). */
export function discoverySource(uri: string, routerUrl: string | null): WorkerSource {
  const base = routerUrl?.replace(/\/+$/, '') ?? null;
  return {
    describe: `etcd ${uri}${base ? ` + router ${base}` : ''}`,
    routerUrl: base,
    async list(router) {
      const client = etcdClient(uri);
      try {
        let members: Awaited<ReturnType<typeof listMembers>>['members'];
        try {
          members = (await listMembers(client)).members;
        } catch (err) {
          throw new PdError('ETCD_FAILED', `cannot read worker membership from etcd at ${uri}: ${(err as Error).message}`);
        }
        const rows = base ? (router?.workers.body?.workers ?? []) : [];
        const refs: WorkerRef[] = [];
        for (const rec of members.values()) {
          if (rec.role !== 'prefill' && rec.role !== 'decode') continue;
          const url = new URL(rec.url).origin;
          const row = rows.find((r) => r.url === url);
          refs.push({ role: rec.role, url, router: row ?? { draining: rec.draining, bootstrap_port: rec.bootstrap_port, ...(base && router?.workers.ok ? { membership: 'etcd_only' } : {}) } });
        }
        for (const r of rows) {
          if ((r.role === 'prefill' || r.role === 'decode') && typeof r.url === 'string' && !refs.some((x) => x.url === r.url)) refs.push({ role: r.role, url: r.url, router: { ...r, membership: 'router_only' } });
        }
        return refs;
      } finally {
        client.close();
      }
    },
    async routers() {
      const client = etcdClient(uri);
      try {
        const now = systemClock.wallMs();
        return (await listRouters(client)).map((p) => ({ url: p.url, ageMs: Math.max(0, now - p.updated_at), view: p.view }));
      } finally {
        client.close();
      }
    },
  };
}

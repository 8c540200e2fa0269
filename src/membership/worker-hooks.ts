/**
 * Glue between a served worker role and etcd membership (./etcd.ts): the record is built from
 * the worker's own GET /health (served in-process with `app.inject`, no socket) plus the engine
 * settings from the command line, and the URL the router must dial. The served role is seen
 * through `ServedWorker` (the CLI's `Served` is one): membership does not import the CLI.
 */
import { Membership, processFields, type MemberRecord } from './etcd.js';
import { createLogger } from '../base/log.js';
import { ConfigError } from '../base/errors.js';

/** What registration reads of a served worker: its URL and, for workers, its app (GET /health in-process). */
export interface ServedWorker {
  url: string;
  app?: { inject(o: { method: 'GET'; url: string }): Promise<{ json(): unknown }> };
}

/** The serve loop's hook (the CLI's `ServeHooks`): register once ready; announce draining; deregister. */
export interface RegisterHooks {
  register(s: ServedWorker): Promise<{ setDraining(): Promise<void>; deregister(): Promise<void> }>;
}

export interface MembershipFlags {
  discovery?: string;
  /** Address other hosts use to reach this worker (default: --host; required with --host 0.0.0.0/::). */
  advertiseHost?: string;
  discoveryTtlS?: number;
}

const LOAD_KEYS = /^(slots|slots_free|rooms|inflight)$|_queue$|_running$|_used$/;

/**
 * Hooks that register the worker in etcd after it is ready, or undefined without --discovery.
 * @throws Error when the advertised address would be a wildcard.
 */
export function membershipHooks(role: 'prefill' | 'decode' | 'colocated', o: MembershipFlags & { host: string }, engine: Record<string, string | number | boolean | null>): RegisterHooks | undefined {
  if (!o.discovery) return undefined;
  const discovery = o.discovery;
  const adv = o.advertiseHost ?? o.host;
  if (adv === '0.0.0.0' || adv === '::') throw new ConfigError(`--discovery with --host ${o.host}: pass --advertise-host with the address the router and peers dial`);
  const log = createLogger(`${role}-membership`);
  return {
    async register(s: ServedWorker) {
      const { port, protocol } = new URL(s.url);
      const url = `${protocol}//${adv.includes(':') ? `[${adv}]` : adv}:${port}`;
      const proc = processFields();
      const record = async (): Promise<MemberRecord> => {
        const h = s.app ? ((await s.app.inject({ method: 'GET', url: '/health' })).json() as Record<string, unknown>) : {};
        const load: Record<string, number> = {};
        for (const [k, v] of Object.entries(h)) if (typeof v === 'number' && LOAD_KEYS.test(k)) load[k] = v;
        return {
          role,
          url,
          bootstrap_host: role === 'prefill' ? String(h.bootstrap_host ?? adv) : null,
          bootstrap_port: role === 'prefill' && typeof h.bootstrap_port === 'number' ? h.bootstrap_port : null,
          model: typeof h.model === 'string' ? h.model : null,
          fingerprint: typeof h.fingerprint === 'string' ? h.fingerprint : null,
          engine,
          load,
          draining: h.status === 'draining',
          epoch: typeof h.epoch === 'string' ? h.epoch : null,
          ...proc,
        };
      };
      const m = await Membership.join({ discovery, record, ttlS: o.discoveryTtlS, log });
      return { setDraining: () => m.setDraining(), deregister: () => m.leave() };
    },
  };
}

/**
 * The router's side of a worker's role switch (POST /workers/role {url, role}, admin access): the
 * operators' and the planner's one way to flip a `pdserve worker` between prefill and decode.
 *
 * | step | what |
 * |---|---|
 * | 1 | refuse: unknown worker (404), not switchable, a switch already running, or the last routable worker of its role (409 `role_switch_refused`) |
 * | 2 | GET /role: the epoch the switch is asked under |
 * | 3 | take it out of the pool (`switching`: draining, whatever its probes say) |
 * | 4 | POST /role {role, epoch} (signed; the worker drains, tears down, rebuilds: ../switch/host.ts) |
 * | 5 | verify GET /role: the new role, serving, the epoch the switch answered; only then re-add it in the new role (probed at once) |
 * | 6 | a failure: `safe_to_restore` (serving its old role again) → back in the pool as before; else unhealthy (`last_error` says why), never routed |
 *
 * Borrowed: SGLang's router-driven `/pd_role_switch` (out of the pool first, `safe_to_restore`)
 * and llm-d's rule that the router verifies the new role before it routes to it.
 */
import { request, type Dispatcher } from 'undici';
import type { Logger } from 'pino';
import { ApiError } from '../base/errors.js';
import { systemClock } from '../base/clock.js';
import { describeError, readText, type WorkerRegistry } from './registry.js';
import type { WorkerRole, WorkerState } from './worker-state.js';

/** What a worker's GET /role says (../worker/shell.ts `WorkerIdentity`). */
export interface RoleAnswer {
  role: WorkerRole;
  epoch: string;
  switchable: boolean;
  state: 'serving' | 'switching' | 'failed';
  bootstrap_host: string | null;
  bootstrap_port: number | null;
}

export interface RoleSwitchContext {
  registry: WorkerRegistry;
  /** The signed control-plane agent (health probes). */
  dispatcher: Dispatcher;
  log: Logger;
  /** Longest wait for the worker's POST /role (its drain and rebuild), ms. */
  switchTimeoutMs: number;
}

/** The answer of POST /workers/role: HTTP status and JSON body. */
export interface SwitchOutcome {
  status: number;
  body: Record<string, unknown>;
}

const MAX_BODY = 64 * 1024;

/** Parse a GET /role body; null when it is not one. */
export function roleAnswerOf(j: unknown): RoleAnswer | null {
  const o = j as Partial<RoleAnswer> | null;
  if (!o || (o.role !== 'prefill' && o.role !== 'decode') || typeof o.epoch !== 'string') return null;
  const state = o.state === 'switching' || o.state === 'failed' ? o.state : 'serving';
  return { role: o.role, epoch: o.epoch, switchable: o.switchable === true, state, bootstrap_host: typeof o.bootstrap_host === 'string' ? o.bootstrap_host : null, bootstrap_port: typeof o.bootstrap_port === 'number' ? o.bootstrap_port : null };
}

/** GET /role of the worker at `url` (signed), or the reason it could not be read. */
export async function readRole(url: string, dispatcher: Dispatcher, timeoutMs: number): Promise<RoleAnswer | string> {
  try {
    const res = await request(`${url}/role`, { method: 'GET', dispatcher, signal: AbortSignal.timeout(timeoutMs), headersTimeout: timeoutMs, bodyTimeout: timeoutMs });
    const text = await readText(res.body, MAX_BODY);
    if (res.statusCode !== 200) return `GET /role: HTTP ${res.statusCode}`;
    return roleAnswerOf(JSON.parse(text)) ?? 'GET /role: not a role answer';
  } catch (err) {
    return `GET /role: ${describeError(err)}`;
  }
}

/** Switches running now, by worker URL (one per worker; the planner runs one at a time anyway). */
const running = new WeakMap<WorkerRegistry, Set<string>>();

/**
 * Run one role switch of the worker at `url` to `role` (see the module doc). Never throws: every
 * outcome is a status and a body (`verified`, `safe_to_restore`, the worker's new role and epoch).
 */
export async function switchWorkerRole(ctx: RoleSwitchContext, url: string, role: WorkerRole): Promise<SwitchOutcome> {
  const { registry, log } = ctx;
  const w = registry.workers.find((x) => x.url === url.replace(/\/+$/, ''));
  if (!w) return fail(ApiError.of('worker_not_found', `no worker ${JSON.stringify(url)} in the pool`, 'url'));
  if (w.role === role) return { status: 200, body: { url: w.url, role, epoch: w.epoch ?? null, switched: false, verified: true } };
  const busy = running.get(registry) ?? new Set<string>();
  running.set(registry, busy);
  if (busy.has(w.url) || w.switching) return fail(ApiError.of('role_switch_refused', `a role switch of ${w.url} is already running`));
  const others = registry.workers.filter((x) => x !== w && x.role === w.role && x.healthy && !x.draining && !x.switching);
  if (others.length === 0) return fail(ApiError.of('role_switch_refused', `${w.url} is the last routable ${w.role} worker: switching it would leave no ${w.role}`));
  busy.add(w.url);
  try {
    return await run(ctx, w, role);
  } finally {
    busy.delete(w.url);
  }
}

async function run(ctx: RoleSwitchContext, w: WorkerState, role: WorkerRole): Promise<SwitchOutcome> {
  const { registry, log, dispatcher } = ctx;
  const t0 = systemClock.nowMs();
  const from = w.role;
  const before = await readRole(w.url, dispatcher, 5000);
  if (typeof before === 'string') return fail(ApiError.of('role_switch_refused', `cannot read ${w.url}'s role: ${before}`));
  if (!before.switchable) return fail(ApiError.of('role_switch_refused', `${w.url} cannot switch role (a fixed ${before.role} worker: start it with \`pdserve worker --role ${before.role}\`)`));
  if (before.role !== from || before.state !== 'serving') return fail(ApiError.of('role_switch_refused', `${w.url} is ${before.state} as ${before.role}, the router has it as ${from}: wait for a probe`));
  registry.setSwitching(w, `switching to ${role}`);
  log.info({ worker: w.url, from, to: role, epoch: before.epoch }, 'role switch: worker out of the pool');
  let answer: { status: number; body: Record<string, unknown> } | string;
  try {
    const res = await request(`${w.url}/role`, { method: 'POST', dispatcher, headers: { 'content-type': 'application/json' }, body: JSON.stringify({ role, epoch: before.epoch }), signal: AbortSignal.timeout(ctx.switchTimeoutMs), headersTimeout: ctx.switchTimeoutMs, bodyTimeout: ctx.switchTimeoutMs });
    const text = await readText(res.body, MAX_BODY);
    let body: Record<string, unknown> = {};
    try {
      body = JSON.parse(text) as Record<string, unknown>;
    } catch {
      body = { text: text.slice(0, 200) };
    }
    answer = { status: res.statusCode, body };
  } catch (err) {
    answer = `POST /role: ${describeError(err)}`;
  }
  // Whatever the answer said, what counts is what the worker is now.
  const after = await readRole(w.url, dispatcher, 5000);
  const ms = Math.round(systemClock.nowMs() - t0);
  const answered = typeof answer === 'string' ? null : answer;
  const newEpoch = typeof answered?.body.epoch === 'string' ? answered.body.epoch : null;
  if (answered?.status === 200 && typeof after !== 'string' && after.role === role && after.state === 'serving' && after.epoch === newEpoch) {
    registry.remove(w.url, `switched to ${role}`);
    const nw = registry.upsert({ role, url: w.url, bootstrapHost: role === 'prefill' ? after.bootstrap_host : null, bootstrapPort: role === 'prefill' ? after.bootstrap_port : null });
    await registry.refresh(nw);
    log.info({ worker: w.url, from, to: role, epoch: after.epoch, previous_epoch: before.epoch, ms, healthy: nw.healthy }, 'role switch: verified (GET /role), back in the pool in its new role');
    return { status: 200, body: { url: w.url, role, previous_role: from, epoch: after.epoch, previous_epoch: before.epoch, switched: true, verified: true, healthy: nw.healthy, ms, drain_ms: answered.body.drain_ms ?? null } };
  }
  const why = typeof answer === 'string' ? answer : answer.status === 200 ? `unverified: GET /role says ${typeof after === 'string' ? after : `${after.role} ${after.state} epoch ${after.epoch}`}, the switch answered ${role} epoch ${newEpoch}` : `POST /role: HTTP ${answer.status} ${JSON.stringify(answer.body).slice(0, 300)}`;
  // Safe to restore only when the worker itself serves its old role again (its answer and GET /role agree).
  const restore = typeof after !== 'string' && after.role === from && after.state === 'serving';
  if (restore) {
    registry.setSwitching(w, null);
    await registry.refresh(w);
    log.warn({ worker: w.url, from, to: role, why, ms }, 'role switch failed: the worker serves its old role again (safe_to_restore)');
  } else {
    w.healthy = false;
    w.lastError = `role switch to ${role} failed: ${why}`;
    log.error({ worker: w.url, from, to: role, why, ms }, 'role switch failed: the worker is out of the pool (unhealthy) until an operator restarts it');
  }
  const err = ApiError.of('role_switch_failed', `role switch of ${w.url} to ${role} failed: ${why}`);
  return { status: err.status, body: { ...(err.toBody() as unknown as Record<string, unknown>), url: w.url, safe_to_restore: restore, role: typeof after === 'string' ? null : after.role, epoch: typeof after === 'string' ? null : after.epoch, verified: false, ms } };
}

function fail(err: ApiError): SwitchOutcome {
  return { status: err.status, body: err.toBody() as unknown as Record<string, unknown> };
}

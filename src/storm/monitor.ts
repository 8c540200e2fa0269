/**
 * The storm's view of the workers while it runs and after it drains.
 *
 * `RoomMonitor` polls every worker's `GET /debug/rooms` (one probe per worker in flight, short
 * deadline) and keeps: live rooms by state (the progress line), wedges (a live room past its
 * phase deadline by more than a grace period, seen so in two consecutive polls of the same
 * process), process epochs (a changed epoch the storm did not cause is a crash), and the first
 * successful room on a worker after each injected fault (its recovery time).
 *
 * `collectLeaks` reads every gauge that must be zero on an idle cluster (worker queue and room
 * gauges, slots in use, pending registrations, the router's in-flight count and per-worker
 * load) and names the live rooms still holding anything.
 */
import { getJson, getText } from './client.js';
import type { RoomView } from '../protocol/debug-rooms.js';
export type { RoomView };

interface DebugRooms {
  role?: string;
  now?: number;
  epoch?: string;
  pending_registrations?: number;
  live?: RoomView[];
  recent?: RoomView[];
}

/** A worker the storm watches. */
export interface WatchedWorker {
  name: string;
  url: string;
}

/** A room found wedged: live, past its deadline. */
export interface Wedge {
  worker: string;
  room: RoomView;
  /** How far past the deadline, ms (at the last sighting). */
  overdueMs: number;
  /** Wall-clock ms of the first sighting. */
  firstSeen: number;
  sightings: number;
}

/** A fault whose recovery the monitor watches: the first Success room on `worker` after `at`. */
export interface WatchedFault {
  worker: string;
  /** Wall-clock ms (Date.now()) of the injection. */
  at: number;
  /** Wall-clock ms of the worker's first successful room after `at` (set by the monitor). */
  workerOkAt?: number;
}

export interface MonitorOptions {
  pollMs: number;
  /** A room must be overdue by more than this to count as wedged (the watchdog runs every 100 ms). */
  graceMs: number;
  timeoutMs?: number;
}

type StateCounts = Record<string, number>;

interface PerWorker {
  w: WatchedWorker;
  inflight: boolean;
  /** Polls started before this wall-clock ms are discarded (the process was stopped). */
  ignoreBefore: number;
  paused: boolean;
  epoch?: string;
  /** Epoch changes the storm caused (restarts) are announced with `expectRestart`. */
  expectedRestarts: number;
  unexpectedEpochChanges: { from: string; to: string; at: number }[];
  live: StateCounts;
  /** Overdue rooms of the previous poll: room → overdue ms. */
  overdue: Map<string, number>;
  okPolls: number;
  failedPolls: number;
  lastError?: string;
}

/** Polls /debug/rooms of every worker; see the module doc. */
export class RoomMonitor {
  readonly wedges = new Map<string, Wedge>();
  readonly faults: WatchedFault[] = [];
  private readonly ws: PerWorker[];
  private timer?: NodeJS.Timeout;
  private running = false;

  constructor(
    workers: WatchedWorker[],
    private readonly o: MonitorOptions,
  ) {
    this.ws = workers.map((w) => ({ w, inflight: false, ignoreBefore: 0, paused: false, expectedRestarts: 0, unexpectedEpochChanges: [], live: {}, overdue: new Map(), okPolls: 0, failedPolls: 0 }));
  }

  /** Poll now, then every `pollMs` until `stop()`. */
  start(): void {
    this.running = true;
    const loop = () => {
      if (!this.running) return;
      void this.pollAll().finally(() => {
        if (this.running) this.timer = setTimeout(loop, this.o.pollMs);
      });
    };
    loop();
  }

  /** Stop polling (a poll in flight completes). */
  stop(): void {
    this.running = false;
    if (this.timer) clearTimeout(this.timer);
  }

  private get(name: string): PerWorker {
    const p = this.ws.find((x) => x.w.name === name);
    if (!p) throw new Error(`unknown worker ${name}`);
    return p;
  }

  /** The storm is about to SIGSTOP `name`: stop polling it. */
  pause(name: string): void {
    const p = this.get(name);
    p.paused = true;
    p.ignoreBefore = Infinity;
  }

  /** `name` was sent SIGCONT: poll it again, discarding answers to polls sent before now + settleMs. */
  resume(name: string, settleMs = 1000): void {
    const p = this.get(name);
    p.paused = false;
    p.ignoreBefore = Date.now() + settleMs;
    p.overdue.clear();
  }

  /** The storm restarts `name` on purpose: its next epoch change is expected. */
  expectRestart(name: string): void {
    const p = this.get(name);
    p.expectedRestarts++;
    p.overdue.clear();
  }

  /** Watch for the first successful room on `f.worker` after `f.at`. */
  watchFault(f: WatchedFault): void {
    this.faults.push(f);
  }

  /** Live rooms by state, summed over the workers' last successful polls. */
  liveByState(): StateCounts {
    const out: StateCounts = {};
    for (const p of this.ws) for (const [k, v] of Object.entries(p.live)) out[k] = (out[k] ?? 0) + v;
    return out;
  }

  /** Per worker: polls answered, polls failed, epoch changes nobody announced. */
  health(): { name: string; okPolls: number; failedPolls: number; lastError?: string; unexpectedEpochChanges: { from: string; to: string; at: number }[] }[] {
    return this.ws.map((p) => ({ name: p.w.name, okPolls: p.okPolls, failedPolls: p.failedPolls, lastError: p.lastError, unexpectedEpochChanges: p.unexpectedEpochChanges }));
  }

  /** Poll every (unpaused) worker once; resolves when all polls settled. */
  async pollAll(): Promise<void> {
    await Promise.all(this.ws.map((p) => this.poll(p)));
  }

  private async poll(p: PerWorker): Promise<void> {
    if (p.inflight || p.paused) return;
    p.inflight = true;
    const sentAt = Date.now();
    try {
      const d = await getJson<DebugRooms>(`${p.w.url}/debug/rooms`, this.o.timeoutMs ?? 2000);
      if (p.paused || sentAt < p.ignoreBefore) return;
      p.okPolls++;
      this.observe(p, d);
    } catch (err) {
      p.failedPolls++;
      p.lastError = (err as Error).message;
    } finally {
      p.inflight = false;
    }
  }

  private observe(p: PerWorker, d: DebugRooms): void {
    if (d.epoch !== undefined) {
      if (p.epoch !== undefined && d.epoch !== p.epoch) {
        if (p.expectedRestarts > 0) p.expectedRestarts--;
        else p.unexpectedEpochChanges.push({ from: p.epoch, to: d.epoch, at: Date.now() });
        p.overdue.clear();
      }
      p.epoch = d.epoch;
    }
    const live: StateCounts = {};
    const overdue = new Map<string, number>();
    for (const r of d.live ?? []) {
      live[r.state] = (live[r.state] ?? 0) + 1;
      if (r.deadline_ms !== null && r.deadline_ms < -this.o.graceMs) {
        overdue.set(r.room, -r.deadline_ms);
        if (p.overdue.has(r.room)) {
          const key = `${p.w.name}/${r.room}`;
          const prev = this.wedges.get(key);
          this.wedges.set(key, { worker: p.w.name, room: r, overdueMs: -r.deadline_ms, firstSeen: prev?.firstSeen ?? Date.now(), sightings: (prev?.sightings ?? 1) + 1 });
        }
      }
    }
    p.overdue = overdue;
    p.live = live;
    for (const f of this.faults) {
      if (f.worker !== p.w.name || f.workerOkAt !== undefined) continue;
      let first = Infinity;
      for (const r of d.recent ?? []) {
        if (r.state !== 'Success') continue;
        const t = r.timeline.find((e) => e.state === 'Success')?.at;
        if (t !== undefined && t >= f.at && t < first) first = t;
      }
      if (first !== Infinity) f.workerOkAt = first;
    }
  }
}

/** One gauge (or other resource) not back to zero on an idle cluster. */
export interface LeakItem {
  where: string;
  what: string;
  value: number;
}

/** Everything `collectLeaks` found: non-zero gauges and the live rooms on each worker. */
export interface LeakReport {
  items: LeakItem[];
  rooms: { worker: string; room: RoomView }[];
  /** Workers that did not answer (a leak cannot be ruled out). */
  unreachable: { where: string; error: string }[];
  /**
   * Non-zero `pdserve_illegal_transitions_total` series (since each worker's last start): real
   * protocol violations. Benign races are counted apart (`pdserve_room_late_events_total`).
   */
  illegal: LeakItem[];
  /** `pdserve_kv_handoffs_total` by worker and path (since each worker's last start). */
  handoffs: Record<string, Record<string, number>>;
}

/** Parse Prometheus text: `name{labels} value` → [{name, labels, value}]. */
export function parseProm(text: string): { name: string; labels: string; value: number }[] {
  const out: { name: string; labels: string; value: number }[] = [];
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m) out.push({ name: m[1]!, labels: m[2] ?? '', value: Number(m[3]) });
  }
  return out;
}

/**
 * Read every gauge that must be zero when no request is in flight. Workers: `pdserve_*_reqs`
 * queue gauges, `pdserve_rooms{…}`, slots in use (`slots - slots_free` from /health), live
 * rooms and pending registrations (/debug/rooms). Router (when given): in-flight requests,
 * per-worker load, acquired − released leases.
 */
export async function collectLeaks(workers: WatchedWorker[], routerUrl?: string, timeoutMs = 3000): Promise<LeakReport> {
  const rep: LeakReport = { items: [], rooms: [], unreachable: [], illegal: [], handoffs: {} };
  await Promise.all(
    workers.map(async (w) => {
      try {
        const [metrics, health, rooms] = await Promise.all([
          getText(`${w.url}/metrics`, timeoutMs),
          getJson<Record<string, unknown>>(`${w.url}/health`, timeoutMs),
          getJson<DebugRooms>(`${w.url}/debug/rooms`, timeoutMs),
        ]);
        for (const s of parseProm(metrics)) {
          if ((/^pdserve_.*_reqs$/.test(s.name) || s.name === 'pdserve_rooms') && s.value !== 0) rep.items.push({ where: w.name, what: `${s.name}${s.labels}`, value: s.value });
          if (s.name === 'pdserve_illegal_transitions_total' && s.value !== 0) rep.illegal.push({ where: w.name, what: `${s.name}${s.labels}`, value: s.value });
          const path = s.name === 'pdserve_kv_handoffs_total' ? /path="([a-z_]+)"/.exec(s.labels)?.[1] : undefined;
          if (path) (rep.handoffs[w.name] ??= {})[path] = s.value;
        }
        const slots = Number(health.slots);
        const free = Number(health.slots_free);
        if (Number.isFinite(slots) && Number.isFinite(free) && free !== slots) rep.items.push({ where: w.name, what: `sequence slots held (slots ${slots}, free ${free})`, value: slots - free });
        if ((rooms.pending_registrations ?? 0) !== 0) rep.items.push({ where: w.name, what: 'pending_registrations', value: rooms.pending_registrations! });
        for (const r of rooms.live ?? []) rep.rooms.push({ worker: w.name, room: r });
        if ((rooms.live ?? []).length > 0 && !rep.items.some((i) => i.where === w.name && i.what.startsWith('pdserve_rooms'))) {
          rep.items.push({ where: w.name, what: 'live rooms in /debug/rooms', value: rooms.live!.length });
        }
      } catch (err) {
        rep.unreachable.push({ where: w.name, error: (err as Error).message });
      }
    }),
  );
  if (routerUrl) {
    try {
      const [metrics, ws] = await Promise.all([
        getText(`${routerUrl}/metrics`, timeoutMs),
        getJson<{ workers?: { url: string; role: string; load: number }[]; acquired_total?: number; released_total?: number }>(`${routerUrl}/workers`, timeoutMs),
      ]);
      for (const s of parseProm(metrics)) if (s.name === 'pdserve_router_inflight_requests' && s.value !== 0) rep.items.push({ where: 'router', what: s.name, value: s.value });
      for (const w of ws.workers ?? []) if (w.load !== 0) rep.items.push({ where: 'router', what: `load of ${w.role} ${w.url}`, value: w.load });
      if (ws.acquired_total !== undefined && ws.released_total !== undefined && ws.acquired_total !== ws.released_total) {
        rep.items.push({ where: 'router', what: `leases acquired ${ws.acquired_total} - released ${ws.released_total}`, value: ws.acquired_total - ws.released_total });
      }
    } catch (err) {
      rep.unreachable.push({ where: 'router', error: (err as Error).message });
    }
  }
  return rep;
}

/** A room's timeline, one line per transition, times relative to its creation. */
export function formatTimeline(r: RoomView, indent = '      '): string {
  const t0 = r.timeline[0]?.at ?? 0;
  return r.timeline.map((e) => `${indent}+${String(e.at - t0).padStart(6)} ms  ${e.state}/${e.phase}  (${e.why})`).join('\n');
}

/** One-line description of a room. */
export function describeRoom(worker: string, r: RoomView): string {
  const dl = r.deadline_ms === null ? 'no deadline' : r.deadline_ms < 0 ? `${-r.deadline_ms} ms past its deadline` : `deadline in ${r.deadline_ms} ms`;
  return `${worker} room ${r.room} (rid ${r.rid}) ${r.state}/${r.phase}${r.step ? ` step ${r.step}` : ''}, age ${r.age_ms} ms, ${dl}, peer ${r.peer ?? '-'}`;
}

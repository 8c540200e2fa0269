/**
 * One simulated world (TigerBeetle VOPR style): a router, one prefill node (P) and one or two
 * decode nodes (D, D2) on one host, over a network that drops, duplicates, reorders and delays —
 * all on virtual time from a seeded PRNG, so a seed replays exactly.
 *
 * Every node runs the SHIPPED room handling — P the prefill effect executor
 * (`src/prefill/effects.ts`) around the prefill driver, each decode the decode executor
 * (`src/decode/effects.ts`) around the decode driver: the objects the workers run, as
 * TigerBeetle runs its real replica under its simulator. This file plays the router and the
 * network; ./ports.ts the executors' ports (engines whose calls take a random time and cannot be
 * cancelled, sequence slots, the state directory, the state sender and receiver, the same-host
 * handoff, the clock); ./checks.ts judges what happens.
 *
 *  - router: dispatches each request to both nodes in random order with random gaps (sometimes
 *    large, so an abort can beat the request: tombstones), aborts at random points to P, D or
 *    both, and (per seed) aborts the other side when one side fails. Some requests are choice
 *    groups (one prefill request for 2–3 rooms), some decode-local (decode alone). A decode that
 *    dies while it streams a request's tokens makes the router ask the shipped attempt plan
 *    (../router/plan.ts: the router's migration limit, the request's deadline) and, on
 *    `migrate`, move the request: a new room,
 *    the prompt plus the tokens the client has, dispatched to the other decode (a world of two)
 *    or again once decode is back. A worker that dies before the client has a token makes the
 *    router ask the same plan, and on `retry` run the request again from the start. With two decodes, each request is paired with either, so P
 *    holds rooms bound to both connections.
 *  - prefill: compute → state file saved → kv_begin, the chunks, kv_end — or, when the seed puts
 *    both on one host and decode's probe went through, one kv_file naming a link decode takes
 *    over (`take_file`).
 *  - channel (./net.ts): every connection is a pair of the SHIPPED connection cores
 *    (../kv/conn-core.ts: frames, handshake, heartbeat) over fake sockets, and every state goes
 *    out through the shipped send rotation; decode dials prefill as the pool does, a crashed node
 *    goes silent and its peer's heartbeat finds it, a restarted one is reached over a new
 *    handshake that binds its new epoch.
 *  - striped channel (`--kv-streams 2`, in some worlds): two sockets per connection, the second
 *    joined by the shipped stripe handshake; chunk frames go round robin over both, so stripes
 *    overtake each other and kv_begin / kv_end; decode reassembles through the shipped
 *    ../kv/stripes.ts; one stripe socket dies once per world, which ends the whole striped
 *    connection on both sides (its frames in flight are gone).
 *  - crashes: a node dies (memory gone; in-flight timers dead; state files stay on disk) and
 *    restarts with a new epoch, sweeping the state files it left.
 */
import { newRoomId } from '../base/room-id.js';
import { silentLogger } from '../base/log.js';
import { stateName, type RoomTable } from '../kv/lifecycle.js';
import type { Effect, Role, RoomId, RoomTimeouts } from '../kv/types.js';
import type { ControlMsg, PeerMsg } from '../kv/messages.js';
import type { Clock, Timers } from '../base/clock.js';
import { TraceTags } from '../protocol/trace-tags.js';
import type { SamplingParams } from '../engine/types.js';
import { DecodeDriver } from '../decode/driver.js';
import { DecodeEffects, type DecodeJob } from '../decode/effects.js';
import { PrefillDriver } from '../prefill/driver.js';
import { PrefillEffects } from '../prefill/effects.js';
import { AttemptPlan, type PlanState } from '../router/plan.js';
import { DEFAULT_MIGRATION_LIMIT } from '../router/config.js';
import { EventHeap } from './heap.js';
import { Prng } from '../base/prng.js';
import { Checks, type NodeName } from './checks.js';
import { drainedForSwitch } from '../switch/drain.js';
import { watchDriver, type WatchHost } from './watch.js';
import { SIM_MAX_STATE_BYTES, SIM_STATE_DIR, SimDisk, SimEngine, simReceive, simSameHostOffer, simSameHostTake, simSender, simMetrics, type NodeCtx, type SimLease } from './ports.js';
import { SIM_HEARTBEAT_MS, SimNet, type NetNode, type SimConn } from './net.js';
import { FAULT_PROFILES, SIM_TIMEOUTS, type FaultProfile, type SimOptions, type SimResult, type SimStats, type TraceEntry } from './model.js';
import { noTestHooks } from '../runtime/testhooks.js';


// ---- internal model ---------------------------------------------------------------------------

interface Node {
  name: NodeName;
  role: Role;
  /** The peers: P → every decode, a decode → P. */
  peers: NodeName[];
  inc: number;
  epoch: string;
  up: boolean;
  table: RoomTable;
  /** prefill: the shipped executor (and its driver). */
  pe?: PrefillEffects<SimConn>;
  /** decode: the shipped executor (and its driver). */
  de?: DecodeEffects<SimConn>;
  /** terminal actions seen per room in this incarnation. */
  terminals: Map<RoomId, number>;
  /** Rooms whose wedge was traced already. */
  wedged: Set<string>;
  /** Rooms a router abort was delivered for (this incarnation): they must never be live again. */
  aborted: Set<RoomId>;
  ctx: NodeCtx;
  /** This incarnation as the network sees it. */
  net: NetNode;
  /** A role switch asked of this node: the router sends it nothing new until it is rebuilt (or the drain gives up). */
  switching?: boolean;
}

interface Req {
  n: number;
  id: RoomId;
  rid: string;
  label: string;
  arrival: number;
  /** The prompt, and the tokens a migrated request's client already has: decode's state must hold both. */
  prompt: number[];
  resumed: number[];
  /** Dispatched to (and accepted by) the node incarnation. */
  on: Partial<Record<Leg, number>>;
  outcome: Partial<Record<Leg, 'Success' | 'Failed'>>;
  /** The decode node the router paired this request with (a choice group's rooms share one). */
  dec: NodeName;
  /** Decode-local continuation: sent to decode alone (`local: true`); prefill never sees it. */
  local: boolean;
  /**
   * n > 1: the requests (rooms) of one prefill computation, lead first — the router sends P ONE
   * request naming every room (sent by the lead), and D one request per room, as choices.ts.
   */
  group?: Req[];
  /** Decode streams this request's tokens (since this virtual time). */
  streaming?: number;
  /** The router's attempt plan for the request (../router/plan.ts), shared by its attempts: budget left and deadline. */
  plan: PlanState;
  /** The attempt this one replaces (`via`: how the plan re-dispatched it), and the attempt that replaced this one. */
  parent?: Req;
  via?: 'retry' | 'migrate';
  next?: Req;
  /** The client aborted the request (the router never runs it again). */
  clientAborted?: boolean;
}

/** A request's two legs: its prefill request (to P) and its decode request (to its decode node). */
type Leg = 'P' | 'D';

const TICK_MS = 10;
/** A request's deadline after its arrival (the router's requestTimeoutMs, scaled down): long, or in some worlds short enough that decodes die after it. */
const REQUEST_TIMEOUT_MS = { long: 10_000, short: 200 } as const;
/** The simulated decode's sampler: greedy, a few tokens. */
const samplingOf = (r: Req): SamplingParams => ({ temperature: 0, topP: 1, topK: 0, maxTokens: 8, stop: [], ignoreEos: false, ...(r.resumed.length ? { resumed: r.resumed } : {}) });
/** Re-dispatches before `req` (its chain of earlier attempts), plus the one being decided: the n-th re-dispatch of the request. */
const attemptsBefore = (req: Req): number => {
  let n = 1;
  for (let r = req.parent; r; r = r.parent) n++;
  return n;
};
const sameTokens = (a: readonly number[] | undefined, b: readonly number[]): boolean => !!a && a.length === b.length && a.every((x, i) => x === b[i]);

/** Settles once every microtask queued so far, and every one those queue, has run (Node runs ticks only when the microtask queue is empty). */
const drain = (): Promise<void> => new Promise((resolve) => process.nextTick(resolve));

export class World {
  readonly seed: number;
  readonly legacy: boolean;
  readonly tracing: boolean;
  readonly profile: FaultProfile;
  readonly timeouts: RoomTimeouts;
  private readonly rng: Prng;
  private readonly q = new EventHeap();
  now = 0;
  private readonly nodes: Partial<Record<NodeName, Node>> & Record<'P' | 'D', Node>;
  private readonly reqs: Req[] = [];
  private readonly byId = new Map<RoomId, Req>();
  readonly checks: Checks;
  readonly trace: TraceEntry[] = [];
  readonly stats: SimStats = { requests: 0, success: 0, failed: 0, aborts: 0, crashes: 0, frames: 0, dropped: 0, duplicated: 0, refusedStale: 0, illegal: 0, late: 0, expired: 0, events: 0, endAt: 0, local: 0, localSuccess: 0, grouped: 0, groupedSuccess: 0, sameHost: 0, fileRefused: 0, filesHeldToFirstStep: 0, migrated: 0, migratedSuccess: 0, migratedAcross: 0, retried: 0, retriedSuccess: 0, twoDecodes: 0, striped: 0, stripeChunks: 0, stripeHeld: 0, stripeLost: 0, freezes: 0, ownStalls: 0, switches: 0, switchWaitedRooms: 0, switchDuringLocal: 0, switchFailed: 0, switchTimeouts: 0 };
  private readonly crossAbort: boolean;
  /** The router's attempt plan (its default --migration-limit unless the options say otherwise). */
  private readonly plan: AttemptPlan;
  /** The requests' deadline after arrival in this world (REQUEST_TIMEOUT_MS). */
  private readonly requestTimeoutMs: number;
  private readonly topo: Prng;
  private readonly sameHost: boolean;
  private endAt = 0;
  private readonly nSlots: number;
  private readonly maxNetDelay: number;
  /** The KV network: the shipped connection cores over fake sockets. */
  private readonly net: SimNet;
  /** Node freezes: until when, how long the frames sent to it meanwhile take after (TCP retransmission). */
  private readonly frozen = new Map<NodeName, { until: number; retransMs: number }>();
  /** The decode nodes (one, or two: requests are paired with either, a migration goes to the other). */
  private readonly decodes: NodeName[];
  /** Sockets per KV connection (`--kv-streams`): 2 stripes chunk frames over two sockets. */
  readonly kvStreams: number;
  /** Prefill's `--first-token-after-save` in this world (0 or 100). */
  readonly firstAfterSave: number;
  private readonly disk: SimDisk;
  /** Something may be waiting in the microtask queue (an executor ran, a fake settled a promise). */
  private dirty = false;
  private readonly clock: Clock = { nowMs: () => this.now, wallMs: () => 1_700_000_000_000 + this.now };
  /** What the drivers' watch (./watch.ts) reports to. */
  private readonly watch: WatchHost;

  constructor(private readonly opts: SimOptions) {
    this.seed = opts.seed;
    this.rng = new Prng(opts.seed);
    this.legacy = opts.legacy ?? false;
    this.tracing = opts.trace ?? false;
    const r = this.rng.float();
    this.profile = FAULT_PROFILES[opts.faults ?? (r < 0.3 ? 'calm' : r < 0.8 ? 'mild' : 'harsh')];
    this.timeouts = { ...SIM_TIMEOUTS, ...opts.timeouts };
    this.nSlots = opts.slots ?? this.rng.int(2, 4);
    this.crossAbort = this.rng.chance(0.5);
    this.sameHost = opts.sameHost ?? new Prng((this.seed * 40503 + 0x51) >>> 0).chance(0.5);
    // Half the worlds hold token 1 until the save whenever the last save predicts it (a stream of its own: the other draws stay as they were).
    this.firstAfterSave = new Prng((this.seed * 69069 + 0x1f7) >>> 0).chance(0.5) ? 100 : 0;
    this.maxNetDelay = 1 + this.profile.jitterMs;
    // The topology, from its own stream (legacy worlds keep the incident's: one decode, one socket).
    const topo = new Prng((this.seed * 2246822519 + 0x3c6e) >>> 0);
    const two = opts.decodes ?? (this.legacy ? 1 : topo.chance(0.25) ? 2 : 1);
    this.decodes = two === 2 ? ['D', 'D2'] : ['D'];
    this.kvStreams = opts.kvStreams ?? (this.legacy ? 1 : topo.chance(0.2) ? 2 : 1);
    this.topo = topo;
    this.plan = new AttemptPlan({ migrationLimit: opts.migrationLimit ?? DEFAULT_MIGRATION_LIMIT });
    // Its own stream, so the other draws stay as they were.
    this.requestTimeoutMs = opts.requestTimeoutMs ?? (new Prng((this.seed * 16807 + 0x2a5) >>> 0).chance(0.3) ? REQUEST_TIMEOUT_MS.short : REQUEST_TIMEOUT_MS.long);
    const now = (): number => this.now;
    this.checks = new Checks({
      get now() {
        return now();
      },
      label: (id) => this.label(id),
      note: (who, room, text) => this.tr(who, room, text),
    });
    this.disk = new SimDisk(this.checks);
    this.watch = {
      tracing: this.tracing,
      legacy: this.legacy,
      checks: this.checks,
      groupOf: (id) => (this.byId.get(id)?.group ?? []).map((m) => m.id),
      label: (id) => this.label(id),
      tr: (who, room, text) => this.tr(who, room, text),
      touched: () => {
        this.dirty = true;
      },
      diag: (node, e) => this.diag(node, e),
    };
    const world = this;
    this.net = new SimNet({
      rng: this.rng,
      profile: this.profile,
      stats: this.stats,
      checks: this.checks,
      clock: this.clock,
      tracing: this.tracing,
      streams: this.kvStreams,
      get endAt() {
        return world.endAt;
      },
      now: () => this.now,
      at: (t, fn) =>
        this.q.push(t, () => {
          this.dirty = true;
          fn();
        }),
      atNode: (name, t, fn, wire) => this.onNode(name, t, fn, wire),
      thawedAt: (name) => this.frozen.get(name)?.until,
      node: (name) => this.node(name).net,
      tr: (who, room, text) => this.tr(who, room, text),
    });
    this.nodes = { P: this.newNode('P', 'prefill'), D: this.newNode('D', 'decode') };
    if (this.decodes.length === 2) this.nodes.D2 = this.newNode('D2', 'decode');
    if (this.decodes.length === 2) this.stats.twoDecodes = 1;
    if (this.kvStreams > 1) this.stats.striped = 1;
    this.setup(opts.rooms ?? 12);
  }

  // ---- scaffolding ------------------------------------------------------------------------------

  private newNode(name: NodeName, role: Role): Node {
    // `table` and `ctx` are set by `start`, the first event of each node.
    const peers = role === 'prefill' ? [...this.decodes] : (['P'] as NodeName[]);
    const n = { name, role, peers, inc: 0, epoch: '', up: false, terminals: new Map(), wedged: new Set(), aborted: new Set() } as Omit<Node, 'table' | 'ctx' | 'net'> as Node;
    n.net = this.netNodeOf(n);
    return n;
  }

  private all(): Node[] {
    return [this.nodes.P, ...this.decodes.map((d) => this.nodes[d]!)];
  }

  private node(name: NodeName): Node {
    return this.nodes[name]!;
  }

  /** The node serving `req`'s leg. */
  private nodeOf(req: Req, leg: Leg): Node {
    return leg === 'P' ? this.nodes.P : this.node(req.dec);
  }

  private static legOf(n: Node): Leg {
    return n.role === 'prefill' ? 'P' : 'D';
  }

  /** The fakes' view of node `n`'s current incarnation. */
  private ctxOf(n: Node): NodeCtx {
    const inc = n.inc;
    return {
      name: n.name,
      inc,
      rng: this.rng,
      checks: this.checks,
      clock: this.clock,
      later: (d, fn) => this.atNode(n, this.now + d, fn, inc),
      after: <T>(d: number, fn: () => T) =>
        new Promise<T>((resolve, reject) =>
          this.atNode(
            n,
            this.now + d,
            () => {
              this.dirty = true;
              try {
                resolve(fn());
              } catch (err) {
                reject(err);
              }
            },
            inc,
          ),
        ),
      note: (room, text) => this.tr(n.name, room, text),
    };
  }

  /** Virtual timers of node `n`'s current incarnation (dead with it). */
  private timersOf(n: Node): Timers {
    const inc = n.inc;
    return {
      after: (ms, fn) => {
        let live = true;
        this.atNode(n, this.now + ms, () => live && fn(), inc);
        return () => void (live = false);
      },
      every: (ms, fn) => {
        let live = true;
        const loop = (t: number): void => {
          if (t <= this.endAt) this.atNode(n, t, () => (live ? (fn(), loop(t + ms)) : undefined), inc);
        };
        loop(this.now + ms);
        return () => void (live = false);
      },
      turn: () => new Promise<void>((resolve) => this.atNode(n, this.now, resolve, inc)),
    };
  }

  /** Node `n`'s current incarnation as the network sees it: its executor's entry points. */
  private netNodeOf(n: Node): NetNode {
    const inc = n.inc;
    return {
      name: n.name,
      role: n.role,
      epoch: n.epoch,
      inc,
      get up() {
        return n.up && n.inc === inc;
      },
      timers: this.timersOf(n),
      message: (conn, msg) => this.control(n, conn, msg),
      chunk: (conn, room, offset, data) => n.de?.onChunk(conn, room, offset, data),
      peerLost: (conn, reason) => {
        this.dirty = true;
        this.tr('sim', undefined, `${n.name}: connection ${conn.id} lost (${reason}): failing its rooms`);
        n.pe?.peerLost(conn, reason);
        n.de?.peerLost(conn, reason);
      },
      connected: (conn) => {
        if (n.de && this.sameHost) conn.sendControl({ type: 'same_host_probe', boot: 'sim', pidns: 'sim', file: 'sim-probe' });
      },
    };
  }

  private at(t: number, fn: () => void): void {
    this.q.push(t, fn);
  }

  /** Schedule on a node incarnation: dropped if the node crashed (or restarted) meanwhile, held while it is frozen. */
  private atNode(n: Node, t: number, fn: () => void, inc = n.inc): void {
    this.onNode(
      n.name,
      t,
      () => {
        if (n.up && n.inc === inc) fn();
      },
      false,
    );
  }

  /**
   * Run `fn` on node `name` at `t`, or when its freeze ends if it is frozen then — a frame on the
   * wire (`wire`) that long plus the freeze's retransmission delay (the host did not take it).
   */
  private onNode(name: NodeName, t: number, fn: () => void, wire: boolean): void {
    const run = (): void => {
      const fz = this.frozen.get(name);
      if (fz && this.now < fz.until) {
        this.q.push(fz.until + (wire ? fz.retransMs : 0), run);
        return;
      }
      this.dirty = true;
      fn();
    };
    this.q.push(t, run);
  }

  /** The whole host of `n` pauses for `ms` (a VM paused): its loop runs nothing, frames sent to it are retransmitted after. */
  private freeze(n: Node, ms: number, retransMs: number): void {
    if (!n.up) return;
    this.stats.freezes++;
    this.frozen.set(n.name, { until: this.now + ms, retransMs });
    this.tr('sim', undefined, `${n.name} FROZEN for ${ms} ms (frames to it arrive ${retransMs} ms after)`);
  }

  private tr(who: TraceEntry['who'], room: RoomId | undefined, text: string): void {
    if (this.tracing) this.trace.push({ at: this.now, who, room, text });
  }

  private label(id: RoomId): string {
    return this.byId.get(id)?.label ?? `room ${id}`;
  }

  // ---- setup ------------------------------------------------------------------------------------

  private setup(nReq: number): void {
    const rng = this.rng;
    // Which requests take the decode-local path: its own stream (real rule only: the legacy
    // rule's proof is about the PD handoff).
    const localRng = new Prng((this.seed * 2654435761 + 0x9e37) >>> 0);
    let t = 5;
    const ids = new Set<RoomId>();
    for (let i = 0; i < nReq; i++) {
      t += rng.int(0, 100);
      let id = newRoomId(() => rng.u64());
      while (ids.has(id)) id = newRoomId(() => rng.u64());
      ids.add(id);
      const prompt = Array.from({ length: rng.int(1, 6) }, (_, k) => 100 * (i + 1) + k);
      const dec = this.decodes[this.topo.int(0, this.decodes.length - 1)]!;
      const req: Req = { n: i + 1, id, rid: `req-${i + 1}`, label: `#${i + 1}`, arrival: t, prompt, resumed: [], on: {}, outcome: {}, dec, local: !this.legacy && localRng.chance(0.2), plan: this.plan.start(t + this.requestTimeoutMs) };
      if (req.local) this.stats.local++;
      this.reqs.push(req);
      this.byId.set(id, req);
    }
    // Some requests are n > 1 choice groups: 2–3 rooms fed by one prefill computation.
    for (let i = 0; i < this.reqs.length - 1; ) {
      let k = rng.chance(0.25) ? Math.min(rng.int(2, 3), this.reqs.length - i) : 1;
      if (this.reqs.slice(i, i + k).some((m) => m.local)) k = 1; // decode-local requests have no prefill leg
      if (k > 1) {
        const group = this.reqs.slice(i, i + k);
        this.stats.grouped += k;
        for (const m of group) {
          m.group = group;
          m.arrival = group[0]!.arrival;
          m.plan = group[0]!.plan;
          m.prompt = group[0]!.prompt; // one request, n choices: one prompt
          m.dec = group[0]!.dec; // the choices decode on one worker
        }
      }
      i += k;
    }
    this.stats.requests = nReq;
    const window = t;
    this.endAt = window + 3000;
    this.stats.endAt = this.endAt;

    for (const req of this.reqs) {
      const first: Leg = rng.chance(0.5) ? 'P' : 'D';
      const gap = rng.chance(0.15) ? rng.int(20, 250) : rng.int(0, 5);
      if (req.local) {
        // The router sends a decode-local round to decode alone.
        this.at(req.arrival, () => this.dispatch(req, 'D'));
        continue;
      }
      this.at(req.arrival, () => this.dispatch(req, first));
      this.at(req.arrival + gap, () => this.dispatch(req, first === 'P' ? 'D' : 'P'));
      if (rng.chance(0.3)) {
        const when = req.arrival + rng.int(0, 900);
        const k = rng.int(0, 2);
        const targets: Leg[] = k === 0 ? ['P'] : k === 1 ? ['D'] : ['P', 'D'];
        this.at(when, () => {
          let cur = req;
          while (cur.next) cur = cur.next; // the client aborts its request, whichever attempt runs
          cur.clientAborted = true;
          this.stats.aborts++;
          this.tr('R', cur.id, `client abort → ${targets.join('+')}`);
          for (const s of targets) this.routerAbort(cur, s, 'abort: router');
        });
      }
    }

    const crashes = rng.chance(0.2) ? (this.profile.name === 'harsh' && rng.chance(0.5) ? 2 : 1) : 0;
    for (let c = 0; c < crashes; c++) {
      const who: NodeName = rng.chance(0.5) ? 'P' : this.decodes[this.topo.int(0, this.decodes.length - 1)]!;
      const when = rng.int(20, window + 200);
      const down = rng.int(30, 300);
      this.at(when, () => this.crash(this.node(who), down));
    }
    // A world without crashes may pause one node's host once, long enough for its liveness checks to see their own stall.
    const fr = new Prng((this.seed * 1103515245 + 0x5eed) >>> 0);
    // (not in a world with a role switch: its teardown is a node going away, judged as a crash is)
    if (crashes === 0 && !this.opts.switches && fr.chance(0.1)) {
      const all = ['P', ...this.decodes] as NodeName[];
      const who = all[fr.int(0, all.length - 1)]!;
      const when = fr.int(50, window + 200);
      const ms = fr.int(340, 500);
      const retrans = fr.int(1, 20);
      this.at(when, () => this.freeze(this.node(who), ms, retrans));
    }
    // A striped world loses one stripe socket of one decode's connection (the whole connection ends with it).
    if (this.kvStreams > 1) {
      const d = this.decodes[this.topo.int(0, this.decodes.length - 1)]!;
      this.at(this.topo.int(20, window + 200), () => this.loseStripe(this.node(d)));
    }

    // One role switch per world (its own stream: the other draws stay as they were).
    if (this.opts.switches) {
      const sw = new Prng((this.seed * 2654435761 + 0x5317c4) >>> 0);
      const all = ['P', ...this.decodes] as NodeName[];
      const who = all[sw.int(0, all.length - 1)]!;
      const when = sw.int(20, window + 200);
      const fail = sw.chance(0.3);
      const downMs = fail ? sw.int(100, 300) : sw.int(1, 5);
      this.at(when, () => this.requestSwitch(this.node(who), downMs, fail));
    }
    // Start both nodes, then the periodic watchdog ticks (random phase per node); the connections' heartbeats are their cores'.
    for (const n of this.all()) {
      this.at(0, () => this.start(n));
      this.periodic(rng.int(0, TICK_MS - 1), TICK_MS, () => this.tick(n));
    }
  }

  private periodic(first: number, every: number, fn: () => void): void {
    const loop = (t: number): void => {
      this.at(t, () => {
        fn();
        if (t + every <= this.endAt) loop(t + every);
      });
    };
    loop(first);
  }

  /** Run to the end; resolves with the result. */
  async run(): Promise<SimResult> {
    // Untraced runs make many errors (every failed room's answer, every abort's reason): no stacks.
    const limit = Error.stackTraceLimit;
    if (!this.tracing) Error.stackTraceLimit = 0;
    try {
      await this.loop();
    } finally {
      Error.stackTraceLimit = limit;
    }
    return this.result();
  }

  private async loop(): Promise<void> {
    await drain(); // from here on every step runs inside the microtask queue's processing
    for (;;) {
      const e = this.q.pop();
      if (!e) break;
      this.now = e.at;
      this.stats.events++;
      try {
        e.run();
      } catch (err) {
        this.checks.violate({ kind: 'exception', detail: (err as Error).stack ?? String(err) });
      }
      if (this.dirty) {
        this.dirty = false;
        await drain();
        this.nameLeases();
      }
    }
  }

  private result(): SimResult {
    this.stats.refusedStale = this.net.kvStats.staleEpoch;
    this.stats.ownStalls = this.net.kvStats.ownStalls;
    const up = this.all().filter((n) => n.up);
    this.checks.final(up.map((n) => ({ name: n.name, table: n.table })));
    for (const n of up) {
      const left = n.de ? [...n.de.allJobs()].map((j) => j.room) : this.reqs.filter((r) => n.pe?.job(r.id)).map((r) => r.id);
      for (const room of left) this.checks.violate({ kind: 'leak', node: n.name, room, detail: `the executor still holds the request's record at the end` });
    }
    const labels: Record<RoomId, string> = {};
    for (const r of this.byId.values()) labels[r.id] = r.label;
    const o = this.opts;
    const forced = [...(o.decodes ? [`--decodes ${o.decodes}`] : []), ...(o.kvStreams ? [`--kv-streams ${o.kvStreams}`] : []), ...(o.migrationLimit !== undefined ? [`--migration-limit ${o.migrationLimit}`] : []), ...(o.requestTimeoutMs !== undefined ? [`--request-timeout-ms ${o.requestTimeoutMs}`] : []), ...(o.switches ? ['--switches'] : [])];
    return { seed: this.seed, ok: this.checks.violations.length === 0, legacy: this.legacy, profile: this.profile.name, decodes: this.decodes.length as 1 | 2, kvStreams: this.kvStreams as 1 | 2, forced, violations: this.checks.violations, stats: this.stats, trace: this.tracing ? this.trace : undefined, labels };
  }

  /** Leases the decode executor holds get their room's name (for reports). */
  private nameLeases(): void {
    for (const d of this.decodes) {
      const de = this.node(d).de;
      if (!de) continue;
      for (const j of de.allJobs()) {
        const lease = j.slot as unknown as SimLease | undefined;
        if (lease && lease.h.room !== j.room) lease.room = lease.h.room = j.room;
      }
    }
  }

  // ---- node lifecycle ---------------------------------------------------------------------------

  private start(n: Node): void {
    n.inc++;
    // a session epoch as the workers make them (hex): the node's letter code, then its incarnation
    n.epoch = `${n.name === 'P' ? 'a' : n.name === 'D' ? 'd' : 'e'}${n.inc.toString(16).padStart(15, '0')}`;
    n.up = true;
    n.net = this.netNodeOf(n);
    this.net.nodeUp(n.name);
    const ctx = (n.ctx = this.ctxOf(n));
    const m = simMetrics();
    const timers: Timers = { every: () => () => {}, after: () => () => {}, turn: () => Promise.resolve() };
    const common = { clock: this.clock, files: this.disk.port(ctx), traces: new TraceTags(256), log: silentLogger };
    if (n.role === 'prefill') {
      // The shipped prefill driver and executor, with the worker's default bounds and one compute slot.
      const driver = watchDriver(this.watch, n, new PrefillDriver({ timeouts: this.timeouts, maxRooms: 1024, maxWaiting: 256, slots: 1, legacyMaxRule: this.legacy }, `${n.epoch}`));
      n.pe = new PrefillEffects<SimConn>({
        testHooks: noTestHooks,
        ...common,
        driver,
        config: { stateDir: SIM_STATE_DIR, kvStream: false, firstTokenAfterSave: this.firstAfterSave, chunkBytes: 512, timeouts: this.timeouts },
        engine: new SimEngine(ctx, this.disk, 'prefill', 1),
        sender: simSender(ctx, this.disk),
        sameHost: simSameHostOffer(this.sameHost),
        timers,
        pid: n.inc,
        metrics: m.prefill,
        computeMetrics: m.compute,
        prefixMetrics: m.prefixP,
        kvTracker: null,
      });
      n.table = driver.rooms;
    } else {
      // The shipped decode driver and executor, with the worker's default prealloc bound.
      const driver = watchDriver(this.watch, n, new DecodeDriver({ timeouts: this.timeouts, slots: this.nSlots, maxPrealloc: 256, maxStateBytes: SIM_MAX_STATE_BYTES, legacyMaxRule: this.legacy }, `${n.epoch}`));
      n.de = new DecodeEffects<SimConn>({
        testHooks: noTestHooks,
        ...common,
        driver,
        engine: new SimEngine(ctx, this.disk, 'decode', this.nSlots),
        dial: () => this.net.dial(n.net),
        receive: simReceive(ctx, this.disk),
        sameHost: simSameHostTake(ctx, this.disk),
        metrics: m.decode,
        prefixMetrics: m.prefixD,
      });
      n.table = driver.rooms;
    }
    n.terminals = new Map();
    n.wedged = new Set();
    n.aborted = new Set();
    this.disk.sweep(n.name, n.inc); // start-up sweep: the state files of earlier incarnations
    this.tr('sim', undefined, `${n.name} up, epoch ${n.epoch}`);
  }

  private crash(n: Node, downMs: number, why: 'crash' | 'switch' = 'crash'): void {
    if (!n.up) return;
    if (why === 'crash') this.stats.crashes++;
    n.up = false;
    n.switching = false;
    this.tr('sim', undefined, `${n.name} ${why === 'crash' ? 'CRASH' : 'down for its role switch'} (epoch ${n.epoch}), down ${downMs} ms`);
    // Process memory is gone: slots and buffers die with it; state files stay on disk.
    for (const h of this.checks.held(n.name, (h) => h.kind !== 'statefile')) this.checks.release(h, 'crash');
    // Each peer must fail every room bound to n within two heartbeat intervals of silence (its core's heartbeat).
    for (const peer of n.peers) {
      const s = this.node(peer);
      const conn = this.net.conn(s.name, n.name);
      if (!(s.up && conn)) continue;
      const inc = s.inc;
      const bound = this.maxNetDelay + 3 * SIM_HEARTBEAT_MS + 1;
      const ids = s.de ? s.de.driver.roomsOn(s.de.idOf(conn)) : s.table.rooms().filter((r) => r.peer === conn.id).map((r) => r.id);
      this.at(this.now + bound, () => {
        if (s.up && s.inc === inc) this.checks.peerLossBound(s.name, s.table, ids, n.name, bound);
      });
    }
    // The router sees its HTTP connections to n reset and asks its attempt plan: a request decode
    // was streaming migrates, one whose client has nothing yet runs again from the start.
    const leg = World.legOf(n);
    for (const req of [...this.byId.values()]) {
      if (this.nodeOf(req, leg) !== n || req.on[leg] !== n.inc || req.outcome[leg] !== undefined) continue;
      const streaming = leg === 'D' && req.streaming !== undefined;
      const retry = !streaming && req.outcome.D === undefined && !req.next;
      this.routerSide(req, leg, 'Failed', streaming ? 'connection reset mid-stream' : 'connection reset');
      if (streaming) this.migrate(req, n, downMs);
      else if (retry) this.retry(req, n, leg, downMs);
    }
    this.at(this.now + downMs, () => this.start(n));
  }

  /** Requests whose leg on `n`'s incarnation is open (the router has no answer yet): its HTTP requests in flight. */
  private openLegs(n: Node): number {
    const leg = World.legOf(n);
    let k = 0;
    for (const req of this.byId.values()) if (this.nodeOf(req, leg) === n && req.on[leg] === n.inc && req.outcome[leg] === undefined) k++;
    return k;
  }

  /** Rooms of `n` not terminal, and decode jobs still holding their record. */
  private liveOn(n: Node): number {
    return n.table.rooms().length + (n.de ? [...n.de.allJobs()].length : 0);
  }

  /**
   * A role switch of `n` (../switch/host.ts in the simulator): out of the router's pool at once,
   * drained (../switch/drain.ts: no request in flight, no live room), its role's parts torn down
   * (the executor's shutdown: it must fail nothing) and rebuilt under a new epoch after `downMs`
   * (long when the switch failed midway and the old role is rebuilt). A drain that does not end
   * within the requests' deadline gives up: the node serves on.
   */
  private requestSwitch(n: Node, downMs: number, fail: boolean): void {
    if (!n.up || n.switching) return;
    const inc = n.inc;
    n.switching = true;
    const local = n.de ? [...n.de.allJobs()].some((j) => j.local) : false;
    if (local) this.stats.switchDuringLocal++;
    this.tr('sim', undefined, `${n.name} SWITCH asked (epoch ${n.epoch}): ${this.openLegs(n)} request(s) in flight, ${this.liveOn(n)} live${local ? ', a decode-local request running' : ''}`);
    const giveUpAt = this.now + this.requestTimeoutMs + 1000;
    let waitedRooms = false;
    const poll = (): void => {
      if (!n.up || n.inc !== inc) return; // crashed meanwhile: its restart is a new incarnation, not switching
      const s = { inflight: this.openLegs(n), liveRooms: this.liveOn(n) };
      if (s.inflight === 0 && s.liveRooms > 0) waitedRooms = true;
      const ready = this.opts.plantSwitchBug ? s.inflight === 0 : drainedForSwitch(s);
      if (!ready) {
        if (this.now >= giveUpAt) {
          n.switching = false;
          this.stats.switchTimeouts++;
          this.tr('sim', undefined, `${n.name} switch: drain ran out of time (${s.inflight} in flight, ${s.liveRooms} live): serving its old role`);
          return;
        }
        this.at(this.now + TICK_MS, poll);
        return;
      }
      if (s.inflight > 0 || s.liveRooms > 0) this.checks.violate({ kind: 'half_switched', node: n.name, detail: `torn down for a role switch with ${s.inflight} request(s) in flight and ${s.liveRooms} room(s) live` });
      if (waitedRooms) this.stats.switchWaitedRooms++;
      this.stats.switches++;
      if (fail) this.stats.switchFailed++;
      this.tr('sim', undefined, `${n.name} switch: drained, tearing down${fail ? ': the new role fails to build, the old one is rebuilt' : ''} (back in ${downMs} ms)`);
      n.pe?.shutdown();
      n.de?.shutdown();
      this.crash(n, downMs, 'switch');
    };
    poll();
  }

  // ---- network (./net.ts) -------------------------------------------------------------------------

  /** A room or same-host message node `to` received on `conn`: to its executor. */
  private control(to: Node, conn: SimConn, body: PeerMsg): void {
    if ('room' in body) this.tr(to.name, body.room, `← ${body.type}${body.type === 'fail' ? ` (${body.code}: ${body.detail})` : ''}`);
    if (body.type === 'kv_file') this.stats.sameHost++;
    if (body.type === 'kv_file_refused') this.stats.fileRefused++;
    this.dirty = true;
    if (to.pe) to.pe.onControl(conn, body as ControlMsg);
    else to.de?.onControl(conn, body as ControlMsg);
  }

  /** One stripe socket of decode `d`'s connection dies: as PeerConn.terminate, the whole striped connection ends on both sides. */
  private loseStripe(d: Node): void {
    if (!d.up || !this.nodes.P.up) return;
    if (!this.net.loseStripe(d.name)) return;
    this.stats.stripeLost++;
    this.tr('sim', undefined, `${d.name}: stripe 2 of its connection to P lost: the striped connection ends`);
  }

  /** The watchdog timer of a node, then the deadline checks. */
  private tick(n: Node): void {
    if (!n.up) return;
    const fz = this.frozen.get(n.name);
    if (fz && this.now < fz.until) return; // its loop is paused: the first tick after the freeze catches up
    n.pe?.tick();
    n.de?.tick();
    this.checks.deadlines(n.name, n.table, n.terminals, TICK_MS, n.wedged);
  }

  private diag(n: NodeName, e: Effect): void {
    if (e.t === 'illegal') this.stats.illegal++;
    else if (e.t === 'late') this.stats.late++;
    else if (e.t === 'expired') {
      this.stats.expired++;
      this.tr(n, e.room, `watchdog: ${stateName(e.state)}/${e.phase} expired`);
    }
  }

  // ---- router -------------------------------------------------------------------------------------

  private http(to: Node, fn: (n: Node) => void, onDown?: () => void): void {
    const d = 0.5 + this.rng.float() * 3;
    this.onNode(
      to.name,
      this.now + d,
      () => {
        if (to.up) fn(to);
        else onDown?.();
      },
      false,
    );
  }

  private dispatch(req: Req, side: Leg): void {
    // A choice group's prefill request is one, sent by its lead for every room.
    if (side === 'P' && req.group && req.group[0] !== req) return;
    const members = side === 'P' && req.group ? req.group : [req];
    this.tr('R', req.id, `dispatch → ${this.nodeOf(req, side).name}${members.length > 1 ? ` (rooms ${members.map((m) => m.label).join(' ')})` : ''}`);
    this.http(
      this.nodeOf(req, side),
      (n) => {
        // a node switching role is out of the pool: refused as draining (the router runs it elsewhere)
        if (n.switching) {
          for (const m of members) this.routerSide(m, side, 'Failed', 'refused: draining (switching role)');
          return;
        }
        if (n.role === 'prefill') this.prefillCreate(n, members);
        else this.decodeCreate(n, req);
      },
      () => {
        for (const m of members) this.routerSide(m, side, 'Failed', 'connection refused');
      },
    );
  }

  private routerAbort(req: Req, side: Leg, reason: string): void {
    this.http(this.nodeOf(req, side), (n) => {
      this.tr(n.name, req.id, `← router abort (${reason})`);
      n.aborted.add(req.id);
      n.pe?.abort(undefined, req.id, 'router');
      n.de?.abort(undefined, req.id, 'router');
    });
  }

  /** A leg's answer, if it comes from the incarnation the request went to. */
  private answered(req: Req, side: Leg, inc: number, outcome: 'Success' | 'Failed', why: string): void {
    const n = this.nodeOf(req, side);
    if (!n.up || n.inc !== inc) return;
    this.at(this.now + 1, () => this.routerSide(req, side, outcome, why));
  }

  private routerSide(req: Req, side: Leg, outcome: 'Success' | 'Failed', why: string): void {
    if (req.outcome[side] !== undefined) return;
    req.outcome[side] = outcome;
    if (side === 'D') {
      if (outcome === 'Success') this.stats.success++;
      else this.stats.failed++;
      if (req.local && outcome === 'Success') this.stats.localSuccess++;
      if (req.group && outcome === 'Success') this.stats.groupedSuccess++;
      if (req.via === 'migrate' && outcome === 'Success') this.stats.migratedSuccess++;
      if (req.via === 'retry' && outcome === 'Success') this.stats.retriedSuccess++;
    }
    this.tr('R', req.id, `${side} answered ${outcome} (${why})`);
    if (req.local) return; // no prefill leg to abort
    const other: Leg = side === 'P' ? 'D' : 'P';
    if (outcome === 'Failed' && this.crossAbort && req.outcome[other] === undefined) this.routerAbort(req, other, `abort: router: ${side} failed`);
  }

  /**
   * Decode `dead` died while it streamed `req`: the router asks its attempt plan
   * (../router/plan.ts, the shipped one), and on `migrate` sends the prompt and the tokens the
   * client has as a new attempt (a new room) to prefill and the other decode (or, in a world of
   * one decode, to `dead` once it is back); prefill evaluates them, decode's state must hold them.
   * The plan's answer is judged by the checks: never more migrations than the limit, never one
   * decided at or past the request's deadline.
   */
  private migrate(req: Req, dead: Node, downMs: number): void {
    if (req.local) return; // the model migrates PD requests only
    const d = this.plan.next(req.plan, { code: 'decode_failed', status: 502, output: true, attemptOutput: true, local: false, now: this.now });
    this.tr('R', req.id, `attempt plan: ${d.next} (${d.state.left} of ${this.plan.migrationLimit} migrations left, deadline t=${req.plan.deadlineAt})`);
    if (d.next !== 'migrate') return;
    this.checks.attempt(req.id, 'migrate', attemptsBefore(req), this.plan.migrationLimit, req.plan.deadlineAt);
    const sent = Array.from({ length: this.rng.int(1, 3) }, (_, k) => 9000 + req.resumed.length + k);
    let id = newRoomId(() => this.rng.u64());
    while (this.byId.has(id)) id = newRoomId(() => this.rng.u64());
    const dec = this.decodes.find((d) => d !== dead.name) ?? dead.name;
    const wait = dec === dead.name ? downMs : 0;
    if (dec !== dead.name) this.stats.migratedAcross++;
    const next: Req = { n: req.n, id, rid: req.rid, label: `${req.label}.m`, arrival: this.now + wait + this.rng.int(1, 30), prompt: req.prompt, resumed: [...req.resumed, ...sent], on: {}, outcome: {}, dec, local: false, plan: d.state, parent: req, via: 'migrate' };
    req.next = next;
    this.byId.set(id, next);
    this.stats.migrated++;
    this.tr('R', req.id, `decode ${dead.name} lost mid-stream after ${sent.length} token(s): migrating as ${next.label} (room ${id}) to ${dec}`);
    const first: Leg = this.rng.chance(0.5) ? 'P' : 'D';
    this.at(next.arrival, () => this.dispatch(next, first));
    this.at(next.arrival + this.rng.int(0, 5), () => this.dispatch(next, first === 'P' ? 'D' : 'P'));
  }

  /**
   * `req`'s attempt failed on `dead` (its `leg` reset by a crash) before decode streamed a token:
   * the router asks its attempt plan (../router/plan.ts, the shipped one) with the client having
   * nothing from this attempt, and on `retry` runs the request again from the start as a new
   * attempt (a new room, the same prompt and the tokens earlier attempts gave the client) on the
   * other decode, or once the dead node is back. A request the client aborted, a decode-local
   * one and a choice-group room are not re-run (the model re-runs single PD requests). The
   * plan's answer is judged by the checks: a retry only while the client has nothing, never more
   * re-dispatches than the limit, never one at or past the deadline.
   */
  private retry(req: Req, dead: Node, leg: Leg, downMs: number): void {
    if (req.local || req.group || req.clientAborted) return;
    const output = req.resumed.length > 0;
    const d = this.plan.next(req.plan, { code: leg === 'P' ? 'prefill_failed' : 'decode_failed', status: 502, output, attemptOutput: false, local: false, now: this.now });
    this.tr('R', req.id, `attempt plan after ${dead.name} reset before any token: ${d.next} (${d.state.left} of ${this.plan.migrationLimit} re-dispatches left, deadline t=${req.plan.deadlineAt})`);
    if (d.next !== 'retry' && d.next !== 'migrate') return;
    this.checks.attempt(req.id, d.next, attemptsBefore(req), this.plan.migrationLimit, req.plan.deadlineAt, output);
    let id = newRoomId(() => this.rng.u64());
    while (this.byId.has(id)) id = newRoomId(() => this.rng.u64());
    const dec = leg === 'D' ? (this.decodes.find((x) => x !== dead.name) ?? dead.name) : req.dec;
    const wait = this.nodeOf(req, 'P') === dead || dec === dead.name ? downMs : 0;
    const next: Req = { n: req.n, id, rid: req.rid, label: `${req.label}.r`, arrival: this.now + wait + this.rng.int(1, 30), prompt: req.prompt, resumed: req.resumed, on: {}, outcome: {}, dec, local: false, plan: d.state, parent: req, via: d.next };
    req.next = next;
    this.byId.set(id, next);
    this.stats.retried++;
    this.tr('R', req.id, `${dead.name} lost before any token: running again as ${next.label} (room ${id}) on ${dec}`);
    const first: Leg = this.rng.chance(0.5) ? 'P' : 'D';
    this.at(next.arrival, () => this.dispatch(next, first));
    this.at(next.arrival + this.rng.int(0, 5), () => this.dispatch(next, first === 'P' ? 'D' : 'P'));
  }

  /** The router's request to P for `members` (one room, or every room of a choice group: one computation). */
  private prefillCreate(n: Node, members: Req[]): void {
    const lead = members[0]!;
    const inc = n.inc;
    const r = n.pe!.admit({ rooms: members.map((m) => m.id), rid: lead.rid, tokens: lead.prompt, sampling: samplingOf(lead), first: members.length > 1, trace: lead.label });
    if (r.refused) {
      for (const m of members) this.routerSide(m, 'P', 'Failed', `refused: ${r.refused.code}`);
      return;
    }
    members.forEach((m, i) => {
      m.on.P = inc;
      r.jobs[i]!.done.promise.then(
        () => this.answered(m, 'P', inc, 'Success', 'kv_done'),
        (e: { code?: string }) => this.answered(m, 'P', inc, 'Failed', e.code ?? 'failed'),
      );
    });
  }

  /** The router's request to D for `req` (PD, or decode-local with a plan decode accepted). */
  private decodeCreate(n: Node, req: Req): void {
    const inc = n.inc;
    const sampling = samplingOf(req);
    const r = n.de!.admit({ room: req.id, rid: req.rid, sampling, skipFirst: false, host: 'P', port: 1, trace: req.label, ...(req.local ? { local: { tokens: req.prompt, sampling, reusable: 0 } } : {}) });
    if (r.refused) {
      this.routerSide(req, 'D', 'Failed', `refused: ${r.refused.code}`);
      return;
    }
    req.on.D = inc;
    r.job.ready.promise.then(
      () => this.stream(n, inc, req, r.job),
      (e: { code?: string }) => this.answered(req, 'D', inc, 'Failed', e.code ?? 'failed'),
    );
  }

  /** Decode streams the tokens from the room's slot, which must hold this request's own state; then `generationDone`. */
  private stream(n: Node, inc: number, req: Req, job: DecodeJob<SimConn>): void {
    if (!n.up || n.inc !== inc) return;
    const lease = job.slot as unknown as SimLease | undefined;
    const want = [...req.prompt, ...req.resumed];
    if (!lease || !sameTokens(lease.content(), want)) {
      this.checks.violate({ kind: 'wrong_room', node: n.name, room: req.id, detail: `generation for ${req.label} would run on a slot holding ${lease?.content() ? `tokens [${lease.content()!.join(',')}]` : 'nothing'}, not its own state [${want.join(',')}]` });
    }
    if (lease) lease.generating = true;
    req.streaming = this.now;
    let over = false;
    const end = (why: 'done' | 'aborted'): void => {
      if (over) return;
      over = true;
      if (lease) lease.generating = false;
      req.streaming = undefined;
      n.de!.generationDone(req.id);
      this.answered(req, 'D', inc, why === 'done' ? 'Success' : 'Failed', why === 'done' ? 'stream done' : 'aborted mid-stream');
    };
    // The first decode step (the worker's second token): the state file the load read, held
    // until now, goes here — exactly once, the disk's handles check that.
    this.atNode(
      n,
      this.now + 1,
      () => {
        const files = (): number => this.checks.held(n.name, (h) => h.kind === 'statefile' && h.room === req.id).length;
        const before = files();
        n.de!.stepped(req.id);
        if (job.loadedFileCleanup) this.checks.violate({ kind: 'leak', node: n.name, room: req.id, detail: 'the loaded state file is still held after the first decode step' });
        if (files() < before) this.stats.filesHeldToFirstStep++;
      },
      inc,
    );
    this.atNode(n, this.now + this.rng.int(10, 100), () => end('done'), inc);
    job.ac.signal.addEventListener('abort', () => this.atNode(n, this.now + 0.5, () => end('aborted'), inc), { once: true });
  }
}

/**
 * One simulated world (TigerBeetle VOPR style): a router, one prefill node (P) and one decode node
 * (D) over a network that drops, duplicates, reorders and delays — all on virtual time from a
 * seeded PRNG, so a seed replays exactly.
 *
 * Both nodes run the SHIPPED drivers — P the prefill driver (`src/prefill/driver.ts`), D the
 * decode driver (`src/decode/driver.ts`), the same objects the workers wrap — as TigerBeetle runs
 * its real replica under its simulator: this file only plays the drivers' ports — the network
 * for their sends, dials and transfers, an engine (prefill compute, decode load and generation)
 * that takes a random time and cannot be cancelled, sequence slots, the clock.
 *
 *  - router: dispatches each request to both nodes in random order with random gaps (sometimes
 *    large, so an abort can beat the request: tombstones), aborts at random points to P, D or
 *    both, and (per seed) aborts the other side when one side fails or its connection resets.
 *  - decode (shipped driver): prealloc queue → `assign_slot` (a slot of this node) → `dial` (the
 *    current connection, after a short hop; none → the dial fails) → REGISTER → REGISTERED →
 *    KV_BEGIN → chunks (the shipped reception rule: a duplicated or reordered chunk fails the
 *    room) → KV_END → `load` into the slot (3% fail) → kv_done → KV_ACK → `generate` holds the
 *    slot, then `generationDone`. The driver's `release` gives the slot back; the checks below
 *    catch a slot released while a load still writes into it (the state would land in the next
 *    owner's slot) or a generation on a slot holding another room's state.
 *  - prefill (shipped driver): the engine's state file is saved whatever happened to the room
 *    meanwhile; after a random hop the driver's `computeDone` writes kv_begin — the incident's
 *    ordering — and the table alone decides (under the legacy rule the revived room has no job
 *    left, so nobody sends it: the incident's wedge).
 *  - channel: every frame is stamped with the sender's epoch; frames from another epoch are refused;
 *    `hello` (re)binds the peer epoch and fails all rooms of a previous epoch; pings every
 *    heartbeat; a peer silent for 2 intervals is lost (failPeer).
 *  - crashes: a node dies (memory gone; in-flight timers dead; state files stay on disk) and
 *    restarts with a new epoch, sweeping stale state files.
 *
 * Checks (violations): double release and leaks of slots / queue entries / receive buffers /
 * state files; state loaded into a slot owned by another room; revival (terminal → non-terminal);
 * a room live on a node after a router abort for it reached that node (an abort that beat the
 * request must leave a tombstone that fails the request at once);
 * more than one `terminal` per room; a live room past its deadline by more than one tick (wedge) or
 * without a deadline; rooms of a crashed peer (on decode: the rooms registered on the lost
 * connection) not failed within two heartbeat intervals of silence (+ one check period + max
 * network delay); non-terminal rooms at the end.
 */
import { failure, failureText } from '../base/errors.js';
import { newRoomId } from '../base/room-id.js';
import { RoomTable, stateName } from '../kv/lifecycle.js';
import { KVPoll, isTerminal, type Effect, type Role, type RoomId, type RoomTimeouts } from '../kv/types.js';
import type { ControlMsg } from '../kv/messages.js';
import { DecodeDriver, type DecodeAction } from '../decode/driver.js';
import { PrefillDriver, type PrefillAction } from '../prefill/driver.js';
import { EventHeap } from './heap.js';
import { Prng } from '../base/prng.js';

export type NodeName = 'P' | 'D';

export type ViolationKind =
  | 'double_release'
  | 'leak'
  | 'wrong_room'
  | 'revival'
  | 'double_terminal'
  | 'wedge'
  | 'no_deadline'
  | 'peer_loss_late'
  | 'ran_after_abort'
  | 'stuck'
  | 'exception';

export interface Violation {
  kind: ViolationKind;
  /** Virtual ms. */
  at: number;
  node?: NodeName;
  room?: RoomId;
  /** Request label, '#<n>'. */
  label?: string;
  /** wedge only: the room had already been terminal (the incident's revival). */
  revived?: boolean;
  detail: string;
}

export interface TraceEntry {
  /** Virtual ms. */
  at: number;
  who: 'R' | 'P' | 'D' | 'net' | 'sim';
  room?: RoomId;
  text: string;
}

export type FaultProfileName = 'calm' | 'mild' | 'harsh';

export interface FaultProfile {
  name: FaultProfileName;
  /** Probability a node→node frame is lost (hello excepted: the handshake retries until it works). */
  drop: number;
  /** Probability a frame is delivered twice. */
  dup: number;
  /** Extra random delay, ms (uniform 0..jitter). */
  jitterMs: number;
  /**
   * Probability a frame ignores the link's FIFO order (may overtake earlier frames). The real
   * channel is one TCP connection (FIFO); reordering models a broken/reconnected path and keeps
   * the drivers honest about out-of-order KV_BEGIN / chunks / KV_END.
   */
  reorder: number;
}

export const FAULT_PROFILES: Readonly<Record<FaultProfileName, FaultProfile>> = {
  calm: { name: 'calm', drop: 0, dup: 0, jitterMs: 2, reorder: 0 },
  mild: { name: 'mild', drop: 0.01, dup: 0.01, jitterMs: 10, reorder: 0.02 },
  harsh: { name: 'harsh', drop: 0.05, dup: 0.03, jitterMs: 30, reorder: 0.1 },
};

/** Deadlines used by the simulator (virtual ms), scaled down from the defaults. */
export const SIM_TIMEOUTS: Readonly<RoomTimeouts> = Object.freeze({ preallocMs: 400, bootstrapMs: 150, waitingMs: 600, transferIdleMs: 120 });

export interface SimOptions {
  seed: number;
  /** Requests in this world. Default 12. */
  rooms?: number;
  /** TEST-ONLY: both tables use `legacyMaxRule` (SGLang's max(old, new) status rule). */
  legacy?: boolean;
  /** Record the full event trace (slower; used to replay a failing seed). */
  trace?: boolean;
  /** Fault profile; default: drawn from the seed (30% calm, 50% mild, 20% harsh). */
  faults?: FaultProfileName;
  /** Decode slots; default drawn from the seed (2..4). */
  slots?: number;
  timeouts?: Partial<RoomTimeouts>;
}

export interface SimStats {
  requests: number;
  success: number;
  failed: number;
  aborts: number;
  crashes: number;
  frames: number;
  dropped: number;
  duplicated: number;
  refusedStale: number;
  illegal: number;
  /** Benign races (`late` effects): forward events that reached an already Failed room. */
  late: number;
  expired: number;
  events: number;
  endAt: number;
  /** Requests sent on the decode-local path (decode alone, no prefill leg), and those that succeeded. */
  local: number;
  localSuccess: number;
  /** Rooms of choice groups (n > 1: one prefill computation for 2–3 rooms), and those that succeeded on decode. */
  grouped: number;
  groupedSuccess: number;
}

export interface SimResult {
  seed: number;
  ok: boolean;
  legacy: boolean;
  profile: FaultProfileName;
  violations: Violation[];
  stats: SimStats;
  /** Present when `trace: true`. */
  trace?: TraceEntry[];
  /** room id → '#n' */
  labels: Record<RoomId, string>;
}

// ---- internal model ---------------------------------------------------------------------------

type ResourceKind = 'slot' | 'queue' | 'recvbuf' | 'statefile';

interface Handle {
  id: number;
  kind: ResourceKind;
  node: NodeName;
  inc: number;
  room: RoomId;
  at: number;
  released?: { at: number; why: string };
}

type ChunkBody = { type: 'chunk'; room: RoomId; offset: number; len: number; tag: string };
type HelloBody = { type: 'hello' };
type Body =
  | Extract<ControlMsg, { type: 'register' | 'registered' | 'kv_begin' | 'kv_end' | 'kv_ack' | 'fail' | 'ping' | 'pong' }>
  | ChunkBody
  | HelloBody;

interface Rec {
  id: RoomId;
  rid: string;
  queue?: Handle;
  // decode
  slot?: { h: Handle; idx: number };
  /** decode: the receive buffer (from the driver's recv_begin to finish). */
  recv?: Handle;
  /** decode: slot index an in-flight load writes into (llama.cpp cannot be cancelled). */
  loading?: number;
  // prefill
  file?: Handle;
  /** Chunk lengths of the saved state (drawn when the compute finishes). */
  lens?: number[];
}

interface Slot {
  owner?: RoomId;
  content?: { room: RoomId; rid: string };
}

interface Node {
  name: NodeName;
  role: Role;
  peer: NodeName;
  inc: number;
  epoch: string;
  up: boolean;
  table: RoomTable;
  recs: Map<RoomId, Rec>;
  knownPeerEpoch?: string;
  connected: boolean;
  lastHeard: number;
  /** terminal effects seen per room in this incarnation. */
  terminals: Map<RoomId, number>;
  reported: Set<string>;
  /** Rooms a router abort was delivered for (this incarnation): they must never be live again. */
  aborted: Set<RoomId>;
  // decode
  /** decode: the shipped driver (src/decode/driver.ts); `table` is its room table. */
  dd?: DecodeDriver;
  /** decode: id of the current connection to P (a new id per (re)connection), as the worker's pool gives. */
  conn?: string;
  connSeq: number;
  slots: Slot[];
  // prefill
  /** prefill: the shipped driver (src/prefill/driver.ts); `table` is its room table. */
  driver?: PrefillDriver;
  /** prefill: rooms whose transfer is running (cleared by the driver's `finish`, like the worker's abort signal). */
  sending: Set<RoomId>;
}

interface Req {
  n: number;
  id: RoomId;
  rid: string;
  label: string;
  arrival: number;
  /** Dispatched to (and accepted by) the node incarnation. */
  on: Partial<Record<NodeName, number>>;
  outcome: Partial<Record<NodeName, 'Success' | 'Failed'>>;
  /** Decode-local continuation: sent to decode alone (`local: true`); prefill never sees it. */
  local: boolean;
  /**
   * n > 1: the requests (rooms) of one prefill computation, lead first — the router sends P ONE
   * request naming every room (sent by the lead), and D one request per room, as choices.ts.
   */
  group?: Req[];
}

const TICK_MS = 10;
/** Decode's maxStateBytes in the simulated worlds (states are 64..2048 bytes). */
const SIM_MAX_STATE_BYTES = 1 << 20;
const HB_MS = 40;

export class World {
  readonly seed: number;
  readonly legacy: boolean;
  readonly tracing: boolean;
  readonly profile: FaultProfile;
  readonly timeouts: RoomTimeouts;
  private readonly rng: Prng;
  private readonly q = new EventHeap();
  now = 0;
  private readonly nodes: Record<NodeName, Node>;
  private readonly reqs: Req[] = [];
  private readonly byId = new Map<RoomId, Req>();
  readonly violations: Violation[] = [];
  readonly trace: TraceEntry[] = [];
  readonly stats: SimStats = { requests: 0, success: 0, failed: 0, aborts: 0, crashes: 0, frames: 0, dropped: 0, duplicated: 0, refusedStale: 0, illegal: 0, late: 0, expired: 0, events: 0, endAt: 0, local: 0, localSuccess: 0, grouped: 0, groupedSuccess: 0 };
  private readonly handles = new Set<Handle>();
  private handleSeq = 0;
  private readonly crossAbort: boolean;
  private endAt = 0;
  private readonly nSlots: number;
  private readonly maxNetDelay: number;
  /** Delivery time of the last FIFO frame per sending node (the link's tail). */
  private readonly linkTail: Record<NodeName, number> = { P: 0, D: 0 };

  constructor(opts: SimOptions) {
    this.seed = opts.seed;
    this.rng = new Prng(opts.seed);
    this.legacy = opts.legacy ?? false;
    this.tracing = opts.trace ?? false;
    const r = this.rng.float();
    this.profile = FAULT_PROFILES[opts.faults ?? (r < 0.3 ? 'calm' : r < 0.8 ? 'mild' : 'harsh')];
    this.timeouts = { ...SIM_TIMEOUTS, ...opts.timeouts };
    this.nSlots = opts.slots ?? this.rng.int(2, 4);
    this.crossAbort = this.rng.chance(0.5);
    this.maxNetDelay = 1 + this.profile.jitterMs;
    this.nodes = { P: this.newNode('P', 'prefill'), D: this.newNode('D', 'decode') };
    this.setup(opts.rooms ?? 12);
  }

  // ---- scaffolding ------------------------------------------------------------------------------

  private newNode(name: NodeName, role: Role): Node {
    return {
      name,
      role,
      peer: name === 'P' ? 'D' : 'P',
      inc: 0,
      epoch: '',
      up: false,
      table: new RoomTable(role, this.timeouts, { legacyMaxRule: this.legacy }),
      recs: new Map(),
      connected: false,
      lastHeard: 0,
      terminals: new Map(),
      reported: new Set(),
      aborted: new Set(),
      connSeq: 0,
      slots: [],
      sending: new Set(),
    };
  }

  private at(t: number, fn: () => void): void {
    this.q.push(t, fn);
  }

  /** Schedule on a node incarnation: dropped if the node crashed (or restarted) meanwhile. */
  private atNode(n: Node, t: number, fn: () => void): void {
    const inc = n.inc;
    this.q.push(t, () => {
      if (n.up && n.inc === inc) fn();
    });
  }

  private tr(who: TraceEntry['who'], room: RoomId | undefined, text: string): void {
    this.trace.push({ at: this.now, who, room, text });
  }

  private label(id: RoomId): string {
    return this.byId.get(id)?.label ?? `room ${id}`;
  }

  private violate(v: Omit<Violation, 'at' | 'label'>): void {
    const key = `${v.kind}|${v.node ?? ''}|${v.room ?? ''}`;
    if (this.violations.some((x) => `${x.kind}|${x.node ?? ''}|${x.room ?? ''}` === key)) return;
    const full: Violation = { ...v, at: this.now, label: v.room ? this.label(v.room) : undefined };
    this.violations.push(full);
    if (this.tracing) this.tr('sim', v.room, `!! VIOLATION ${v.kind}${v.node ? ` on ${v.node}` : ''}: ${v.detail}`);
  }

  // ---- resources --------------------------------------------------------------------------------

  private acquire(n: Node, kind: ResourceKind, room: RoomId): Handle {
    const h: Handle = { id: ++this.handleSeq, kind, node: n.name, inc: n.inc, room, at: this.now };
    this.handles.add(h);
    return h;
  }

  private release(h: Handle, why: string): void {
    if (h.released) {
      this.violate({ kind: 'double_release', node: h.node, room: h.room, detail: `${h.kind} #${h.id} released twice: first at t=${ms(h.released.at)} (${h.released.why}), again (${why})` });
      return;
    }
    h.released = { at: this.now, why };
    this.handles.delete(h);
    if (this.tracing && h.kind !== 'queue') this.tr(h.node, h.room, `release ${h.kind} (${why})`);
  }

  // ---- setup ------------------------------------------------------------------------------------

  private setup(nReq: number): void {
    const rng = this.rng;
    // Which requests take the decode-local path: its own stream, so the PD worlds of a seed are
    // drawn as before (real rule only: the legacy rule's proof is about the PD handoff).
    const localRng = new Prng((this.seed * 2654435761 + 0x9e37) >>> 0);
    let t = 5;
    const ids = new Set<RoomId>();
    for (let i = 0; i < nReq; i++) {
      t += rng.int(0, 100);
      let id = newRoomId(() => rng.u64());
      while (ids.has(id)) id = newRoomId(() => rng.u64());
      ids.add(id);
      const req: Req = { n: i + 1, id, rid: `req-${i + 1}`, label: `#${i + 1}`, arrival: t, on: {}, outcome: {}, local: !this.legacy && localRng.chance(0.2) };
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
        }
      }
      i += k;
    }
    this.stats.requests = nReq;
    const window = t;
    this.endAt = window + 3000;
    this.stats.endAt = this.endAt;

    for (const req of this.reqs) {
      const first: NodeName = rng.chance(0.5) ? 'P' : 'D';
      const second: NodeName = first === 'P' ? 'D' : 'P';
      const gap = rng.chance(0.15) ? rng.int(20, 250) : rng.int(0, 5);
      if (req.local) {
        // The router sends a decode-local round to decode alone.
        this.at(req.arrival, () => this.dispatch(req, 'D'));
        continue;
      }
      this.at(req.arrival, () => this.dispatch(req, first));
      this.at(req.arrival + gap, () => this.dispatch(req, second));
      if (rng.chance(0.3)) {
        const when = req.arrival + rng.int(0, 900);
        const k = rng.int(0, 2);
        const targets: NodeName[] = k === 0 ? ['P'] : k === 1 ? ['D'] : ['P', 'D'];
        this.at(when, () => {
          this.stats.aborts++;
          if (this.tracing) this.tr('R', req.id, `client abort → ${targets.join('+')}`);
          for (const s of targets) this.routerAbort(req, s, 'abort: router');
        });
      }
    }

    const crashes = rng.chance(0.2) ? (this.profile.name === 'harsh' && rng.chance(0.5) ? 2 : 1) : 0;
    for (let c = 0; c < crashes; c++) {
      const who: NodeName = rng.chance(0.5) ? 'P' : 'D';
      const when = rng.int(20, window + 200);
      const down = rng.int(30, 300);
      this.at(when, () => this.crash(this.nodes[who], down));
    }

    // Start both nodes, then the periodic watchdog ticks and heartbeats (random phase per node).
    for (const n of [this.nodes.P, this.nodes.D]) {
      this.at(0, () => this.start(n));
      this.periodic(rng.int(0, TICK_MS - 1), TICK_MS, () => this.tick(n));
      this.periodic(rng.int(0, HB_MS - 1), HB_MS, () => this.heartbeat(n));
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

  /** Run to the end; returns the result. */
  run(): SimResult {
    for (;;) {
      const e = this.q.pop();
      if (!e) break;
      this.now = e.at;
      this.stats.events++;
      try {
        e.run();
      } catch (err) {
        this.violate({ kind: 'exception', detail: (err as Error).stack ?? String(err) });
      }
    }
    this.finalChecks();
    const labels: Record<RoomId, string> = {};
    for (const r of this.reqs) labels[r.id] = r.label;
    return {
      seed: this.seed,
      ok: this.violations.length === 0,
      legacy: this.legacy,
      profile: this.profile.name,
      violations: this.violations,
      stats: this.stats,
      trace: this.tracing ? this.trace : undefined,
      labels,
    };
  }

  private finalChecks(): void {
    for (const n of [this.nodes.P, this.nodes.D]) {
      if (!n.up) continue;
      for (const room of n.table.rooms()) {
        this.violate({ kind: 'stuck', node: n.name, room: room.id, detail: `still ${stateName(room.state)}/${room.phase} at the end (t=${ms(this.now)}), deadline was t=${ms(room.deadlineAt)}` });
      }
    }
    for (const h of this.handles) {
      this.violate({ kind: 'leak', node: h.node, room: h.room, detail: `${h.kind} #${h.id} acquired at t=${ms(h.at)} (incarnation ${h.inc}) never released` });
    }
  }

  // ---- node lifecycle ---------------------------------------------------------------------------

  private start(n: Node): void {
    n.inc++;
    n.epoch = `${n.name}${n.inc}`;
    n.up = true;
    if (n.role === 'prefill') {
      // The shipped prefill driver, with the worker's default bounds and one compute slot.
      n.driver = new PrefillDriver({ timeouts: this.timeouts, maxRooms: 1024, maxWaiting: 256, slots: 1, legacyMaxRule: this.legacy }, `${n.name}${n.inc + 1}`);
      n.table = n.driver.rooms;
    } else {
      // The shipped decode driver, with the worker's default prealloc bound.
      n.dd = new DecodeDriver({ timeouts: this.timeouts, slots: this.nSlots, maxPrealloc: 256, maxStateBytes: SIM_MAX_STATE_BYTES, legacyMaxRule: this.legacy }, `${n.name}${n.inc + 1}`);
      n.table = n.dd.rooms;
    }
    n.recs = new Map();
    n.knownPeerEpoch = undefined;
    n.connected = false;
    n.conn = undefined;
    n.lastHeard = this.now;
    n.terminals = new Map();
    n.reported = new Set();
    n.aborted = new Set();
    n.slots = Array.from({ length: n.role === 'decode' ? this.nSlots : 0 }, () => ({}));
    n.sending = new Set();
    // Startup sweep: state files of previous incarnations are deleted.
    for (const h of [...this.handles]) {
      if (h.node === n.name && h.kind === 'statefile' && h.inc < n.inc) this.release(h, 'startup sweep');
    }
    if (this.tracing) this.tr('sim', undefined, `${n.name} up, epoch ${n.epoch}`);
    this.send(n, { type: 'hello' });
  }

  private crash(n: Node, downMs: number): void {
    if (!n.up) return;
    this.stats.crashes++;
    n.up = false;
    if (this.tracing) this.tr('sim', undefined, `${n.name} CRASH (epoch ${n.epoch}), down ${downMs} ms`);
    // Process memory is gone: slots, queue entries and buffers die with it; state files stay on disk.
    for (const h of [...this.handles]) if (h.node === n.name && h.kind !== 'statefile') this.release(h, 'crash');
    // The peer must fail every room bound to n within two heartbeat intervals of silence.
    const s = this.nodes[n.peer];
    if (s.up && s.connected) {
      const inc = s.inc;
      const bound = this.now + this.maxNetDelay + 3 * HB_MS + 1;
      const ids = s.dd ? (s.conn ? s.dd.roomsOn(s.conn) : []) : s.table.rooms().filter((r) => r.peer === n.name).map((r) => r.id);
      this.at(bound, () => {
        if (!s.up || s.inc !== inc) return;
        for (const id of ids) {
          const r = s.table.get(id);
          if (r && !isTerminal(r.state)) {
            this.violate({ kind: 'peer_loss_late', node: s.name, room: id, detail: `${n.name} crashed but ${s.name} still has the room ${stateName(r.state)}/${r.phase} ${3 * HB_MS + this.maxNetDelay} ms later` });
          }
        }
      });
    }
    // The router sees its HTTP connections to n reset.
    for (const req of this.reqs) {
      if (req.on[n.name] !== undefined && req.outcome[n.name] === undefined) this.routerSide(req, n.name, 'Failed', 'connection reset');
    }
    this.at(this.now + downMs, () => this.start(n));
  }

  // ---- network ----------------------------------------------------------------------------------

  /** Send a frame to the peer. false when the sender's connection is down (a failed socket write). */
  private send(from: Node, body: Body): boolean {
    if (!from.up) return false;
    if (body.type !== 'hello' && body.type !== 'ping' && body.type !== 'pong' && !from.connected) return false;
    const to = this.nodes[from.peer];
    const epoch = from.epoch;
    this.stats.frames++;
    const p = this.profile;
    const room = 'room' in body ? body.room : undefined;
    if (body.type !== 'hello' && this.rng.chance(p.drop)) {
      this.stats.dropped++;
      if (this.tracing && room) this.tr('net', room, `${from.name}→${to.name} ${body.type} DROPPED`);
      return true;
    }
    const copies = body.type !== 'hello' && this.rng.chance(p.dup) ? 2 : 1;
    if (copies === 2) this.stats.duplicated++;
    for (let i = 0; i < copies; i++) {
      let t = this.now + 0.5 + this.rng.float() * p.jitterMs;
      if (!this.rng.chance(p.reorder)) {
        t = Math.max(t, this.linkTail[from.name]);
        this.linkTail[from.name] = t;
      } else if (this.tracing && room) this.tr('net', room, `${from.name}→${to.name} ${body.type} may overtake earlier frames`);
      this.at(t, () => this.deliver(to, from.name, epoch, body));
    }
    return true;
  }

  private deliver(to: Node, from: NodeName, epoch: string, body: Body): void {
    if (!to.up) return;
    const room = 'room' in body ? body.room : undefined;
    if (body.type === 'hello') {
      if (to.knownPeerEpoch !== epoch) {
        const old = to.knownPeerEpoch;
        to.knownPeerEpoch = epoch;
        if (this.tracing) this.tr('sim', undefined, `${to.name} binds peer epoch ${epoch}${old ? ` (was ${old}: failing its rooms)` : ''}`);
        if (old) this.lost(to, `${from} restarted (epoch ${old} → ${epoch})`);
        this.send(to, { type: 'hello' });
      }
      this.connect(to);
      to.lastHeard = this.now;
      return;
    }
    if (epoch !== to.knownPeerEpoch) {
      this.stats.refusedStale++;
      if (this.tracing && room) this.tr(to.name, room, `refused ${body.type} from stale epoch ${epoch} (bound: ${to.knownPeerEpoch ?? 'none'})`);
      return;
    }
    if (!to.connected) {
      if (body.type !== 'ping' && body.type !== 'pong') {
        if (this.tracing && room) this.tr(to.name, room, `refused ${body.type}: connection to ${from} closed`);
        return;
      }
      this.connect(to);
      if (this.tracing) this.tr('sim', undefined, `${to.name} reconnected to ${from} (${epoch})`);
    }
    to.lastHeard = this.now;
    if (this.tracing && room && body.type !== 'chunk') this.tr(to.name, room, `← ${body.type}${body.type === 'fail' ? ` (${body.code}: ${body.detail})` : ''}`);
    if (body.type === 'ping') this.send(to, { type: 'pong', seq: body.seq });
    else if (to.role === 'prefill') this.prefillRecv(to, epoch, body);
    else this.decodeRecv(to, epoch, body);
  }

  /** The connection to the peer is up; decode gets a new connection id unless it already has one. */
  private connect(n: Node): void {
    n.connected = true;
    if (n.dd && n.conn === undefined) n.conn = `${n.knownPeerEpoch}#${++n.connSeq}`;
  }

  /** The peer is gone (silent, or restarted): fail every room bound to it (decode: to the connection). */
  private lost(n: Node, detail: string): void {
    if (n.driver) this.performP(n, n.driver.peerLost(n.peer, detail, this.now));
    if (n.dd && n.conn !== undefined) {
      const conn = n.conn;
      n.conn = undefined;
      this.performD(n, n.dd.peerLost(conn, detail, this.now));
    }
  }

  private heartbeat(n: Node): void {
    if (!n.up) return;
    if (n.connected && this.now - n.lastHeard > 2 * HB_MS) {
      n.connected = false;
      if (this.tracing) this.tr('sim', undefined, `${n.name}: ${n.peer} silent for ${this.now - n.lastHeard} ms > 2 heartbeats: peer lost`);
      this.lost(n, `heartbeat: ${n.peer} silent for 2 intervals`);
    }
    if (n.knownPeerEpoch) this.send(n, { type: 'ping', seq: 0 });
  }

  // ---- the core, wrapped with checks ------------------------------------------------------------

  /** After a router abort reached n, the room must never be live on n (tombstones, stickiness). */
  private checkAborted(n: Node, id: RoomId, on: string): void {
    if (n.aborted.has(id) && n.table.has(id)) {
      const r = n.table.get(id)!;
      this.violate({ kind: 'ran_after_abort', node: n.name, room: id, detail: `live (${stateName(r.state)}/${r.phase}) after a router abort reached ${n.name}, on ${on}` });
    }
  }

  /** The watchdog timer of a node. */
  private tick(n: Node): void {
    if (!n.up) return;
    if (n.driver) this.performP(n, n.driver.tick(this.now));
    if (n.dd) this.performD(n, n.dd.tick(this.now));
    for (const room of n.table.rooms()) {
      if (!Number.isFinite(room.deadlineAt)) {
        this.violate({ kind: 'no_deadline', node: n.name, room: room.id, detail: `live room ${stateName(room.state)}/${room.phase} has no deadline` });
      } else if (this.now > room.deadlineAt + TICK_MS) {
        const revived = (n.terminals.get(room.id) ?? 0) > 0;
        const key = `wedge|${room.id}`;
        if (this.tracing && !n.reported.has(key)) {
          n.reported.add(key);
          this.tr(n.name, room.id, `watchdog: Failed write for ${stateName(room.state)}/${room.phase} swallowed (max(${room.state}, ${KVPoll.Failed}) = ${room.state})`);
        }
        this.violate({
          kind: 'wedge',
          node: n.name,
          room: room.id,
          revived,
          detail: `${stateName(room.state)}/${room.phase} is ${ms(this.now - room.deadlineAt)} ms past its deadline (t=${ms(room.deadlineAt)}) and still live${revived ? '; it had already been Failed and was revived' : ''}`,
        });
      }
    }
  }

  // ---- router -------------------------------------------------------------------------------------

  private http(to: Node, fn: (n: Node) => void, onDown?: () => void): void {
    const d = 0.5 + this.rng.float() * 3;
    this.at(this.now + d, () => {
      if (to.up) fn(to);
      else onDown?.();
    });
  }

  private dispatch(req: Req, side: NodeName): void {
    // A choice group's prefill request is one, sent by its lead for every room.
    if (side === 'P' && req.group && req.group[0] !== req) return;
    const members = side === 'P' && req.group ? req.group : [req];
    if (this.tracing) this.tr('R', req.id, `dispatch → ${side}${members.length > 1 ? ` (rooms ${members.map((m) => m.label).join(' ')})` : ''}`);
    this.http(
      this.nodes[side],
      (n) => (n.role === 'prefill' ? this.prefillCreate(n, members) : this.decodeCreate(n, req)),
      () => {
        for (const m of members) this.routerSide(m, side, 'Failed', 'connection refused');
      },
    );
  }

  private routerAbort(req: Req, side: NodeName, reason: string): void {
    this.http(this.nodes[side], (n) => {
      if (this.tracing) this.tr(n.name, req.id, `← router abort`);
      n.aborted.add(req.id);
      if (n.driver) this.viaP(n, req.id, `abort:router (${reason})`, (d) => d.abort(undefined, req.id, 'router', this.now));
      if (n.dd) this.viaD(n, req.id, `abort:router (${reason})`, (d) => d.abort(undefined, req.id, 'router', this.now));
    });
  }

  private routerSide(req: Req, side: NodeName, outcome: 'Success' | 'Failed', why: string): void {
    if (req.outcome[side] !== undefined) return;
    req.outcome[side] = outcome;
    if (side === 'D') {
      if (outcome === 'Success') this.stats.success++;
      else this.stats.failed++;
      if (req.local && outcome === 'Success') this.stats.localSuccess++;
      if (req.group && outcome === 'Success') this.stats.groupedSuccess++;
    }
    if (this.tracing) this.tr('R', req.id, `${side} answered ${outcome} (${why})`);
    if (req.local) return; // no prefill leg to abort
    const other: NodeName = side === 'P' ? 'D' : 'P';
    if (outcome === 'Failed' && this.crossAbort && req.outcome[other] === undefined) this.routerAbort(req, other, `abort: router: ${side} failed`);
  }

  // ---- prefill: the shipped driver over simulated I/O ---------------------------------------

  /**
   * Feed one input for room `id` to a driver and perform its actions; trace the position change
   * (with REVIVED when a terminal room came back), check revival and aborts — for `id` and for
   * the `also` rooms the same input concerns (the other rooms of a prefill computation).
   */
  private viaDriver<A>(n: Node, id: RoomId, label: string, input: () => A[], perform: (actions: A[]) => void, show: (actions: A[]) => string, also: readonly RoomId[] = []): A[] {
    const ids = [id, ...also.filter((x) => x !== id)];
    // Positions as strings now: the table's room objects change in place.
    const before = ids.map((x) => {
      const r = n.table.get(x);
      return r ? `${stateName(r.state)}/${r.phase}` : 'unknown';
    });
    const actions = input();
    const after = ids.map((x) => n.table.get(x));
    if (this.tracing && label !== 'progress') {
      ids.forEach((x, k) => {
        const b = before[k]!;
        const a = after[k] ? `${stateName(after[k].state)}/${after[k].phase}` : 'unknown';
        const revived = (n.terminals.get(x) ?? 0) > 0 && after[k] && !isTerminal(after[k].state) ? '  [REVIVED a terminal room]' : '';
        const swallowed = this.legacy && b !== 'unknown' && a === b && label !== 'registered' && actions.length === 0 ? '  (legacy: write swallowed by max)' : '';
        this.tr(n.name, x, `driver ${label}${k > 0 ? ` (of ${this.label(id)}'s computation)` : ''}: ${b} → ${a}${show(actions)}${revived}${swallowed}`);
      });
    }
    perform(actions);
    ids.forEach((x, k) => {
      this.checkAborted(n, x, label);
      const r = after[k];
      if (r && !isTerminal(r.state) && (n.terminals.get(x) ?? 0) > 0) {
        this.violate({ kind: 'revival', node: n.name, room: x, detail: `terminal room moved back to ${stateName(r.state)}/${r.phase} on ${label}` });
      }
    });
    return actions;
  }

  /** `viaDriver` for the prefill node (a computation's input concerns each of its rooms). */
  private viaP(n: Node, id: RoomId, label: string, input: (d: PrefillDriver) => PrefillAction[]): PrefillAction[] {
    const group = label === 'computeDone' || label === 'request' ? (this.byId.get(id)?.group ?? []).map((m) => m.id) : [];
    return this.viaDriver(n, id, label, () => input(n.driver!), (a) => this.performP(n, a), fxA, group);
  }

  /** `viaDriver` for the decode node. */
  private viaD(n: Node, id: RoomId, label: string, input: (d: DecodeDriver) => DecodeAction[]): DecodeAction[] {
    return this.viaDriver(n, id, label, () => input(n.dd!), (a) => this.performD(n, a), fxD);
  }

  /** The router's request to P for `members` (one room, or every room of a choice group: one computation). */
  private prefillCreate(n: Node, members: Req[]): void {
    const lead = members[0]!;
    let refused: string | undefined;
    this.viaP(n, lead.id, 'request', (d) => {
      const r = d.request(members.map((m) => m.id), lead.rid, this.now);
      if (r.refused) {
        refused = r.refused.code;
        return [];
      }
      for (const m of members) {
        m.on.P = n.inc;
        // (The room's own rid on its record: the chunk tag D checks names the room's request.)
        n.recs.set(m.id, { id: m.id, rid: m.rid });
      }
      return r.actions;
    });
    if (refused) for (const m of members) this.routerSide(m, 'P', 'Failed', `refused: ${refused}`);
  }

  private prefillRecv(n: Node, epoch: string, body: Body): void {
    if (body.type === 'register' || body.type === 'kv_ack' || body.type === 'fail') this.viaP(n, body.room, body.type, (d) => d.message(n.peer, epoch, body, this.now));
  }

  /** Perform the prefill driver's actions, in order (the simulated counterpart of the worker's `perform`). */
  private performP(n: Node, actions: PrefillAction[]): void {
    for (const a of actions) {
      switch (a.a) {
        case 'send':
          this.send(n, a.msg as Body);
          break;
        case 'compute': {
          const dur = this.rng.int(20, 150);
          if (this.tracing) this.tr('P', a.room, `compute starts (${dur} ms)`);
          this.atNode(n, this.now + dur, () => this.computeDone(n, a.room));
          break;
        }
        case 'transfer':
          this.startTransfer(n, a.room);
          break;
        case 'discard': {
          const rec = n.recs.get(a.room);
          if (rec?.file) {
            this.release(rec.file, 'no room needs the state any more');
            rec.file = undefined;
          }
          break;
        }
        case 'finish':
          this.prefillFinish(n, a.room, a.state, a.failure ? failureText(a.failure) : 'kv_done');
          break;
        case 'diag':
          this.diag(n, a.effect);
          break;
        case 'registration_expired':
          if (this.tracing) this.tr('P', a.room, 'pending registration expired: FAIL sent');
          break;
        case 'cancel':
          // The simulated engine cannot be cancelled: the compute still ends in computeDone.
          if (this.tracing) this.tr('P', a.room, 'compute cancelled (no live room); it still finishes');
          break;
        case 'fault_leak':
          break;
      }
    }
  }

  private diag(n: Node, e: Effect): void {
    if (e.t === 'illegal') this.stats.illegal++;
    else if (e.t === 'late') this.stats.late++;
    else if (e.t === 'expired') {
      this.stats.expired++;
      if (this.tracing) this.tr(n.name, e.room, `watchdog: ${stateName(e.state)}/${e.phase} expired`);
    }
  }

  /**
   * The engine finished (it cannot be cancelled in this model): the state is saved whatever
   * happened to the room meanwhile; after a random hop the driver decides (`computeDone`).
   */
  private computeDone(n: Node, id: RoomId): void {
    const file = this.acquire(n, 'statefile', id);
    const hop = this.rng.int(0, 25);
    if (this.tracing) this.tr('P', id, `compute done, state file saved; driver told in ${hop} ms`);
    this.atNode(n, this.now + hop, () => {
      const nChunks = this.rng.int(1, 4);
      const lens = Array.from({ length: nChunks }, () => this.rng.int(64, 512));
      const total = lens.reduce((x, y) => x + y, 0);
      let rec = n.recs.get(id);
      if (!rec) n.recs.set(id, (rec = { id, rid: '?' }));
      rec.file = file; // the computation's one state file, on its lead's record
      // Every room of the computation sends the same state (each with its own head in the worker).
      for (const m of this.byId.get(id)?.group ?? []) {
        const mr = n.recs.get(m.id);
        if (mr) mr.lens = lens;
      }
      rec.lens = lens;
      const actions = this.viaP(n, id, 'computeDone', (d) => d.computeDone(id, { ok: true, totalBytes: total }, this.now));
      if (this.tracing && rec.file && !actions.some((x) => x.a === 'transfer' || x.a === 'discard')) {
        this.tr('P', id, 'the driver has no job for the room any more: nobody will send it');
      }
    });
  }

  /** The driver's `transfer`: KV_BEGIN, the chunks (each a `progress`), KV_END. */
  private startTransfer(n: Node, id: RoomId): void {
    const rec = n.recs.get(id);
    const lens = rec?.lens ?? [];
    const total = lens.reduce((x, y) => x + y, 0);
    n.sending.add(id);
    this.send(n, { type: 'kv_begin', room: id, totalBytes: total });
    let t = this.now;
    let offset = 0;
    lens.forEach((len, k) => {
      t += this.rng.int(1, 8);
      const off = offset;
      offset += len;
      this.atNode(n, t, () => this.sendChunk(n, id, off, len, k === lens.length - 1));
    });
  }

  private sendChunk(n: Node, id: RoomId, offset: number, len: number, last: boolean): void {
    if (!n.sending.has(id)) return; // the worker's abort signal stopped the send
    const rec = n.recs.get(id)!;
    if (!this.send(n, { type: 'chunk', room: id, offset, len, tag: `${id}/${rec.rid}` })) {
      n.sending.delete(id);
      this.viaP(n, id, 'transferFailed', (d) => d.transferFailed(id, failure('kv_transfer_failed', 'socket write failed: connection closed'), this.now));
      return;
    }
    this.viaP(n, id, 'progress', (d) => d.progress(id, len, this.now));
    if (last && n.sending.has(id)) {
      this.send(n, { type: 'kv_end', room: id });
      this.viaP(n, id, 'transferSent', (d) => d.transferSent(id));
    }
  }

  /** The driver's `finish`: release the room's state file, tell the router. */
  private prefillFinish(n: Node, id: RoomId, state: KVPoll, why: string): void {
    this.finished(n, id, state, why);
    n.sending.delete(id);
    // The state file is not released here: the driver's `discard` is its one release path
    // (reference-counted over the rooms of a computation), so the leak check covers it.
  }

  /** A driver's `finish` on either node: once per room and incarnation; the router hears the answer. */
  private finished(n: Node, id: RoomId, state: KVPoll, why: string): void {
    const c = (n.terminals.get(id) ?? 0) + 1;
    n.terminals.set(id, c);
    if (c > 1) this.violate({ kind: 'double_terminal', node: n.name, room: id, detail: `finish #${c} (${stateName(state)}: ${why})` });
    if (this.tracing) this.tr(n.name, id, `TERMINAL ${stateName(state)} (${why})`);
    const req = this.byId.get(id);
    if (req && req.on[n.name] === n.inc) {
      const st = state === KVPoll.Success ? 'Success' : 'Failed';
      this.at(this.now + 1, () => this.routerSide(req, n.name, st, why));
    }
  }

  // ---- decode: the shipped driver over simulated I/O -----------------------------------------

  private decodeCreate(n: Node, req: Req): void {
    let refused: string | undefined;
    this.viaD(n, req.id, 'request', (d) => {
      const r = d.request(req.id, req.rid, 'P', this.now, { local: req.local });
      if (r.refused) {
        refused = r.refused.code;
        return r.actions;
      }
      req.on.D = n.inc;
      // The prealloc queue entry: released when the driver hands the room a slot or finishes it.
      n.recs.set(req.id, { id: req.id, rid: req.rid, queue: this.acquire(n, 'queue', req.id) });
      return r.actions;
    });
    if (refused) this.routerSide(req, 'D', 'Failed', `refused: ${refused}`);
  }

  private decodeRecv(n: Node, epoch: string, body: Body): void {
    const conn = n.conn!;
    if (body.type === 'chunk') {
      this.viaD(n, body.room, 'progress', (d) => {
        const r = d.chunk(conn, body.room, body.offset, body.len, this.now);
        // The worker's receiver validates the stored bytes: a piece of another room's state is bad_state.
        if (r.store && body.tag !== `${body.room}/${n.recs.get(body.room)?.rid}`) return [...r.actions, ...d.fail(body.room, failure('bad_state', `chunk tagged ${body.tag}`), this.now)];
        return r.actions;
      });
      return;
    }
    if (body.type === 'registered' || body.type === 'kv_begin' || body.type === 'kv_end' || body.type === 'fail') this.viaD(n, body.room, body.type, (d) => d.message(conn, epoch, body, this.now));
  }

  /** Perform the decode driver's actions, in order (the simulated counterpart of the worker's `perform`). */
  private performD(n: Node, actions: DecodeAction[]): void {
    for (const a of actions) {
      const rec = 'room' in a ? n.recs.get(a.room) : undefined;
      switch (a.a) {
        case 'assign_slot': {
          const idx = n.slots.findIndex((s) => s.owner === undefined);
          if (idx < 0 || !rec) {
            this.violate({ kind: 'double_release', node: n.name, room: a.room, detail: `the driver handed out a slot with none free (or no request): ${n.slots.length} slots` });
            break;
          }
          if (rec.queue) this.release(rec.queue, 'admitted');
          rec.queue = undefined;
          n.slots[idx] = { owner: a.room };
          rec.slot = { h: this.acquire(n, 'slot', a.room), idx };
          break;
        }
        case 'release':
          if (rec?.loading !== undefined) this.violate({ kind: 'wrong_room', node: n.name, room: a.room, detail: `slot ${rec.loading} released while a load still writes into it` });
          if (rec?.queue) this.release(rec.queue, 'released');
          if (a.slot && rec?.slot) this.releaseSlot(n, rec, 'released');
          n.recs.delete(a.room);
          break;
        case 'dial': {
          const hop = this.rng.int(0, 3);
          this.atNode(n, this.now + hop, () => {
            if (n.connected && n.conn !== undefined) {
              const conn = n.conn;
              this.viaD(n, a.room, 'dialed', (d) => d.dialed(a.room, conn, this.now));
            } else this.viaD(n, a.room, 'dial failed', (d) => d.registerFailed(a.room, failure('peer_unreachable', 'no connection to P'), this.now));
          });
          break;
        }
        case 'register':
          if (a.conn !== n.conn || !this.send(n, a.msg)) this.viaD(n, a.room, 'register failed', (d) => d.registerFailed(a.room, failure('peer_lost', 'connection closed before register'), this.now));
          break;
        case 'send':
          // On the room's connection; else (addr) on the current one, as the pool would open.
          if ((a.conn !== undefined && a.conn === n.conn) || a.addr !== undefined) this.send(n, a.msg as Body);
          break;
        case 'recv_begin':
          if (rec) rec.recv = this.acquire(n, 'recvbuf', a.room);
          break;
        case 'load':
        case 'local_prefill': // decode evaluates the suffix into the slot: uncancellable, may fail, like a load
          if (rec?.slot) this.startLoad(n, rec, rec.slot.idx, a.a);
          break;
        case 'generate': {
          const slot = rec?.slot ? n.slots[rec.slot.idx]! : undefined;
          if (!rec || !slot || slot.owner !== a.room || slot.content?.rid !== rec.rid) {
            this.violate({ kind: 'wrong_room', node: n.name, room: a.room, detail: `generation for ${this.label(a.room)} would run on a slot holding ${slot?.content ? this.label(slot.content.room) : 'nothing'}` });
          }
          this.atNode(n, this.now + this.rng.int(10, 100), () => this.viaD(n, a.room, 'generationDone', (d) => d.generationDone(a.room, this.now)));
          break;
        }
        case 'finish':
          this.finished(n, a.room, a.state, a.failure ? failureText(a.failure) : 'kv_done');
          if (rec?.queue) this.release(rec.queue, 'terminal');
          if (rec?.recv) this.release(rec.recv, 'terminal');
          if (rec) rec.queue = rec.recv = undefined;
          break;
        case 'diag':
          this.diag(n, a.effect);
          break;
        case 'stray':
          if (this.tracing) this.tr(n.name, a.room, `${a.what} on ${a.conn} ignored: the room is not registered on it`);
          break;
      }
    }
  }

  /**
   * The driver's `load`: after a short wait (the worker's receive finish, its file read) the
   * driver is asked whether the room may still load (`proceed`: the room may have ended
   * meanwhile); then llama.cpp writes the state into slot `idx` whatever happens (3% fail).
   */
  private startLoad(n: Node, rec: Rec, idx: number, step: 'load' | 'local_prefill'): void {
    const id = rec.id;
    this.atNode(n, this.now + this.rng.int(0, 3), () => {
      let over = false;
      this.viaD(n, id, 'proceed', (d) => {
        const stop = d.proceed(id, step, this.now);
        over = stop !== null;
        return stop ?? [];
      });
      if (!over) this.runLoad(n, rec, idx);
    });
  }

  private runLoad(n: Node, rec: Rec, idx: number): void {
    const id = rec.id;
    rec.loading = idx;
    const dur = this.rng.int(3, 60);
    const fails = this.rng.chance(0.03);
    if (this.tracing) this.tr('D', id, `loading into slot ${idx} (${dur} ms${fails ? ', will fail' : ''})`);
    this.atNode(n, this.now + dur, () => {
      rec.loading = undefined;
      const slot = n.slots[idx]!;
      if (slot.owner !== id) {
        this.violate({ kind: 'wrong_room', node: n.name, room: id, detail: `state of ${this.label(id)} loaded into slot ${idx}, now ${slot.owner ? `owned by ${this.label(slot.owner)}` : 'free'}` });
      } else if (!fails) slot.content = { room: id, rid: rec.rid };
      if (fails) this.viaD(n, id, 'loadFailed', (d) => d.loadFailed(id, failure('engine_failed', 'simulated load failure'), this.now));
      else this.viaD(n, id, 'loadDone', (d) => d.loadDone(id, this.now));
    });
  }

  private releaseSlot(n: Node, rec: Rec, why: string): void {
    const s = rec.slot;
    if (!s) return;
    const slot = n.slots[s.idx]!;
    if (slot.owner === rec.id) {
      slot.owner = undefined;
      slot.content = undefined;
    }
    rec.slot = undefined;
    this.release(s.h, why);
  }
}

const ms = (x: number): string => (Math.round(x * 10) / 10).toString();

/** Trace label of one core effect. */
function effectLabel(e: Effect): string {
  switch (e.t) {
    case 'terminal':
      return `terminal ${stateName(e.state)}`;
    case 'illegal':
      return `illegal ${stateName(e.from)}→${stateName(e.to)}`;
    case 'late':
      return `late ${e.event}`;
    case 'notify_peer':
      return `notify_peer(${failureText(e.failure)})`;
    default:
      return e.t;
  }
}

const bracket = (labels: string[]): string => (labels.length ? ` [${labels.join(', ')}]` : '');


/** Trace label of one driver action. */
function actionLabel(a: PrefillAction | DecodeAction): string {
  if (a.a === 'finish') return `terminal ${stateName(a.state)}`;
  if (a.a === 'diag') return effectLabel(a.effect);
  if (a.a === 'send') return a.msg.type === 'fail' ? `notify_peer(${a.msg.code}: ${a.msg.detail})` : `send ${a.msg.type}`;
  if (a.a === 'release') return a.slot ? 'release slot' : 'release';
  return a.a;
}

/** ' [action, action]' for traces of a driver. */
const fxA = (actions: (PrefillAction | DecodeAction)[]): string => bracket(actions.map(actionLabel));
const fxD = fxA;

/**
 * The fake ports the simulator runs the shipped effect executors over (../prefill/effects.ts,
 * ../decode/effects.ts): a state directory of named files shared by both nodes (one host), the
 * engines' sequence slots, the KV connections, the state sender and receiver and the same-host
 * handoff — all on virtual time from the world's seeded PRNG. Every fake reports to the checkers
 * (./checks.ts): slots, receive buffers and state files are resources taken and given back; a
 * load or a generation on a slot checks whose state the slot holds.
 *
 * The bytes that travel are real where they decide something: the envelope head is the
 * executor's (`prepareEnvelopeHead`) and is parsed back with `parseEnvelopeHead`; a state file's
 * payload names its content (the prompt tokens it holds) in its first 4 bytes, so the receiver
 * knows whose state arrived.
 */
import type { Clock } from '../base/clock.js';
import type { Prng } from '../base/prng.js';
import { KvError, type RoomId } from '../kv/types.js';
import type { ControlMsg } from '../kv/messages.js';
import { SIM_PIECE_BYTES, type SimConn } from './net.js';
import { parseEnvelopeHead, type EnvelopeExpect } from '../kv/envelope.js';
import { wireBytes } from '../kv/transfer/sender.js';
import type { ReceivedState, StreamEnd } from '../kv/transfer/receiver.js';
import type { TakeOutcome } from '../kv/transfer/same-host.js';
import type { ParsedState } from '../engine/ggsq.js';
import type { Engine, PrefillResult, SamplingParams, Slot } from '../engine/types.js';
import type { StateFiles } from '../runtime/statefiles.js';
import type { GrowingSendOptions, SameHostOffer, SendOptions, StateSender } from '../prefill/effects.js';
import type { SameHostTake, StateIntake } from '../decode/effects.js';
import { ComputationMetrics } from '../prefill/computation.js';
import { WorkerMetrics } from '../runtime/metrics.js';
import { PrefixCacheMetrics } from '../prefixes/prefix-metrics.js';
import type { Checks, Handle, NodeName } from './checks.js';

/** What a fake needs of its node incarnation. */
export interface NodeCtx {
  readonly name: NodeName;
  readonly inc: number;
  readonly rng: Prng;
  readonly checks: Checks;
  readonly clock: Clock;
  /** Run `fn` `delayMs` of virtual time from now, if this incarnation is still up then. */
  later(delayMs: number, fn: () => void): void;
  /** A promise settled by `fn` after `delayMs` (never, if the node crashed meanwhile). */
  after<T>(delayMs: number, fn: () => T): Promise<T>;
  note(room: RoomId | undefined, text: string): void;
}

/** The state directory of the simulated host. */
export const SIM_STATE_DIR = '/sim/shm';
/** What the simulated engines say about themselves (an envelope head names it). */
export const SIM_MODEL = { fingerprint: 'sim-model', contextSize: 4096, batchSize: 512 } as const;
/** Decode's maxStateBytes in the simulated worlds (states are 64..2048 bytes). */
export const SIM_MAX_STATE_BYTES = 1 << 20;
const EXPECT: EnvelopeExpect = { fingerprint: SIM_MODEL.fingerprint, contextSize: SIM_MODEL.contextSize, batchSize: SIM_MODEL.batchSize, maxPayloadBytes: SIM_MAX_STATE_BYTES };
const ENGINE_INFO = { fingerprint: SIM_MODEL.fingerprint, compat: { contextSize: SIM_MODEL.contextSize, batchSize: SIM_MODEL.batchSize } } as unknown as Engine['info'];
/** The first token every simulated prompt samples (choice i: + i). */
const FIRST_TOKEN = 1;

// ---- files ------------------------------------------------------------------------------------

interface DiskFile {
  h: Handle;
  /** Index into `SimDisk.contents`: the tokens this state holds. */
  content: number;
  payloadBytes: number;
}

/** The room a state file's name is about (for reports). */
const roomOfPath = (path: string): RoomId => (/-(\d+)(?:-saved)?\.ggsq$/.exec(path)?.[1] ?? path) as RoomId;

/** The simulated host's state directory: names → files; each name is a resource of the node that made or took it. */
export class SimDisk {
  private readonly files = new Map<string, DiskFile>();
  /** The token lists states hold, by content id. */
  readonly contents: (readonly number[])[] = [];

  constructor(private readonly checks: Checks) {}

  has(path: string): boolean {
    return this.files.has(path);
  }

  get(path: string): DiskFile | undefined {
    return this.files.get(path);
  }

  /** A new content id for `tokens`. */
  content(tokens: readonly number[]): number {
    this.contents.push(tokens);
    return this.contents.length - 1;
  }

  /** Create (or overwrite) `path` as `ctx`'s. */
  create(ctx: NodeCtx, path: string, content: number, payloadBytes: number): void {
    this.drop(path, 'overwritten');
    this.files.set(path, { h: this.checks.acquire(ctx.name, ctx.inc, 'statefile', roomOfPath(path)), content, payloadBytes });
  }

  private drop(path: string, why: string): boolean {
    const f = this.files.get(path);
    if (!f) return false;
    this.files.delete(path);
    this.checks.release(f.h, why);
    return true;
  }

  /** Move `from` to `to`; `to` is `ctx`'s now. @throws ENOENT when `from` is gone. */
  rename(ctx: NodeCtx, from: string, to: string): DiskFile {
    const f = this.files.get(from);
    if (!f) throw Object.assign(new Error(`ENOENT: rename ${from}`), { code: 'ENOENT' });
    this.files.delete(from);
    this.drop(to, 'replaced by a rename');
    f.h.node = ctx.name;
    f.h.inc = ctx.inc;
    this.files.set(to, f);
    return f;
  }

  /** The state-file port of node `ctx`. */
  port(ctx: NodeCtx): StateFiles {
    return {
      remove: async (path) => {
        this.drop(path, 'deleted');
      },
      removeNow: (path) => {
        this.drop(path, 'deleted');
      },
      rename: (from, to) => {
        this.rename(ctx, from, to);
      },
      link: (from, to) => {
        const f = this.files.get(from);
        if (!f) throw Object.assign(new Error(`ENOENT: link ${from}`), { code: 'ENOENT' });
        if (this.files.has(to)) throw Object.assign(new Error(`EEXIST: link ${to}`), { code: 'EEXIST' });
        this.files.set(to, { h: this.checks.acquire(ctx.name, ctx.inc, 'statefile', roomOfPath(to)), content: f.content, payloadBytes: f.payloadBytes });
      },
    };
  }

  /** A node's start-up sweep: the files its earlier incarnations left are deleted. */
  sweep(node: NodeName, inc: number): void {
    for (const [path, f] of [...this.files]) if (f.h.node === node && f.h.inc < inc) this.drop(path, 'startup sweep');
  }

  /** The bytes of a state of `content`: the content id, then zeros, `payloadBytes` in all. */
  static payload(content: number, payloadBytes: number): Buffer {
    const b = Buffer.alloc(payloadBytes);
    b.writeUInt32LE(content, 0);
    return b;
  }
}

// ---- engines ----------------------------------------------------------------------------------

/** One physical sequence of a simulated engine. */
interface Seq {
  owner?: SimLease;
  /** The tokens of the state it holds. */
  content?: readonly number[];
}

/** A lease's room before the world learns it. */
const NO_ROOM = '?' as RoomId;

/** A slot lease (the fake `Slot`): uncancellable evaluations and loads that take virtual time. */
export class SimLease {
  /** The room the lease serves (set by the world once the executor holds it; for reports). */
  room: RoomId = NO_ROOM;
  loading = false;
  generating = false;
  released = false;
  readonly h: Handle;

  constructor(
    private readonly engine: SimEngine,
    readonly index: number,
  ) {
    this.h = engine.ctx.checks.acquire(engine.ctx.name, engine.ctx.inc, 'slot', NO_ROOM);
  }

  /** The tokens of the state its sequence holds now (undefined when not its own any more). */
  content(): readonly number[] | undefined {
    const s = this.engine.seqs[this.index]!;
    return s.owner === this ? s.content : undefined;
  }

  /** Evaluate a prompt (prefill, or decode-local): the state then holds prompt + resumed tokens. Cannot be cancelled. */
  prefill(tokens: number[], sampling: SamplingParams, _signal: AbortSignal, choices = 1): Promise<PrefillResult> {
    const ctx = this.engine.ctx;
    const held = [...tokens, ...(sampling.resumed ?? [])];
    const dur = ctx.rng.int(this.engine.role === 'prefill' ? 20 : 3, this.engine.role === 'prefill' ? 150 : 60);
    const fails = this.engine.role === 'decode' && ctx.rng.chance(0.03);
    ctx.note(this.room, `${this.engine.role === 'prefill' ? 'compute' : 'local prefill'} starts on slot ${this.index} (${dur} ms${fails ? ', will fail' : ''})`);
    return this.write(dur, fails, held, () => ({
      promptTokens: held.length,
      cachedTokens: 0,
      firstToken: FIRST_TOKEN,
      firstIsEog: false,
      choices: Array.from({ length: choices }, (_, i) => ({ firstToken: FIRST_TOKEN + i, firstIsEog: false })),
    }));
  }

  /** The sequence's state → a file at `path` (created at once, the size known when the save ends). */
  saveState(path: string): Promise<number> {
    const { ctx, disk } = this.engine;
    const payloadBytes = ctx.rng.int(64, 2048);
    disk.create(ctx, path, disk.content(this.engine.seqs[this.index]!.content ?? []), payloadBytes);
    return ctx.after(ctx.rng.int(0, 25), () => payloadBytes);
  }

  firstOutput(token: number): Promise<{ token: number; text: string }> {
    return Promise.resolve({ token, text: '' });
  }

  /** Load a received or taken state (3% fail); the file must still exist if it is a named one. */
  loadState(path: string, tokens: number[]): Promise<void> {
    const { ctx, disk } = this.engine;
    if (path.startsWith(SIM_STATE_DIR) && !disk.has(path)) return Promise.reject(new Error(`load of ${path}: no such file`));
    const dur = ctx.rng.int(3, 60);
    const fails = ctx.rng.chance(0.03);
    ctx.note(this.room, `loading into slot ${this.index} (${dur} ms${fails ? ', will fail' : ''})`);
    return this.write(dur, fails, tokens, () => undefined);
  }

  /** An engine call writing `held` into the sequence after `dur`; checks the sequence is still this lease's then. */
  private write<T>(dur: number, fails: boolean, held: readonly number[], result: () => T): Promise<T> {
    const { ctx } = this.engine;
    this.loading = true;
    return ctx.after(dur, () => {
      this.loading = false;
      const s = this.engine.seqs[this.index]!;
      if (s.owner !== this) ctx.checks.violate({ kind: 'wrong_room', node: ctx.name, room: this.room, detail: `a state was written into slot ${this.index} after its lease ended (${s.owner ? `now ${s.owner.room}'s` : 'free'})` });
      else if (!fails) s.content = held;
      if (fails) throw new Error('simulated engine failure');
      return result();
    });
  }

  release(): void {
    const ctx = this.engine.ctx;
    if (this.loading) ctx.checks.violate({ kind: 'wrong_room', node: ctx.name, room: this.room, detail: `slot ${this.index} released while an engine call still writes into it` });
    if (this.generating) ctx.checks.violate({ kind: 'wrong_room', node: ctx.name, room: this.room, detail: `slot ${this.index} released while it generates` });
    ctx.checks.release(this.h, 'released');
    if (this.released) return;
    this.released = true;
    const s = this.engine.seqs[this.index]!;
    if (s.owner === this) {
      s.owner = undefined;
      s.content = undefined;
    }
  }
}

/** A simulated engine: `slots` sequences, leased by `tryAcquireSlot`. */
export class SimEngine {
  readonly seqs: Seq[];
  readonly info = ENGINE_INFO;

  constructor(
    readonly ctx: NodeCtx,
    readonly disk: SimDisk,
    readonly role: 'prefill' | 'decode',
    slots: number,
  ) {
    this.seqs = Array.from({ length: slots }, () => ({}));
  }

  tryAcquireSlot(): Slot | null {
    const i = this.seqs.findIndex((s) => s.owner === undefined);
    if (i < 0) return null;
    const lease = new SimLease(this, i);
    this.seqs[i]!.owner = lease;
    return lease as unknown as Slot;
  }
}

// ---- the state's way: sender, receiver, same host -----------------------------------------

/**
 * The state sender: the envelope bytes in SIM_PIECE_BYTES pieces through the shipped `sendFrom`
 * and send rotation of the connection (./net.ts), paced by its socket's flushes.
 */
export function simSender(_ctx: NodeCtx, disk: SimDisk): StateSender<SimConn> {
  const send = (conn: SimConn, room: RoomId, path: string, head: Buffer, payloadBytes: number, o: SendOptions): Promise<void> => {
    const f = disk.get(path);
    if (!f) return Promise.reject(new KvError('BAD_STATE', `send of ${path}: no such file`));
    const total = wireBytes(head, payloadBytes);
    const bytes = Buffer.concat([head, SimDisk.payload(f.content, payloadBytes), Buffer.alloc(total - head.length - payloadBytes)]);
    let at = 0;
    const next = (): Buffer | undefined => {
      if (at >= bytes.length) return undefined;
      const n = Math.min(SIM_PIECE_BYTES, bytes.length - at);
      at += n;
      return bytes.subarray(at - n, at);
    };
    return conn.sendFrom(room, { next }, { signal: o.signal, stallMs: o.stallMs, onProgress: o.onProgress });
  };
  return {
    sendFile: send,
    sendGrowing: (_conn: SimConn, _room: RoomId, _path: string, _head: Buffer, _o: GrowingSendOptions) => Promise.reject(new Error('the simulated worlds do not stream a growing state')),
  };
}

/** One room's incoming state: the bytes gathered, the head and the content checked at `finish`. */
class SimIntake implements StateIntake<SimConn> {
  private readonly h: Handle;
  private readonly parts: Buffer[] = [];
  private received = 0;
  private failed: Error | undefined;
  private given = false;

  constructor(
    private readonly ctx: NodeCtx,
    private readonly disk: SimDisk,
    private readonly room: RoomId,
    private readonly totalBytes: number,
  ) {
    this.h = ctx.checks.acquire(ctx.name, ctx.inc, 'recvbuf', room);
  }

  push(data: Buffer): void {
    if (this.failed) throw this.failed;
    this.received += data.length;
    if (this.received > this.totalBytes) throw (this.failed = new KvError('BAD_ENVELOPE', `more than the ${this.totalBytes} bytes kv_begin announced`));
    this.parts.push(Buffer.from(data));
  }

  async finish(_end?: StreamEnd): Promise<ReceivedState<ParsedState>> {
    if (this.failed) throw this.failed;
    if (this.received !== this.totalBytes) throw new KvError('BAD_ENVELOPE', `${this.received} of ${this.totalBytes} bytes at kv_end`);
    const buf = Buffer.concat(this.parts);
    const head = parseEnvelopeHead(buf, EXPECT);
    if (!head) throw new KvError('BAD_ENVELOPE', 'incomplete envelope head');
    const tokens = this.disk.contents[buf.readUInt32LE(head.headBytes)];
    if (!tokens) throw new KvError('BAD_STATE', 'payload of no known state');
    return { header: head.header, state: { nTokens: tokens.length, tokens: [...tokens] } as unknown as ParsedState, path: `recv:${this.room}` };
  }

  async done(): Promise<void> {
    this.giveUp('loaded');
  }

  async discard(): Promise<void> {
    this.failed ??= new KvError('ABORTED', 'receive discarded');
    this.giveUp('discarded');
  }

  private giveUp(why: string): void {
    if (this.given) return;
    this.given = true;
    this.ctx.checks.release(this.h, why);
  }
}

/** Decode's receiver port. */
export function simReceive(ctx: NodeCtx, disk: SimDisk): (room: RoomId, totalBytes: number) => StateIntake<SimConn> {
  return (room, totalBytes) => new SimIntake(ctx, disk, room, totalBytes);
}

/** Prefill's same-host port: a decode that probed (when the world shares the host) may take kv_file. */
export function simSameHostOffer(enabled: boolean): SameHostOffer {
  const confirmed = new Set<string>();
  return {
    onMessage: (id, msg) => {
      if (enabled && msg.type === 'same_host_probe') confirmed.add(id);
      return undefined;
    },
    usable: (id) => confirmed.has(id),
    forget: (id) => void confirmed.delete(id),
    offer: (_id, room, path, head, payloadBytes) => ({ type: 'kv_file', room, file: path, payloadBytes, head: head.toString('base64') }),
  };
}

/** Decode's same-host port: takes a handed file over by renaming it, refuses a file that is gone. */
export function simSameHostTake(ctx: NodeCtx, disk: SimDisk): SameHostTake<SimConn> {
  return {
    ready: () => Promise.resolve(true),
    onReply: () => {},
    take: (msg): TakeOutcome<ParsedState> => {
      const f = disk.get(msg.file);
      if (!f) return { refused: 'could not take the state file over (ENOENT): prefill may have dropped it' };
      if (f.payloadBytes !== msg.payloadBytes) return { refused: `the state file is ${f.payloadBytes} bytes, kv_file says ${msg.payloadBytes}` };
      const head = parseEnvelopeHead(Buffer.from(msg.head, 'base64'), EXPECT);
      if (!head) throw new KvError('BAD_ENVELOPE', 'incomplete envelope head in kv_file');
      const path = `${SIM_STATE_DIR}/pdserve-decode-${ctx.inc}-${msg.room}.ggsq`;
      disk.rename(ctx, msg.file, path);
      const tokens = disk.contents[f.content] ?? [];
      return { taken: { header: head.header, state: { nTokens: tokens.length, tokens: [...tokens] } as unknown as ParsedState, path }, verified: false, bytesRead: 0, reads: 0 };
    },
  };
}

// ---- metrics --------------------------------------------------------------------------------

/** Process-wide metrics of the simulated executors: counted, never read (one registry per role, not per world). */
let metrics: { prefill: WorkerMetrics; decode: WorkerMetrics; compute: ComputationMetrics; prefixP: PrefixCacheMetrics; prefixD: PrefixCacheMetrics } | undefined;
export function simMetrics(): NonNullable<typeof metrics> {
  if (!metrics) {
    const none = { queues: () => ({}), roomsByState: () => new Map(), channel: () => ({}) };
    const prefill = new WorkerMetrics('prefill', none);
    const decode = new WorkerMetrics('decode', none);
    const cached = () => ({ sequences: 0, tokens: 0 });
    metrics = { prefill, decode, compute: new ComputationMetrics(prefill.registry), prefixP: new PrefixCacheMetrics(prefill.registry, cached), prefixD: new PrefixCacheMetrics(decode.registry, cached) };
  }
  return metrics;
}

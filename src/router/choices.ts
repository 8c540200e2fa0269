/**
 * n > 1 in PD: one prefill computation, n decode sequences from the same state (vLLM's parallel
 * sampling, across the PD split). The request is still fanned out into n single-choice
 * generations (src/api/fanout.ts, run in process): each is an ordinary `PdRequest` with its own room, its own
 * decode pick, load lease, deadline, abort and error handling, and decode's side is unchanged
 * (one room = one sequence). What this module adds is the prefill side: the n choices of one
 * prompt are members of a `ChoiceGroup`, which
 *  - fixes the prefill worker (the first member picks it with the policy; the others take it);
 *  - waits until every member has drawn its room, then sends prefill ONE `/generate` naming the
 *    n rooms (`bootstrap_rooms`; `bootstrap_room` = the first, SGLang's single-room field);
 *  - splits prefill's multiplexed answer (src/prefill/computation.ts) back into one
 *    single-room answer per member, which the member's prefill leg reads exactly as it reads a
 *    single request's answer (first-token event, then transfer or error, then [DONE]).
 * Room i's first token is sampled with seed + i, as the fan-out gives choice i seed + i.
 *
 * Members are the fan-out's in-process choices (../api/generation.ts), each handed its
 * membership by `groupMembers`: a client cannot name or join a group.
 *
 * Failure rules: a member that leaves before the prefill request was sent (its choice was
 * aborted or refused) fails the others with 503 `choice_group_incomplete` (the fan-out fails the
 * whole request anyway); so does a group not complete within its join deadline. A prefill that
 * refuses the request answers every member with its status and body. After the send, a member
 * leaving only stops reading its part; the prefill request is aborted when every member left.
 */
import type { ErrorCode } from '../base/errors.js';
import { randomBytes } from 'node:crypto';
import { request, type Dispatcher } from 'undici';
import type { ChoiceSpec } from '../api/generation.js';
import { readSse } from '../api/sse.js';
import type { RoomId } from '../base/room-id.js';
import { readText, type WorkerState } from './registry.js';
import { ApiError, InternalError, PdError } from '../base/errors.js';

/** How long prefill's answer may run on after the last choice finished (ms), as a single request's leg lingers. */
const GROUP_LINGER_MS = 2000;
/** Largest error body read from prefill, bytes. */
const MAX_ERROR_BODY = 64 * 1024;

/** What a member's prefill leg reads instead of its own HTTP answer: undici's response shape. */
export interface MemberResponse {
  statusCode: number;
  body: AsyncIterable<Uint8Array>;
}

/** A member's part of the group's prefill answer: a bounded-by-construction queue of SSE frames. */
class MemberStream {
  private readonly frames: Uint8Array[] = [];
  private ended = false;
  private wake: (() => void) | null = null;
  push(data: string): void {
    if (this.ended) return;
    this.frames.push(Buffer.from(`data: ${data}\n\n`));
    this.wake?.();
  }
  end(): void {
    this.ended = true;
    this.wake?.();
  }
  async *iterate(signal: AbortSignal): AsyncGenerator<Uint8Array> {
    const onAbort = () => this.wake?.();
    signal.addEventListener('abort', onAbort);
    try {
      for (;;) {
        if (signal.aborted) throw Object.assign(new PdError('ABORTED', 'member aborted'), { name: 'AbortError' });
        const f = this.frames.shift();
        if (f) {
          yield f;
          continue;
        }
        if (this.ended) return;
        await new Promise<void>((r) => (this.wake = r));
        this.wake = null;
      }
    } finally {
      signal.removeEventListener('abort', onAbort);
    }
  }
}

interface Member {
  room: RoomId;
  body: string;
  stream: MemberStream;
  result: { resolve(r: MemberResponse): void; reject(e: unknown): void };
  left: boolean;
}

/** Everything a group needs from its router. */
export interface GroupContext {
  dataAgent: Dispatcher;
  /** Longest wait for every member to draw its room (ms). */
  joinTimeoutMs: number;
  maxEventBytes: number;
  log: { warn(obj: object, msg: string): void };
}

/** The n members of one prompt's choices; see the module doc. */
export class ChoiceGroup {
  /** The prefill worker of every member (set by the first member's pick). */
  prefill: WorkerState | null = null;
  private readonly members: (Member | undefined)[];
  private joined = 0;
  private sent = false;
  private streamEnded = false;
  private failed: { status: number; body: string } | null = null;
  private readonly ac = new AbortController();
  private readonly timer: NodeJS.Timeout;

  constructor(
    readonly id: string,
    readonly n: number,
    private readonly ctx: GroupContext,
    private readonly onGone: () => void,
  ) {
    this.members = new Array(n).fill(undefined);
    this.timer = setTimeout(() => {
      this.fail(503, 'choice_group_incomplete', `not every choice reached the router within ${ctx.joinTimeoutMs} ms`);
      this.onGone();
    }, ctx.joinTimeoutMs);
    this.timer.unref();
  }

  /**
   * Member `index` drew `room`; `body` is its /generate body (JSON). Resolves with its part of
   * the group's prefill answer once every member joined and prefill answered the head.
   */
  join(index: number, room: RoomId, body: string, signal: AbortSignal): Promise<MemberResponse> {
    return new Promise<MemberResponse>((resolve, reject) => {
      if (this.failed) return resolve(errorResponse(this.failed));
      if (this.members[index] || index < 0 || index >= this.n) return reject(new InternalError(`choice ${index} joined twice`));
      const m: Member = { room, body, stream: new MemberStream(), result: { resolve, reject }, left: false };
      this.members[index] = m;
      this.joined++;
      signal.addEventListener('abort', () => this.leave(index), { once: true });
      if (this.joined === this.n) void this.send();
    });
  }

  /** Member `index` is over (finished, failed or aborted). Idempotent. */
  leave(index: number): void {
    const m = this.members[index];
    if (m?.left) return;
    if (!m) {
      // Never joined (refused before dispatch, aborted early): the group cannot be complete.
      this.members[index] = { room: '' as RoomId, body: '', stream: new MemberStream(), result: { resolve() {}, reject() {} }, left: true };
      this.fail(503, 'choice_group_incomplete', `choice ${index} ended before the prefill request was sent`);
      this.maybeGone();
      return;
    }
    m.left = true;
    m.stream.end();
    if (!this.sent) this.fail(503, 'choice_group_incomplete', `choice ${index} ended before the prefill request was sent`);
    this.maybeGone();
  }

  private maybeGone(): void {
    if (!this.members.every((m) => m?.left)) return;
    clearTimeout(this.timer);
    this.onGone();
    // After the send, prefill's answer gets LINGER_MS to end on its own (its rooms' kv_acks may
    // still be in flight when the last choice finished), then the request is cut.
    if (!this.sent || this.streamEnded) this.ac.abort();
    else setTimeout(() => this.ac.abort(), GROUP_LINGER_MS).unref();
  }

  /** Before the send: answer every joined member with this error, and later joiners too. */
  private fail(status: number, code: ErrorCode, message: string): void {
    if (this.sent || this.failed) return;
    clearTimeout(this.timer);
    this.failed = { status, body: JSON.stringify({ error: { message, type: 'server_error', param: null, code } }) };
    for (const m of this.members) if (m && !m.left) m.result.resolve(errorResponse(this.failed));
  }

  /** ONE /generate to prefill naming every member's room; its answer split per room. */
  private async send(): Promise<void> {
    if (this.failed || !this.prefill) return;
    this.sent = true;
    clearTimeout(this.timer);
    const members = this.members as Member[];
    const byRoom = new Map(members.map((m) => [m.room, m]));
    const body = { ...(JSON.parse(members[0]!.body) as Record<string, unknown>), bootstrap_rooms: members.map((m) => m.room) };
    try {
      const res = await request(`${this.prefill.url}/generate`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', accept: 'text/event-stream' },
        body: JSON.stringify(body),
        signal: this.ac.signal,
        dispatcher: this.ctx.dataAgent,
      });
      if (res.statusCode !== 200) {
        const err = { status: res.statusCode, body: await readText(res.body, MAX_ERROR_BODY) };
        for (const m of members) m.result.resolve(errorResponse(err));
        return;
      }
      for (const m of members) m.result.resolve({ statusCode: 200, body: m.stream.iterate(this.ac.signal) });
      for await (const data of readSse(res.body, { maxEventBytes: this.ctx.maxEventBytes })) {
        if (data === '[DONE]') break;
        const ev = JSON.parse(data) as { room?: unknown; transfer?: unknown; error?: unknown };
        const m = typeof ev.room === 'string' ? byRoom.get(ev.room as RoomId) : undefined;
        if (!m) continue;
        const { room: _room, ...rest } = ev;
        m.stream.push(JSON.stringify(rest));
        // A room's terminal event ends its part, as a single answer ends after it.
        if (rest.transfer !== undefined || rest.error !== undefined) {
          m.stream.push('[DONE]');
          m.stream.end();
        }
      }
    } catch (err) {
      if (!this.ac.signal.aborted) this.ctx.log.warn({ prefill: this.prefill.url, err: (err as Error).message }, 'choice group: prefill answer failed');
      for (const m of members) m.result.reject(err);
    } finally {
      this.streamEnded = true;
      // Parts never ended (a cut stream) end here: each member's leg reports the truncation.
      for (const m of members) m.stream.end();
    }
  }
}

function errorResponse(e: { status: number; body: string }): MemberResponse {
  return {
    statusCode: e.status,
    body: (async function* () {
      yield Buffer.from(e.body);
    })(),
  };
}

/** The router's live choice groups (by id), each removed when all its members left. */
export class ChoiceGroups {
  private readonly groups = new Map<string, ChoiceGroup>();
  constructor(private readonly ctx: GroupContext) {}

  /** A new group of `n` members. */
  create(n: number): ChoiceGroup {
    const id = randomBytes(16).toString('hex');
    const g = new ChoiceGroup(id, n, this.ctx, () => this.groups.delete(id));
    this.groups.set(id, g);
    return g;
  }

  get size(): number {
    return this.groups.size;
  }
}

/**
 * One choice group per prompt of a fanned-out request with n > 1 (a batch with n = 1 needs
 * none: each prompt is its own computation anyway); returns each choice's membership (undefined
 * for a choice of no group). Every member must run (and leave) once: a member that never joins
 * fails its group.
 */
export function groupMembers<S extends ChoiceSpec>(groups: ChoiceGroups, subs: readonly S[]): (s: S) => { group: ChoiceGroup; index: number } | undefined {
  const perPrompt = new Map<number, S[]>();
  for (const s of subs) perPrompt.set(s.promptIndex, [...(perPrompt.get(s.promptIndex) ?? []), s]);
  const member = new Map<S, { group: ChoiceGroup; index: number }>();
  for (const list of perPrompt.values()) {
    if (list.length < 2) continue;
    const g = groups.create(list.length);
    list.forEach((s, index) => member.set(s, { group: g, index }));
  }
  return (s) => member.get(s);
}

/**
 * The simulator's checkers: the safety and liveness properties a world is held to (docs/
 * LIFECYCLE.md "The simulator"), apart from the world that produces the interleavings. The world
 * (world.ts) and its fake ports (ports.ts) report what happens — resources taken and given back,
 * terminal actions, watchdog ticks, driver inputs, aborts — and these record a violation when a
 * property breaks:
 *
 * - every resource (slot, queue entry, receive buffer, state file) released exactly once, none
 *   held at the end (`double_release`, `leak`);
 * - a load or a generation only on the slot its room owns, holding its own request's state
 *   (`wrong_room`: no client gets another request's tokens);
 * - one terminal per room and incarnation, never non-terminal again (`double_terminal`, `revival`);
 * - every live room has a deadline and ends within a tick of it (`no_deadline`, `wedge`), none is
 *   live at the end (`stuck`), none is live after a router abort reached it (`ran_after_abort`),
 *   the rooms of a crashed peer fail within the heartbeat bound (`peer_loss_late`);
 * - the router's attempt plan: a request re-dispatched (retried or migrated) at most
 *   `migrationLimit` times (`over_budget`), never at or past its deadline (`late_attempt`),
 *   retried only while its client has nothing and migrated only when it has output
 *   (`wrong_redispatch`).
 */
import { stateName, type RoomTable } from '../kv/lifecycle.js';
import { KVPoll, isTerminal, type RoomId } from '../kv/types.js';

export type NodeName = 'P' | 'D' | 'D2';

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
  | 'misordered'
  | 'over_budget'
  | 'late_attempt'
  | 'wrong_redispatch'
  | 'unfair_send'
  | 'blamed_peer'
  /** A role switch tore a node down while a request was in flight or a room live on it, or a node switching accepted a request. */
  | 'half_switched'
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

export type ResourceKind = 'slot' | 'queue' | 'recvbuf' | 'statefile';

/** One resource taken by a node incarnation for a room. */
export interface Handle {
  id: number;
  kind: ResourceKind;
  node: NodeName;
  inc: number;
  room: RoomId;
  at: number;
  released?: { at: number; why: string };
}

/**
 * What a striped connection's reassembly hands decode's executor must be what one socket would
 * have given it: per room, from its kv_begin, each chunk at the next offset and kv_end only after
 * the last byte (else `misordered`). One per decode end of a striped connection.
 */
export class StreamOrder {
  private readonly rooms = new Map<RoomId, { next: number; total: number }>();

  constructor(
    private readonly checks: Checks,
    private readonly node: NodeName,
  ) {}

  begin(room: RoomId, totalBytes: number): void {
    this.rooms.set(room, { next: 0, total: totalBytes });
  }

  chunk(room: RoomId, offset: number, bytes: number): void {
    const r = this.rooms.get(room);
    if (!r) return; // a late chunk of an ended room: the executor refuses it on its own
    if (offset !== r.next) this.checks.violate({ kind: 'misordered', node: this.node, room, detail: `the striped connection handed on a chunk at offset ${offset} while ${r.next} was next` });
    r.next = Math.max(r.next, offset + bytes);
  }

  /** kv_end handed on (`totalBytes`: a streamed kv_end's count, else kv_begin's). */
  end(room: RoomId, totalBytes?: number): void {
    const r = this.rooms.get(room);
    if (!r) return;
    this.rooms.delete(room);
    const at = totalBytes ?? r.total;
    if (r.next < at) this.checks.violate({ kind: 'misordered', node: this.node, room, detail: `the striped connection handed on kv_end after ${r.next} of its ${at} bytes` });
  }

  forget(room: RoomId): void {
    this.rooms.delete(room);
  }
}

/** What the checkers need of the world: the virtual time, labels and the trace. */
export interface CheckHost {
  readonly now: number;
  label(room: RoomId): string;
  /** Trace a line (when tracing). */
  note(who: NodeName | 'sim', room: RoomId | undefined, text: string): void;
}

/** ms with one decimal. */
export const ms = (x: number): string => (Math.round(x * 10) / 10).toString();

/** The violations of one world, and the bookkeeping they are judged from. */
export class Checks {
  readonly violations: Violation[] = [];
  private readonly handles = new Set<Handle>();
  private handleSeq = 0;

  constructor(private readonly w: CheckHost) {}

  /** Record a violation (once per kind, node and room). */
  violate(v: Omit<Violation, 'at' | 'label'>): void {
    const key = `${v.kind}|${v.node ?? ''}|${v.room ?? ''}`;
    if (this.violations.some((x) => `${x.kind}|${x.node ?? ''}|${x.room ?? ''}` === key)) return;
    this.violations.push({ ...v, at: this.w.now, label: v.room ? this.w.label(v.room) : undefined });
    this.w.note('sim', v.room, `!! VIOLATION ${v.kind}${v.node ? ` on ${v.node}` : ''}: ${v.detail}`);
  }

  // ---- the router's attempts ---------------------------------------------------------------

  /**
   * The router decided to re-dispatch `room`'s request (`how`: retry from the start, or migrate
   * with the client's output) as its `n`-th re-dispatch (limit `limit`), the request's deadline
   * being `deadlineAt`; `output`: the client has output (a retry would send it twice, a
   * migration without it would lose nothing to resume).
   */
  attempt(room: RoomId, how: 'retry' | 'migrate', n: number, limit: number, deadlineAt: number, output = how === 'migrate'): void {
    if (n > limit) this.violate({ kind: 'over_budget', room, detail: `${how} ${n} of a request whose limit is ${limit}` });
    if (this.w.now >= deadlineAt) this.violate({ kind: 'late_attempt', room, detail: `${how} decided at t=${ms(this.w.now)}, at or past the request's deadline t=${ms(deadlineAt)}` });
    if ((how === 'retry') === output) this.violate({ kind: 'wrong_redispatch', room, detail: `${how} of a request whose client has ${output ? 'output' : 'nothing yet'}` });
  }

  // ---- resources ----------------------------------------------------------------------------

  acquire(node: NodeName, inc: number, kind: ResourceKind, room: RoomId): Handle {
    const h: Handle = { id: ++this.handleSeq, kind, node, inc, room, at: this.w.now };
    this.handles.add(h);
    return h;
  }

  release(h: Handle, why: string): void {
    if (h.released) {
      this.violate({ kind: 'double_release', node: h.node, room: h.room, detail: `${h.kind} #${h.id} released twice: first at t=${ms(h.released.at)} (${h.released.why}), again (${why})` });
      return;
    }
    h.released = { at: this.w.now, why };
    this.handles.delete(h);
    if (h.kind !== 'queue') this.w.note(h.node, h.room, `release ${h.kind} (${why})`);
  }

  /** Resources held by `node` (of incarnations before `inc` when given). */
  held(node: NodeName, pred: (h: Handle) => boolean = () => true): Handle[] {
    return [...this.handles].filter((h) => h.node === node && pred(h));
  }

  // ---- rooms --------------------------------------------------------------------------------

  /** A driver's `finish` for `room` on a node incarnation (`terminals`: its count so far). */
  terminal(node: NodeName, terminals: Map<RoomId, number>, room: RoomId, what: string): void {
    const c = (terminals.get(room) ?? 0) + 1;
    terminals.set(room, c);
    if (c > 1) this.violate({ kind: 'double_terminal', node, room, detail: `finish #${c} (${what})` });
  }

  /** After a driver input for `room`: not back from terminal, not live after an abort reached the node. */
  afterInput(node: NodeName, table: RoomTable, terminals: Map<RoomId, number>, aborted: Set<RoomId>, room: RoomId, on: string): void {
    const r = table.get(room);
    if (!r) return;
    if (aborted.has(room) && table.has(room)) this.violate({ kind: 'ran_after_abort', node, room, detail: `live (${stateName(r.state)}/${r.phase}) after a router abort reached ${node}, on ${on}` });
    if (!isTerminal(r.state) && (terminals.get(room) ?? 0) > 0) this.violate({ kind: 'revival', node, room, detail: `terminal room moved back to ${stateName(r.state)}/${r.phase} on ${on}` });
  }

  /** A watchdog tick of a node: every live room has a deadline and is at most `slackMs` past it. */
  deadlines(node: NodeName, table: RoomTable, terminals: Map<RoomId, number>, slackMs: number, traced: Set<string>): void {
    const now = this.w.now;
    for (const room of table.rooms()) {
      if (!Number.isFinite(room.deadlineAt)) {
        this.violate({ kind: 'no_deadline', node, room: room.id, detail: `live room ${stateName(room.state)}/${room.phase} has no deadline` });
      } else if (now > room.deadlineAt + slackMs) {
        const revived = (terminals.get(room.id) ?? 0) > 0;
        if (!traced.has(room.id)) {
          traced.add(room.id);
          this.w.note(node, room.id, `watchdog: Failed write for ${stateName(room.state)}/${room.phase} swallowed (max(${room.state}, ${KVPoll.Failed}) = ${room.state})`);
        }
        this.violate({
          kind: 'wedge',
          node,
          room: room.id,
          revived,
          detail: `${stateName(room.state)}/${room.phase} is ${ms(now - room.deadlineAt)} ms past its deadline (t=${ms(room.deadlineAt)}) and still live${revived ? '; it had already been Failed and was revived' : ''}`,
        });
      }
    }
  }

  /** `rooms` (bound to a crashed peer) must all be terminal on `node` by now. */
  peerLossBound(node: NodeName, table: RoomTable, rooms: readonly RoomId[], crashed: NodeName, boundMs: number): void {
    for (const id of rooms) {
      const r = table.get(id);
      if (r && !isTerminal(r.state)) this.violate({ kind: 'peer_loss_late', node, room: id, detail: `${crashed} crashed but ${node} still has the room ${stateName(r.state)}/${r.phase} ${boundMs} ms later` });
    }
  }

  /** The end of the world: no live room on a node that is up, no resource still held. */
  final(up: readonly { name: NodeName; table: RoomTable }[]): void {
    const now = this.w.now;
    for (const n of up) {
      for (const room of n.table.rooms()) {
        this.violate({ kind: 'stuck', node: n.name, room: room.id, detail: `still ${stateName(room.state)}/${room.phase} at the end (t=${ms(now)}), deadline was t=${ms(room.deadlineAt)}` });
      }
    }
    for (const h of this.handles) {
      this.violate({ kind: 'leak', node: h.node, room: h.room, detail: `${h.kind} #${h.id} acquired at t=${ms(h.at)} (incarnation ${h.inc}) never released` });
    }
  }
}

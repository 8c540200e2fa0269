/**
 * The simulator's view into the shipped drivers: every input the executors feed a driver is
 * wrapped to trace the room's position change, count the driver's `finish` actions and run the
 * per-input checks (./checks.ts) — nothing the driver decides is changed.
 */
import { failureText } from '../base/errors.js';
import { stateName, type RoomTable } from '../kv/lifecycle.js';
import { isTerminal, type Effect, type Role, type RoomId } from '../kv/types.js';
import type { DecodeAction, DecodeDriver } from '../decode/driver.js';
import type { PrefillAction, PrefillDriver } from '../prefill/driver.js';
import type { Checks, NodeName } from './checks.js';
import type { TraceEntry } from './model.js';

/** The node a driver serves (its fields read at each input: a restart replaces them). */
export interface WatchedNode {
  readonly name: NodeName;
  readonly role: Role;
  terminals: Map<RoomId, number>;
  aborted: Set<RoomId>;
}

/** What the watch reports to. */
export interface WatchHost {
  readonly tracing: boolean;
  readonly legacy: boolean;
  readonly checks: Checks;
  /** The rooms of `room`'s prefill computation (a choice group), lead first; [] for one room. */
  groupOf(room: RoomId): RoomId[];
  label(room: RoomId): string;
  tr(who: TraceEntry['who'], room: RoomId | undefined, text: string): void;
  /** An input did something: the executors may have work in the microtask queue. */
  touched(): void;
  diag(node: NodeName, e: Effect): void;
}

const position = (rooms: RoomTable, id: RoomId): string => {
  const r = rooms.get(id);
  return r ? `${stateName(r.state)}/${r.phase}` : 'unknown';
};

/**
 * Wrap a driver's inputs: trace each position change (REVIVED when a terminal room came back),
 * count its `finish` actions (once per room), check revival and aborts after each input — for
 * the room concerned and the other rooms of its prefill computation.
 */
export function watchDriver<D extends PrefillDriver | DecodeDriver>(w: WatchHost, n: WatchedNode, d: D): D {
  const rec = d as unknown as Record<string, (...args: unknown[]) => unknown>;
  const roomArg: Record<string, (args: unknown[]) => RoomId | undefined> = {
    request: (a) => (Array.isArray(a[0]) ? (a[0][0] as RoomId) : (a[0] as RoomId)),
    message: (a) => (a[2] as { room?: RoomId }).room,
    chunk: (a) => a[1] as RoomId,
    abort: (a) => a[1] as RoomId | undefined,
    fileRefused: (a) => (n.role === 'prefill' ? (a[1] as RoomId) : (a[0] as RoomId)),
  };
  const inputs = ['request', 'message', 'chunk', 'abort', 'fileRefused', 'computeDone', 'progress', 'transferSent', 'transferFailed', 'dialed', 'registerFailed', 'loadDone', 'loadFailed', 'fileTaken', 'proceed', 'generationDone', 'fail', 'tick', 'peerLost', 'shutdown'];
  let depth = 0; // the driver's calls of its own methods are part of the outer input
  for (const name of inputs) {
    const orig = rec[name];
    if (typeof orig !== 'function') continue;
    rec[name] = (...args: unknown[]) => {
      if (depth > 0) return orig.apply(d, args);
      const whole = name === 'tick' || name === 'peerLost' || name === 'shutdown';
      const id = whole ? undefined : (roomArg[name]?.(args) ?? (args[0] as RoomId));
      const group = id && (name === 'computeDone' || name === 'request') ? w.groupOf(id) : [];
      const ids = id ? [id, ...group.filter((x) => x !== id)] : [];
      const before = w.tracing ? ids.map((x) => position(d.rooms, x)) : [];
      depth++;
      let out: (PrefillAction | DecodeAction)[] | { actions: (PrefillAction | DecodeAction)[] } | null;
      try {
        out = orig.apply(d, args) as typeof out;
      } finally {
        depth--;
      }
      const actions = out === null ? [] : Array.isArray(out) ? out : (out.actions ?? []);
      if (actions.length > 0 || !whole) w.touched();
      const label = name === 'message' ? (args[2] as { type: string }).type : name === 'abort' ? `abort:${String(args[2])}` : name;
      if (w.tracing && name !== 'progress' && name !== 'chunk') {
        ids.forEach((x, k) => {
          const a = position(d.rooms, x);
          const r = d.rooms.get(x);
          const revived = (n.terminals.get(x) ?? 0) > 0 && r && !isTerminal(r.state) ? '  [REVIVED a terminal room]' : '';
          const swallowed = w.legacy && before[k] !== 'unknown' && a === before[k] && actions.length === 0 ? '  (legacy: write swallowed by max)' : '';
          w.tr(n.name, x, `driver ${label}${k > 0 ? ` (of ${w.label(id!)}'s computation)` : ''}: ${before[k]} → ${a}${fx(actions)}${revived}${swallowed}`);
        });
      }
      for (const a of actions) {
        if (a.a === 'finish') {
          w.checks.terminal(n.name, n.terminals, a.room, `${stateName(a.state)}: ${a.failure ? failureText(a.failure) : 'kv_done'}`);
          w.tr(n.name, a.room, `TERMINAL ${stateName(a.state)} (${a.failure ? failureText(a.failure) : 'kv_done'})`);
        } else if (a.a === 'diag') w.diag(n.name, a.effect);
      }
      for (const x of ids) w.checks.afterInput(n.name, d.rooms, n.terminals, n.aborted, x, label);
      return out;
    };
  }
  return d;
}

/** Trace label of one driver action. */
function actionLabel(a: PrefillAction | DecodeAction): string {
  if (a.a === 'finish') return `terminal ${stateName(a.state)}`;
  if (a.a === 'diag') {
    const e = a.effect;
    if (e.t === 'illegal') return `illegal ${stateName(e.from)}→${stateName(e.to)}`;
    if (e.t === 'late') return `late ${e.event}`;
    return e.t;
  }
  if (a.a === 'send') return a.msg.type === 'fail' ? `notify_peer(${a.msg.code}: ${a.msg.detail})` : `send ${a.msg.type}`;
  if (a.a === 'release') return a.slot ? 'release slot' : 'release';
  return a.a;
}

/** ' [action, action]' for traces of a driver. */
const fx = (actions: (PrefillAction | DecodeAction)[]): string => (actions.length ? ` [${actions.map(actionLabel).join(', ')}]` : '');

